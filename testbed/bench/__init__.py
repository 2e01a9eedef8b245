"""``kvtb bench``: every benchmark in one command, each ratio measured side by side.

Everything runs in the bench process unless said otherwise:

- ``command``: the ``kvtb bench`` command; its sections in order, the report.
- ``config``: settings and sizes (full and ``--quick``), the trace, a section's result.
- ``stats``: samples, spread, interleaved cells, ratios (pure).
- ``figures``: the reported keys, their goals, one figure (pure).
- ``machine``: the machine, versions, the load while a section ran.
- ``report``: ``results.json`` and BENCHMARKS.md (pure).
- ``processes``: engine and peer processes, stopped with their shared-memory files.
- ``replay``: the replay against vLLM's scheduler alone; tracing on/off; metadata only.
- ``loader``: span loading throughput.
- ``cache_driver``, ``ops``: whole store/retrieve against memcpy; tracing per operation.
- ``e2e``: the vLLM section (ours, and LMCache's with ``--peer``); ``vllm_e2e``: our engine
  process (runs in a child).
- ``peer/``: the peer environment, LMCache's server and engines (``lmcache_child`` runs in
  the peer's own Python), the comparisons.
- ``others``, ``copies``, ``pool_allocator``, ``eviction``, ``whatif``, ``tables``: the
  benchmarks without a key, run as modules (``python -m testbed.bench.copies ...``).
"""
