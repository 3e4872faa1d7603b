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


def test_the_proxy_console_script_runs_the_proxy_package():
    """`vllm-qaic-proxy` is the proxy's own top-level package, not a module of the connector."""
    from vllm_qaic_proxy.cli import main

    [script] = [ep for ep in entry_points(group="console_scripts") if ep.name == "vllm-qaic-proxy"]
    assert script.load() is main


def test_vllm_plugin_loader_registers_connector_by_name():
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    vllm_qaic_connector.register()  # a second load in one process is harmless
    cfg = KVTransferConfig(kv_connector="QAICConnector", kv_role="kv_both")
    assert cfg.kv_connector_module_path is None
    assert KVConnectorFactory.get_connector_class(cfg) is QAICConnector


def test_the_layout_the_connector_states_is_the_one_vllm_resolves():
    """``kv_cache_layout`` reaches vLLM's own layout resolution through the connector's
    `get_required_kvcache_layout`; unset, vLLM keeps its backend's choice; a name vLLM does
    not know is refused at start-up, by key."""
    import pytest
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout

    from vllm_qaic_connector.config import parse_config

    vllm_qaic_connector.register()

    def resolved(extra: dict) -> str | None:
        ktc = KVTransferConfig(
            kv_connector="QAICConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
        return get_kv_connector_cache_layout(VllmConfig(kv_transfer_config=ktc))

    assert resolved({"kv_cache_layout": "BLHNC"}) == "BLHNC"
    assert resolved({}) is None
    with pytest.raises(ValueError, match="kv_cache_layout"):
        parse_config({"kv_cache_layout": "NHD"})
