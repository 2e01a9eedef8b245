"""The vLLM KV connector: vLLM's side of the cache (DESIGN.md §2).

Importing this package imports neither torch nor vLLM; only the vLLM shim imports vLLM at
module level: :mod:`connector.vllm_connector` (the connector), with
:mod:`connector.vllm_views` (vLLM objects → plain ones) and :mod:`connector.vllm_telemetry`
(connector stats, Prometheus metrics, KV events) (:func:`connector.plugin.register` imports
it when vLLM calls it). Which module runs where:

- vLLM's scheduler process: ``vllm_connector`` (SCHEDULER role) over ``scheduler``
  (tracker, planner: pure), ``scheduler_client`` (lookups, lock release, session end) and
  ``kv_events`` (which chunks the engine announces the cache holds: pure);
- each vLLM worker process (one per TP rank): ``vllm_connector`` (WORKER role) over
  ``worker_client`` (the one object it holds), which delegates to ``worker_registration``
  (identity, pool mapping, registering again), ``worker_stores`` and ``worker_retrieves``
  (the two state machines) and ``worker_spans`` (their spans); ``kv_copy`` (KV blocks ↔ pool
  slots), ``shared_kv`` and ``cuda_ipc`` (the KV the server maps, server-driven);
- every vLLM process: ``plugin``, the ``vllm.general_plugins`` entry point that registers
  the ``KVTBConnector`` name; ``stats`` (what the connector did, for vLLM's metrics: pure);
  the API server process builds the Prometheus metrics of ``vllm_telemetry``;
- anywhere: ``config`` (``kv_connector_extra_config`` keys), ``ops`` (the step's plan),
  ``tracker`` and ``planner`` (plain data and decisions).
"""
