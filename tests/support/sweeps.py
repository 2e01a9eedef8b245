"""The small runs the tests' sweeps are made of (a sweep file's ``[base]`` lines)."""

SMALL_RUNS = """workload = "chat"
requests = 24
chunk_size = 64
engine_blocks = 16
capacity_tokens = 2048
workload_params = { system_prompt_tokens = 256, concurrent_conversations = 8 }
"""
"""24 chat requests on a 16-block vLLM pool and a 2,048-token cache: seconds per run, and
both caches evict."""
