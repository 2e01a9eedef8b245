"""The vLLM plugin: makes ``KVTBConnector`` a connector name vLLM knows.

Installed as the ``kvtb_connector`` entry point of the ``vllm.general_plugins`` group
(pyproject.toml). vLLM calls :func:`register` in each of its processes (API server, engine
core, workers) before it builds a connector, so that

    --kv-transfer-config '{"kv_connector": "KVTBConnector", "kv_role": "kv_both"}'

(or ``KVTransferConfig(kv_connector="KVTBConnector", kv_role="kv_both")``) needs no
``kv_connector_module_path``. Registration is lazy (vLLM imports :mod:`connector.vllm_connector`
only when it builds the connector), idempotent, and never raises: a plugin that raised would
only be logged by vLLM, and the connector would then be missing for a reason nobody sees.
With ``VLLM_PLUGINS`` set, vLLM loads only the plugins it names: include ``kvtb_connector``.
"""

from __future__ import annotations

import logging

CONNECTOR_NAME = "KVTBConnector"
CONNECTOR_MODULE = "connector.vllm_connector"
CONNECTOR_CLASS = "KVTBConnector"

log = logging.getLogger(__name__)


def register() -> None:
    """Registers ``KVTBConnector`` with vLLM's ``KVConnectorFactory`` (no-op if it is already)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
    except ValueError:
        # "already registered": by an earlier call in this process (vLLM may load plugins
        # more than once), which is the same registration.
        log.debug("%s is already registered with vLLM", CONNECTOR_NAME)
