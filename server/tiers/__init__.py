"""The tiers below L1: a hierarchy of stores behind one cache server.

Everything here runs in the cache server process. ``spec`` is the user's name of a tier
(``KIND[@POLICY]:CAPACITY[:WHERE]``, pure values); ``base`` the interface every lower-tier
store implements (bytes under keys, failures answered, never raised). ``redis_store`` is a
tier in Redis, shared by every server that names it (``redis_objects``: a chunk object as one
Redis value); ``redis_process`` starts the run's own Redis (it runs where the run's cache
servers are started).
"""
