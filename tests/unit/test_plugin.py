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


# Run in the Dynamo venv (scripts/setup_dynamo_env.sh): Dynamo's own vLLM worker code picks
# the P/D handoff for the configured connector, before and after vLLM loads the plugins.
_DYNAMO_PICKS = """
import json, sys
from types import SimpleNamespace
from vllm.config import KVTransferConfig
from vllm.plugins import load_general_plugins
from dynamo.vllm.kv_connector_protocols import make_kv_connector_protocol

ktc = KVTransferConfig(kv_connector="QAICConnector", kv_role="kv_producer")
cfg = SimpleNamespace(kv_transfer_config=ktc)
try:
    make_kv_connector_protocol(cfg)
    refused = ""
except ValueError as exc:
    refused = str(exc)
load_general_plugins()
protocol = make_kv_connector_protocol(cfg)
ticket = json.loads(sys.argv[1])
print(json.dumps({
    "refused_before": refused,
    "prefill": protocol.prefill_request_kv_transfer_params(),
    "decode": protocol.decode_request_kv_transfer_params(
        SimpleNamespace(kv_transfer_params=ticket)
    ),
}))
"""


def test_dynamo_takes_the_connector_by_name():
    """Issue #73: Dynamo's vLLM worker refuses a connector name missing from its table of
    P/D protocols; the entry point enters ours (NixlConnector's shape) where Dynamo is
    installed, without a change to Dynamo's files. Its prefill params are what our
    prefill takes, and the decode gets the prefill's ticket as it was returned."""
    import json
    import os
    import subprocess

    from testbed.dynamo_up import DPY, DYNAMO_VENV
    from testbed.serve import ROOT
    from vllm_qaic_connector.protocol.routed_params import routed_params
    from vllm_qaic_connector.protocol.ticket import parse_remote_prefill

    if not DPY.exists():  # the Dynamo venv is a test dependency: bring it, or fail
        env = {**os.environ, "DYNAMO_VENV": str(DYNAMO_VENV)}
        subprocess.run(["bash", str(ROOT / "scripts" / "setup_dynamo_env.sh")], env=env, check=True)
    ticket = {
        "do_remote_prefill": True, "remote_engine_id": "p0", "remote_host": "127.0.0.1",
        "remote_port": 5600, "remote_request_id": "r1", "num_tokens": 130, "staging_offset": 0,
        "staged_layout": "LBHNC", "staged_block_size": 128, "incarnation": "i", "generation": 1,
        "prompt_hash": "0" * 32, "lease_s": 30.0, "expires_at": 2e9, "ticket_mac": "ab",
    }  # fmt: skip
    out = subprocess.run(
        [str(DPY), "-c", _DYNAMO_PICKS, json.dumps(ticket)],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    picked = json.loads(out.stdout.strip().splitlines()[-1])
    assert "Unsupported kv_connector='QAICConnector'" in picked["refused_before"]
    assert routed_params(picked["prefill"]).do_remote_decode
    assert picked["decode"] == ticket
    parse_remote_prefill(picked["decode"])  # still a ticket our decode takes
