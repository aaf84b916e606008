"""Generation engine: EngineCore, Scheduler, request records, handles, metrics (see docs/engine.md)."""
