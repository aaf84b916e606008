"""Core storage and transfer primitives: device descriptor, paged KV pools, StateImage storage."""
