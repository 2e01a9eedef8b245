"""Engines that drive the connector and server: ``replay`` (vLLM's real scheduler, no model),
``vllm`` (the full engine on CPU or GPU) and ``oracle`` (prefix arithmetic, no server)."""
