"""The KV cache server: index, locks, sessions, eviction and the shared-memory pool.

Everything here runs in the cache server process (``kvtb server``; ``server.launch`` starts
one from another process). ``app`` is the ZeroMQ loop around ``service.CacheService``, which
checks credentials and routes each request to the handler typed for it on the owner of the
state it touches: ``sessions.Sessions`` (sessions, lookups, lock release, what one engine
holds), ``transfers.Transfers`` (registration, stores, retrieves, aborts; ``copies`` for
server-driven copies), ``admin.Admin`` (ping, configuration, statistics, drops). What they
share is ``context.Shared``: the index (``cache``), the pool (``pools``), the chunk log
(``chunk_log``), the eviction feed, counters, clients and deadlines (``state``), and the tiers
below L1 (``tiers``: their stores, I/O thread and policies; docs/tiers.md).
"""
