"""NIXL -> QAIC slot across two network namespaces joined by a veth link, UCX over TCP only:
the prefill (tests/qaic_slot_peer.py) stages prompt KV in namespace A, the decode in namespace
B READs it straight into its QAIC slot buffers and decodes the right answers from them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("nixl")

from tests.test_nixl_transport import Peer, run, rx_bytes  # noqa: E402
from vllm_qaic_connector.transports.shm import SHM_DIR  # noqa: E402

PEER = Path(__file__).resolve().parent / "qaic_slot_peer.py"
PID = os.getpid()
PROMPTS = 3
L, H, D = 2, 2, 32  # the tiny model's layers, KV heads, head size (float32)


@contextmanager
def veth_namespaces(ns_a: str, ns_b: str, dev_a: str, dev_b: str) -> Iterator[None]:
    """Two namespaces, ``dev_a`` 10.78.0.1 in A and ``dev_b`` 10.78.0.2 in B; skips where
    namespaces cannot be made, except under CI, which must run the cross-host path."""
    assert shutil.which("ip"), "iproute2 `ip` is missing; scripts/setup_env.sh installs it"
    added = run("ip", "netns", "add", ns_a)
    if added.returncode != 0:
        denied = "ermission" in added.stderr or "not permitted" in added.stderr
        if denied and not os.environ.get("CI"):
            reason = f"cannot create network namespaces: {added.stderr.strip()}"
            print(reason)
            pytest.skip(reason)
        raise AssertionError(added.stderr)
    try:
        for cmd in [
            ("ip", "netns", "add", ns_b),
            ("ip", "link", "add", dev_a, "type", "veth", "peer", "name", dev_b),
            ("ip", "link", "set", dev_a, "netns", ns_a),
            ("ip", "link", "set", dev_b, "netns", ns_b),
            ("ip", "-n", ns_a, "addr", "add", "10.78.0.1/24", "dev", dev_a),
            ("ip", "-n", ns_b, "addr", "add", "10.78.0.2/24", "dev", dev_b),
            ("ip", "-n", ns_a, "link", "set", dev_a, "up"),
            ("ip", "-n", ns_b, "link", "set", dev_b, "up"),
            ("ip", "-n", ns_a, "link", "set", "lo", "up"),
            ("ip", "-n", ns_b, "link", "set", "lo", "up"),
        ]:
            done = run(*cmd)
            assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr}"
        addrs_b = run("ip", "-n", ns_b, "-4", "addr").stdout
        assert "10.78.0.2" in addrs_b and "10.78.0.1" not in addrs_b  # isolation is real
        yield
    finally:
        for ns in (ns_a, ns_b):
            run("ip", "netns", "del", ns)  # takes the veth pair with it
    assert ns_a not in run("ip", "netns", "list").stdout


def _shm_objects(tag: str) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"qaic_kv_{tag}")]


def test_nixl_pull_into_qaic_slots_across_a_veth_link():
    tag = f"sv{PID}"
    ns_a, ns_b, dev_a, dev_b = f"qsA{PID}", f"qsB{PID}", f"qsa{PID}", f"qsb{PID}"
    try:
        with veth_namespaces(ns_a, ns_b, dev_a, dev_b):
            rx_before, t0 = rx_bytes(ns_b, dev_b), time.monotonic()
            prefill = Peer(
                ["ip", "netns", "exec", ns_a, sys.executable, str(PEER), "prefill"]
                + ["--tag", tag, "--prompts", str(PROMPTS)],
                {"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev_a},
            )
            try:
                staged = prefill.expect("STAGED", timeout=120)
                decode = subprocess.run(
                    ["ip", "netns", "exec", ns_b, sys.executable, str(PEER), "decode", staged]
                    + ["--tag", tag],
                    env={**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": dev_b},
                    capture_output=True,
                    text=True,
                    timeout=180,
                )
                out = decode.stdout + decode.stderr
                print(f"--- decode output ({time.monotonic() - t0:.1f}s after start):\n{out}")
                lines = [ln for ln in decode.stdout.splitlines() if ln.startswith("RESULT ")]
                assert lines, out
                result = json.loads(lines[-1].removeprefix("RESULT "))
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
                assert decode.returncode == 0, out
                # The READs really crossed the veth link into the decode's namespace.
                assert rx_bytes(ns_b, dev_b) - rx_before >= result["bytes"]
                assert prefill.close() == "0 0"
            finally:
                prefill.kill()
                print(f"--- prefill output:\n{''.join(prefill.log)}")
    finally:
        left = _shm_objects(tag)
        for name in left:
            os.unlink(os.path.join(SHM_DIR, name))
    assert left == []
