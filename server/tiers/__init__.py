"""The tiers below L1: a hierarchy of stores behind one cache server (docs/tiers.md).

Everything here runs in the cache server process, on its loop, except the stores' calls,
which run on the tiers' I/O thread (``io``). ``spec``: the user's name of a tier
(``KIND[@POLICY]:CAPACITY[:WHERE]``, pure values). ``base``: the interface every lower-tier
store implements (bytes under keys, failures answered with a cause, never raised). ``disk``:
the local-disk store. ``framing``: an object's key and checksum below L1. ``policies``: write,
promotion and prefetch policies by name. ``hierarchy``: which tier holds what, the policies,
the hooks the server calls (stores, hits, L1 evictions, prefetches). ``lookups``: what a
lookup does with the tiers. ``spans``: the tier operations' spans. ``build``: the hierarchy
from the server's config (``STORES`` by kind; the null hierarchy without tiers).
``redis_store``: a tier in Redis, shared by every server that names it (``redis_objects``: a
chunk object as one Redis value; ``redis_tier``: the store as the server builds it);
``redis_process``: a Redis the server or the run starts for itself (it runs where they do).
"""
