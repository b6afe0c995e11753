"""The offload engine: expert tiers (device pool, host cache, store), I/O threads, budgets."""
