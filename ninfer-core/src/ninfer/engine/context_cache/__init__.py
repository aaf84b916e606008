"""The context cache's policy (the ResourceManager): which checkpoint a request restores, where prefills
save, which session continues from where, and what pressure reclaims first. The physical stores are the
Program's (``ninfer.contract.context.ContextStore``)."""

from ninfer.engine.context_cache.manager import EVICTION_OUTCOMES, CacheStats, ResourceManager
from ninfer.engine.context_cache.prefix_index import PrefixIndex, token_bytes
from ninfer.engine.context_cache.retention import CostModel
from ninfer.engine.context_cache.sessions import SessionHints

__all__ = ["EVICTION_OUTCOMES", "CacheStats", "CostModel", "PrefixIndex", "ResourceManager", "SessionHints",
           "token_bytes"]
