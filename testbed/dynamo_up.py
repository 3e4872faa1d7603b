"""Issue #73, 1P1D behind Dynamo on one host: Dynamo's frontend with its KV-aware router,
one prefill and one decode ``dynamo.vllm`` worker with QAICConnector (shm, keyed tickets),
discovery through files (``--discovery-backend file``: no etcd or NATS to start), requests
over TCP and KV events over ZMQ; beside them a plain `vllm serve` of the same model as the
reference. Completions and chat, streamed and not, through the frontend must equal vLLM
alone (greedy), every one from KV the decode loaded; afterwards no KV block or staging page
may still be held. Dynamo runs from its own venv (scripts/setup_dynamo_env.sh, $DYNAMO_VENV):

    python -m testbed.dynamo_up [--prompts N] [--keep]    # `make dynamo`

Last line: ``dynamo: N requests equal to vLLM alone, N loaded, ...`` or ``FAIL: ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from testbed import copy_task, ports
from testbed.proxy_clients import CHAT_TEMPLATE
from testbed.serve import KV_CACHE_BYTES, ROOT, vllm_argv, vllm_env, wait_healthy
from testbed.shipped_model import MODEL_DIR, TINY

DYNAMO_VENV = Path(os.environ.get("DYNAMO_VENV", ROOT / ".venv-dynamo"))
DPY = DYNAMO_VENV / "bin" / "python"
MODES = ("completion", "completion-stream", "chat", "chat-stream")
ANSWER_TOKENS = 24


def model_with_chat_template(run_dir: Path) -> Path:
    """The shipped model with a chat template that sends the text as is (it has none):
    Dynamo's frontend templates chat itself, from the model card the worker publishes."""
    model = run_dir / "model"
    model.mkdir()
    for f in MODEL_DIR.iterdir():
        (model / f.name).symlink_to(f)
    cfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").unlink()
    cfg["chat_template"] = CHAT_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    return model


def worker_argv(model: Path, mode: str, ktc: dict[str, Any], events_port: int) -> list[str]:
    events = {
        "publisher": "zmq", "endpoint": f"tcp://*:{events_port}", "enable_kv_cache_events": True,
    }  # fmt: skip
    return [
        str(DPY), "-m", "testbed.dynamo_worker", "--model", str(model),
        "--served-model-name", "model", "--disaggregation-mode", mode,
        "--block-size", "128", "--max-model-len", str(TINY.max_model_len), "--seed", "0",
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enforce-eager",
        "--kv-transfer-config", json.dumps(ktc), "--kv-events-config", json.dumps(events),
    ]  # fmt: skip


def ktc(role: str, engine_id: str, side_channel_port: int) -> dict[str, Any]:
    extra = {"transport": "shm", "side_channel_port": side_channel_port}
    return {
        "kv_connector": "QAICConnector", "kv_role": role, "engine_id": engine_id,
        "kv_load_failure_policy": "fail", "kv_connector_extra_config": extra,
    }  # fmt: skip


def ask(url: str, mode: str, prompt: str) -> str:
    """One greedy request; the answer's text (streamed ones joined)."""
    chat = mode.startswith("chat")
    body: dict[str, Any] = {"model": "model", "max_tokens": ANSWER_TOKENS, "temperature": 0.0}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    stream = mode.endswith("stream")
    body["stream"] = stream
    path = "/v1/chat/completions" if chat else "/v1/completions"
    resp = requests.post(url + path, json=body, timeout=120, stream=stream)
    if resp.status_code != 200:
        raise RuntimeError(f"{mode} to {url}: HTTP {resp.status_code} {resp.text[:500]}")
    if not stream:
        choice = resp.json()["choices"][0]
        return str(choice["message"]["content"] if chat else choice["text"])
    parts = []
    for line in resp.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            for c in json.loads(line[6:])["choices"]:
                parts.append((c.get("delta") or {}).get("content") or "" if chat else c["text"])
    return "".join(parts)


def metric(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ")
    )


class Run:
    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.dir / f"{name}.log", "wb")  # noqa: SIM115 (closed by the process)
        self.procs[name] = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
            preexec_fn=os.setpgrp,  # noqa: PLW1509 (each server leads a group cleanup signals)
        )  # fmt: skip

    def gone(self) -> str | None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                return f"{name} exited with {p.returncode}"
        return None

    def stop(self) -> None:
        for p in self.procs.values():
            with_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with_group(p.pid, signal.SIGKILL)
                p.wait()

    def tail(self) -> None:
        for name in self.procs:
            lines = (self.dir / f"{name}.log").read_text(errors="replace").splitlines()
            print(f"--- last lines of {name}.log", *lines[-25:], sep="\n")


def with_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def wait_model(url: str, run: Run, timeout: float) -> None:
    """Until the frontend lists the model and answers a request through both workers."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if why := run.gone():
            raise RuntimeError(why)
        try:
            models = requests.get(url + "/v1/models", timeout=2).json().get("data", [])
            if any(m.get("id") == "model" for m in models):
                return
        except (requests.RequestException, ValueError):
            pass
        time.sleep(1)
    raise RuntimeError(f"the frontend listed no model in {timeout:.0f}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="per mode (4 modes)")
    ap.add_argument("--startup-timeout", type=float, default=420)
    ap.add_argument("--keep", action="store_true", help="keep the run folder (logs)")
    args = ap.parse_args()
    if not DPY.exists():
        print(f"FAIL: no Dynamo venv at {DYNAMO_VENV}: run scripts/setup_dynamo_env.sh")
        return 1
    run_dir = Path(tempfile.mkdtemp(prefix="qaic-dynamo."))
    run, status = Run(run_dir), 1
    try:
        status = bring_up_and_check(run, args)
    except Exception as exc:  # noqa: BLE001 (reported with the servers' logs)
        print(f"FAIL: {type(exc).__name__}: {exc}")
        run.tail()
    finally:
        run.stop()
        if args.keep or status:
            print(f"run kept in {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    return status


def bring_up_and_check(run: Run, args: argparse.Namespace) -> int:
    model = model_with_chat_template(run.dir)
    http, ref, d_side, p_events, d_events, p_sys, d_sys = (ports.free_port() for _ in range(7))
    rid = f"dyn{os.getpid()}"
    common = {
        "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(run.dir / "discovery"),
        "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq", "DYN_NAMESPACE": rid,
        "PYTHONPATH": str(ROOT), "QAIC_KV_SIDE_CHANNEL_KEY": secrets.token_hex(16),
        "PYTHONHASHSEED": "0",  # KV event block hashes agree across the workers
    }  # fmt: skip
    for name, core, mode, kv, events, system in (
        ("prefill", "0", "prefill", ktc("kv_producer", f"{rid}p", 0), p_events, p_sys),
        ("decode", "1", "decode", ktc("kv_consumer", f"{rid}d", d_side), d_events, d_sys),
    ):
        sys_env = {"DYN_SYSTEM_ENABLED": "true", "DYN_SYSTEM_PORT": str(system)}
        env = vllm_env(core, run.dir / name, extra={**common, **sys_env})
        run.start(name, ["taskset", "-c", core, *worker_argv(model, mode, kv, events)], env)
    frontend = [str(DPY), "-m", "dynamo.frontend", "--router-mode", "kv",
                "--http-host", "127.0.0.1", "--http-port", str(http)]  # fmt: skip
    run.start("frontend", frontend, {**os.environ, **common})
    run.start("reference", vllm_argv(ref, model=model), vllm_env("0", run.dir / "reference"))
    url, ref_url = f"http://127.0.0.1:{http}", f"http://127.0.0.1:{ref}"
    t0 = time.monotonic()
    wait_healthy(ref_url, run.gone, args.startup_timeout)
    wait_model(url, run, args.startup_timeout)
    print(f"[dynamo] frontend, workers, reference up in {time.monotonic() - t0:.0f}s", flush=True)
    p_metrics, d_metrics = f"http://127.0.0.1:{p_sys}", f"http://127.0.0.1:{d_sys}"
    prompts = copy_task.heldout_prompts(args.prompts * len(MODES) + 30)
    # The frontend lists the model once one worker registered: until a request comes back
    # from loaded KV, both are not yet in (a lone decode would prefill it itself).
    for prompt, _ in prompts[-30:]:
        before = metric(d_metrics, "vllm:qaic_kv_loaded_requests_total")
        ask(url, "completion", prompt)
        time.sleep(1)
        if metric(d_metrics, "vllm:qaic_kv_loaded_requests_total") > before:
            break
    else:
        raise RuntimeError("no warm-up request came from loaded KV (see the decode's metrics)")
    print(f"[dynamo] a request came from loaded KV {time.monotonic() - t0:.0f}s in", flush=True)
    loaded0 = metric(d_metrics, "vllm:qaic_kv_loaded_requests_total")
    failures, sent, correct = [], 0, 0
    for i, mode in enumerate(MODES):
        for prompt, answer in prompts[i * args.prompts : (i + 1) * args.prompts]:
            got, want = ask(url, mode, prompt), ask(ref_url, mode, prompt)
            sent += 1
            correct += copy_task.is_correct(got, answer)
            if got != want:
                failures.append(f"{mode}: Dynamo answered {got!r}, vLLM alone {want!r}")
    time.sleep(2)  # the last step's connector stats reach the metrics
    loaded = metric(d_metrics, "vllm:qaic_kv_loaded_requests_total") - loaded0
    load_failures = metric(d_metrics, "vllm:qaic_kv_load_failures_total")
    pages = metric(p_metrics, "vllm:qaic_kv_staging_pages_in_use")
    engines = (("prefill", p_metrics), ("decode", d_metrics))
    usage = {n: metric(u, "vllm:kv_cache_usage_perc") for n, u in engines}
    if loaded != sent or load_failures:
        failures.append(f"the decode loaded {loaded:.0f} of {sent}, {load_failures:.0f} failed")
    if pages or any(usage.values()):
        failures.append(f"held after the run: staging pages {pages:.0f}, KV cache usage {usage}")
    for f in failures:
        print(f"FAIL: {f}")
    print(
        f"dynamo: {sent - sum(f.split(':')[0] in MODES for f in failures)} of {sent} requests "
        f"equal to vLLM alone ({', '.join(MODES)}), {loaded:.0f} loaded, {load_failures:.0f} load "
        f"failures, copy task {correct}/{sent} correct, staging pages held {pages:.0f}, "
        f"KV usage {usage}"
    )
    for name, u in engines:  # for the record: what the connector and vLLM counted
        (run.dir / f"{name}_metrics.txt").write_text(requests.get(u + "/metrics", timeout=10).text)
    if failures:
        run.tail()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
