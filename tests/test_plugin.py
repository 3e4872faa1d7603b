"""vLLM finds the connector through the entry point alone."""

from __future__ import annotations

from importlib.metadata import entry_points

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

import vllm_qaic_connector
from vllm_qaic_connector.connector import QAICConnector


def test_entry_point_is_declared():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("qaic_connector") == "vllm_qaic_connector:register"


def test_vllm_plugin_loader_registers_connector_by_name():
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    vllm_qaic_connector.register()  # a second load in one process is harmless
    cfg = KVTransferConfig(kv_connector="QAICConnector", kv_role="kv_both")
    assert cfg.kv_connector_module_path is None
    assert KVConnectorFactory.get_connector_class(cfg) is QAICConnector
