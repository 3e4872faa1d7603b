"""NIXL -> QAIC slot across two network namespaces joined by a veth link, UCX over TCP only:
the prefill (testbed/qaic_slot_peer.py) stages prompt KV in namespace A, the decode in namespace
B READs it straight into its QAIC slot buffers and decodes the right answers from them."""

from __future__ import annotations

import os
import sys

import nixl  # noqa: E402, F401  (NIXL missing is a failure, never a skip)
import pytest

from testbed.netns import rx_bytes, veth_link  # noqa: E402
from testbed.nixl_peer import Peer  # noqa: E402
from testbed.shipped_model import TINY  # noqa: E402
from testbed.shm_objects import segments  # noqa: E402
from vllm_qaic_connector.transports.shm import SHM_DIR  # noqa: E402

PEER = ["-m", "testbed.qaic_slot_peer"]  # run from the repository root (netns.py)
PID = os.getpid()
pytestmark = [pytest.mark.nixl, pytest.mark.netns]
PROMPTS = 3
L, H, D = TINY.layers, TINY.kv_heads, TINY.head_size


def _shm_objects(tag: str) -> list[str]:
    return sorted(segments(f"qaic_kv_{tag}"))


def test_nixl_pull_into_qaic_slots_across_a_veth_link():
    tag = f"sv{PID}"
    try:
        with veth_link(f"qs{PID}", "10.78.0") as link:
            rx_before = rx_bytes(link.ns_b, link.dev_b)
            prefill = Peer(
                [*link.exec_in("a"), sys.executable, *PEER, "prefill"]
                + ["--tag", tag, "--prompts", str(PROMPTS)],
                link.tcp_env("a"),
            )
            try:
                staged = prefill.expect("STAGED", timeout=120)
                argv = [*PEER, "decode", staged, "--tag", tag]
                result, out, rc = link.run_result("b", argv, timeout=180)
                prompts = result["prompts"]
                assert len(prompts) == PROMPTS
                assert len({p["slot"] for p in prompts}) == PROMPTS  # each in its own slot
                for p in prompts:
                    assert p["correct"] and p["same_as_reference"], p
                    assert p["tail_sentinel"], p  # positions [n, ctx) never written
                    assert p["descriptors"] == L * 2 * H, p  # one per (layer, K|V, head)
                assert result["bytes"] == sum(p["tokens"] for p in prompts) * L * 2 * H * D * 4
                assert result["stale_raised"] and result["stale_registrations_unchanged"]
                assert result["sentinel_intact"] and len(result["untouched_slots"]) >= 2
                assert result["registrations"] == 2 + 2 * L  # staging, arena, K+V per layer
                assert result["registrations_after_close"] == 0
                assert rc == 0, out
                # The READs really crossed the veth link into the decode's namespace.
                assert rx_bytes(link.ns_b, link.dev_b) - rx_before >= result["bytes"]
                assert prefill.close() == "0 0"
            finally:
                prefill.kill()
                print(f"--- prefill output:\n{''.join(prefill.log)}")
    finally:
        left = _shm_objects(tag)
        for name in left:
            os.unlink(os.path.join(SHM_DIR, name))
    assert left == []
