"""KV cache events in vLLM's format and transport (ZMQ PUB + replay), for prefix-aware routers.

``atom.kv_events.events.start_kv_events`` attaches a publisher to an engine's block pool;
``KVEvents.tier_stored`` / ``tier_removed`` report blocks a tier holds. docs/SCALING.md
describes the deployment. Only the config is imported here (no ZMQ until events are on).
"""

from atom.kv_events.config import KVEventsConfig

__all__ = ["KVEventsConfig"]
