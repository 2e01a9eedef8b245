"""Fleets: N replay instances behind a router, sharing a cache server (or one each).

Everything here runs in the engine process, beside the instances (``testbed.engine.fleet``
builds them; :mod:`testbed.engine.virtual_clock` drives them) or beside the HTTP clients of
the ``serve`` engine. Pure modules (no vLLM) unless said otherwise:

- :mod:`.block_index`: which holder (an instance, a cache server) holds which block hashes,
  and the longest prefix of a request each holds;
- :mod:`.kv_index`: that index kept from vLLM's KV events, per instance's prefix cache and per
  cache server (the ``medium`` of an event says which);
- :mod:`.kv_events` (vLLM shim): vLLM's event types into the index, an in-process publisher
  for the replay instances' schedulers and a ZeroMQ subscriber for vLLM servers;
- :mod:`.load`: the router's book of what it sent where (queued and running tokens);
- :mod:`.routers`: the routing strategies, tiny classes behind :data:`.routers.ROUTERS`;
- :mod:`.dispatch`: one routing decision (what the router sees, its choice, the
  ``kvcache.route`` span that records both and what each instance held);
- :mod:`.serve_routing`: routing the serve engine's requests among vLLM servers.
"""
