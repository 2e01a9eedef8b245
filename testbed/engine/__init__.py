"""Engines that drive the connector and server: ``replay`` (vLLM's real scheduler, no model),
``fleet`` (replay instances behind a router, on the virtual clock: ``placement``), ``vllm``
(the full engine on CPU or GPU) and ``serve`` (vLLM OpenAI servers over HTTP). The oracle
(prefix arithmetic, no server) has no engine here: its model is ``testbed.models.oracle``,
its run ``testbed.run.oracle``."""
