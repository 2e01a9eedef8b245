"""The vLLM KV connector: vLLM's side of the cache (DESIGN.md §2).

Importing this package imports neither torch nor vLLM; only :mod:`connector.vllm_connector`
imports vLLM at module level (:func:`connector.plugin.register` does when vLLM calls it).
Which module runs where:

- vLLM's scheduler process: ``vllm_connector`` (SCHEDULER role) over ``scheduler``
  (tracker, planner: pure) and ``scheduler_client`` (lookups, lock release, session end);
- each vLLM worker process (one per TP rank): ``vllm_connector`` (WORKER role) over
  ``worker_client`` (register, store, retrieve) and ``kv_copy`` (KV blocks ↔ pool slots);
- every vLLM process: ``plugin``, the ``vllm.general_plugins`` entry point that registers
  the ``KVTBConnector`` name;
- anywhere: ``config`` (``kv_connector_extra_config`` keys), ``ops`` (the step's plan),
  ``tracker`` and ``planner`` (plain data and decisions).
"""
