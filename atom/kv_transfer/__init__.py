"""External KV tiers. Only this package imports lmcache, and only lazily."""
