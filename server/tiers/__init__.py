"""The tiers below L1: stores of chunk bytes behind one interface (``server.tiers.base``).

All run in the cache server process, except ``redis_process``, which runs where the run's
cache servers are started (it starts the run's own Redis). ``redis_store``: a tier in Redis,
shared by every server that names it; ``redis_objects``: a chunk object as one Redis value.
"""
