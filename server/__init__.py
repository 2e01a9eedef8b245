"""The KV cache server: index, locks, sessions, eviction and the shared-memory pool."""
