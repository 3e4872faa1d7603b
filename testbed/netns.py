"""Two network namespaces joined by a veth pair: the cross-host NIXL tests' "network"."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from testbed.shipped_model import ROOT


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def rx_bytes(ns: str, dev: str) -> int:
    shown = run("ip", "-n", ns, "-s", "-j", "link", "show", dev)
    return int(json.loads(shown.stdout)[0]["stats64"]["rx"]["bytes"])


@dataclass(frozen=True)
class VethLink:
    ns_a: str
    ns_b: str
    dev_a: str  # in ns_a, address <subnet>.1
    dev_b: str  # in ns_b, address <subnet>.2

    def exec_in(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns_a if side == "a" else self.ns_b]

    def tcp_env(self, side: str) -> dict[str, str]:
        """UCX over TCP only, on this side's veth device."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.dev_a if side == "a" else self.dev_b}

    def run_result(self, side: str, argv: list[str], timeout: float) -> tuple[dict, str, int]:
        """Runs ``python argv...`` in one namespace (UCX over TCP); returns the JSON of its
        last ``RESULT`` line, its whole output (also printed) and its exit status."""
        t0 = time.monotonic()
        done = subprocess.run(
            [*self.exec_in(side), sys.executable, *argv],
            env={**os.environ, **self.tcp_env(side)},
            cwd=ROOT,  # where `-m testbed...` finds the testbed
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        out = done.stdout + done.stderr
        print(f"--- {argv[0]} output ({time.monotonic() - t0:.1f}s):\n{out}")
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        assert lines, out
        return json.loads(lines[-1].removeprefix("RESULT ")), out, done.returncode


@contextmanager
def veth_link(tag: str, subnet: str) -> Iterator[VethLink]:
    """Namespaces ``{tag}A``/``{tag}B`` joined by a veth pair on ``subnet`` (e.g. "10.77.0").
    Skips where namespaces cannot be made, except under CI, which must run cross-host paths."""
    assert shutil.which("ip"), "iproute2 `ip` is missing; scripts/setup_env.sh installs it"
    link = VethLink(f"{tag}A", f"{tag}B", f"{tag}a", f"{tag}b")
    added = run("ip", "netns", "add", link.ns_a)
    if added.returncode != 0:
        denied = "ermission" in added.stderr or "not permitted" in added.stderr
        if denied and not os.environ.get("CI"):
            reason = f"cannot create network namespaces: {added.stderr.strip()}"
            print(reason)
            pytest.skip(reason)
        raise AssertionError(added.stderr)
    a, b = link.ns_a, link.ns_b
    try:
        for cmd in [
            ("ip", "netns", "add", b),
            ("ip", "link", "add", link.dev_a, "type", "veth", "peer", "name", link.dev_b),
            ("ip", "link", "set", link.dev_a, "netns", a),
            ("ip", "link", "set", link.dev_b, "netns", b),
            ("ip", "-n", a, "addr", "add", f"{subnet}.1/24", "dev", link.dev_a),
            ("ip", "-n", b, "addr", "add", f"{subnet}.2/24", "dev", link.dev_b),
            ("ip", "-n", a, "link", "set", link.dev_a, "up"),
            ("ip", "-n", b, "link", "set", link.dev_b, "up"),
            ("ip", "-n", a, "link", "set", "lo", "up"),
            ("ip", "-n", b, "link", "set", "lo", "up"),
        ]:
            done = run(*cmd)
            assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr}"
        addrs_b = run("ip", "-n", b, "-4", "addr").stdout  # isolation is real
        assert f"{subnet}.2" in addrs_b and f"{subnet}.1" not in addrs_b
        yield link
    finally:
        for ns in (a, b):
            run("ip", "netns", "del", ns)  # takes the veth pair with it
    assert a not in run("ip", "netns", "list").stdout
