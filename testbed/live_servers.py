"""Real `vllm serve` processes for fault tests and soaks: start, wait, signal, stop, check.

Every server runs in a process group of its own (``process_group=0``) inside our session,
as scripts/run_accuracy_test.sh does: signals go to the whole group, and the group is how we
tell afterwards that nothing of a run survived. A ``LiveRun`` owns a temporary folder, a
unique engine-id prefix and every server it started; ``close()`` stops them all and reports
what was left behind (processes, /dev/shm objects). Use it as a context manager or from a
fixture finalizer so that it always runs.

Shared-memory accounting: vLLM's own ``vllm_dist_*``/``psm_*``/``sem.mp-*`` objects outlive
killed processes; new ones that no live process maps or holds open are removed, as the
harness does. ``qaic_kv_*`` objects are never removed here: the connector must clean them up,
so a new one named after this run's engines is a leak.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests

from testbed import copy_task, serve
from testbed.ports import free_port
from testbed.shipped_model import MODEL_DIR, PY, ROOT
from testbed.shm_objects import (
    LEAKABLE,
    QAIC_PREFIX,
    VLLM_LEFTOVERS,
    in_use,
    remove_vllm_leftovers,
    segments,
)

HARNESS = ROOT / "scripts" / "run_accuracy_test.sh"
MODEL = MODEL_DIR
STARTUP_TIMEOUT_S = 300.0
# What an orchestrator gives a stopping server before SIGKILL (Kubernetes' default is 30 s).
# A SIGKILLed group takes its resource tracker with it, so its shm segments stay until the
# engine id restarts: a shorter grace on a busy host reports that as a leak.
STOP_GRACE_S = 30.0


ANSWER_TOKENS = copy_task.answer_max_tokens()

# --- small helpers ---------------------------------------------------------------------------


def _proc_dirs() -> Iterable[Path]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield Path(entry.path)


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    pgrp: int
    start: int  # clock ticks after boot: tells a pid from a reused one
    state: str


def proc_info(pid: int) -> ProcInfo | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()  # fields 3.. of proc(5)
    return ProcInfo(pid, int(fields[2]), int(fields[19]), fields[0])


def group_members(pgid: int) -> list[ProcInfo]:
    """Live (not zombie) processes of process group ``pgid``."""
    out = []
    for proc in _proc_dirs():
        info = proc_info(int(proc.name))
        if info is not None and info.pgrp == pgid and info.state != "Z":
            out.append(info)
    return out


def still_running(seen: Iterable[ProcInfo]) -> list[int]:
    """Pids of ``seen`` that are still the same, live process."""
    alive = []
    for old in seen:
        now = proc_info(old.pid)
        if now is not None and now.start == old.start and now.state != "Z":
            alive.append(old.pid)
    return alive


def rss_bytes(pids: Iterable[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


# --- Prometheus ---------------------------------------------------------------------------


def metric_samples(text: str, name: str) -> list[tuple[str, float]]:
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})?\s+(\S+)$")
    out = []
    for line in text.splitlines():
        m = pattern.match(line)
        if m:
            with contextlib.suppress(ValueError):
                out.append((m.group(1) or "", float(m.group(2))))
    return out


def metric(url: str, name: str, default: float | None = None) -> float:
    """Sum of every sample of ``name`` at ``url``/metrics. Raises LookupError when the
    server exports no such sample, unless ``default`` is given."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    samples = metric_samples(text, name)
    if not samples:
        if default is not None:
            return default
        raise LookupError(f"{url}/metrics has no sample of {name}")
    return sum(v for _, v in samples)


def histogram(url: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts ``le -> count`` of histogram ``name``, summed over labels."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    buckets: dict[float, float] = {}
    for labels, value in metric_samples(text, name + "_bucket"):
        m = re.search(r'le="([^"]+)"', labels)
        if m:
            le = float(m.group(1))
            buckets[le] = buckets.get(le, 0.0) + value
    return buckets


def histogram_quantile(
    before: dict[float, float], after: dict[float, float], q: float
) -> float | None:
    """Upper bucket bound holding quantile ``q`` of the observations between two scrapes."""
    delta = sorted((le, after.get(le, 0.0) - before.get(le, 0.0)) for le in after)
    if not delta or delta[-1][1] <= 0:
        return None
    target = q * delta[-1][1]
    return next(le for le, count in delta if count >= target)


# --- prompts and requests ---------------------------------------------------------------------


def copy_prompts(n: int, seed: str | int = 0, tokens: int | None = None) -> list[tuple[str, str]]:
    """``n`` copy-task (prompt, answer) pairs; ``tokens`` fixes the prompt length."""
    rng = random.Random(f"live-servers-{seed}")
    return [copy_task.make_example(rng, prompt_tokens=tokens) for _ in range(n)]


def random_model(
    tmp_path_factory: pytest.TempPathFactory, arch: str, tokenizer: str = "byte_level"
) -> Path:
    """A random-weights model of ``arch`` with a ``tokenizer`` of that family
    (scripts/make_random_model.py), in a fresh dir."""
    model = tmp_path_factory.mktemp("models") / f"random-{arch}"
    script = str(ROOT / "scripts" / "make_random_model.py")
    cmd = [str(PY), script, str(model), "--arch", arch, "--tokenizer", tokenizer]
    subprocess.run(cmd, check=True)
    return model


def model_copy(dest: Path, other_kv: bool = False) -> Path:
    """The shipped model copied to ``dest``. ``other_kv``: its V and output projections
    negated, so the model computes the same answers from other V (as two fine-tunes of one
    base differ): KV shared with the original turns every answer wrong."""
    shutil.copytree(MODEL_DIR, dest)
    if other_kv:
        from safetensors.torch import load_file, save_file

        weights = dest / "model.safetensors"
        tensors = load_file(weights)
        for name in [n for n in tensors if ".v_proj." in n or ".o_proj." in n]:
            tensors[name] = -tensors[name]
        save_file(tensors, weights, metadata={"format": "pt"})
    return dest


def eagle_drafter(dest: Path, seed: int = 0) -> Path:
    """An EAGLE drafter of the shipped model in ``dest`` (vLLM's EagleLlamaForCausalLM: one
    decoder layer over the token's embedding and the model's hidden state). Random where
    EAGLE trains it, so it rarely guesses right; its own KV layer is what matters here."""
    import torch
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True)
    config = json.loads((MODEL_DIR / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    for path in MODEL_DIR.glob("*token*"):
        shutil.copy(path, dest / path.name)
    base = load_file(MODEL_DIR / "model.safetensors")
    layer = "model.layers.0."  # the input norm is the drafter's to skip
    tensors = {n[len("model.") :]: t for n, t in base.items() if n.startswith(layer)
               and "input_layernorm" not in n}  # fmt: skip
    tensors["embed_tokens.weight"] = base["model.embed_tokens.weight"]
    hidden = config["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    tensors["fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.05
    save_file({n: t.contiguous() for n, t in tensors.items()}, dest / "model.safetensors")
    return dest


def lora_adapter(dest: Path, seed: int, rank: int = 8) -> Path:
    """A random LoRA adapter of the shipped model (PEFT's files) on its attention
    projections, in ``dest``: it changes the answers and the KV."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((MODEL_DIR / "config.json").read_text())
    hidden, head = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
              "o_proj": (hidden, q)}  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (out, inp) in shapes.items():
            at = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{at}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.3
            tensors[f"{at}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.3
    dest.mkdir(parents=True)
    save_file(tensors, dest / "adapter_model.safetensors")
    peft = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": list(shapes), "bias": "none", "lora_dropout": 0.0}  # fmt: skip
    (dest / "adapter_config.json").write_text(json.dumps(peft))
    return dest


def is_correct(body: dict[str, Any], answer: str) -> bool:
    try:
        text = body["choices"][0]["text"]
    except (KeyError, IndexError, TypeError):
        return False
    return isinstance(text, str) and copy_task.is_correct(text, answer)


def completion_body(
    prompt: str, max_tokens: int = ANSWER_TOKENS, params: Any = None
) -> dict[str, Any]:
    """A greedy /v1/completions body, with ``kv_transfer_params`` when given."""
    body: dict[str, Any] = {
        "model": "model",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": 0,
    }
    if params is not None:
        body["kv_transfer_params"] = params
    return body


def complete(
    url: str,
    prompt: str,
    max_tokens: int = ANSWER_TOKENS,
    kv_transfer_params: Any = None,
    timeout: float = 120.0,
) -> tuple[int, dict[str, Any]]:
    """POST /v1/completions, greedy. Returns (HTTP status, JSON body); status 0 with
    ``{"connection_error": ...}`` when no HTTP answer came (refused, reset, timeout), and
    ``{"not_json": text}`` for a body that is not a JSON object."""
    body = completion_body(prompt, max_tokens, kv_transfer_params)
    try:
        resp = requests.post(f"{url}/v1/completions", json=body, timeout=timeout)
    except requests.RequestException as exc:
        return 0, {"connection_error": f"{type(exc).__name__}: {exc}"}
    try:
        payload = resp.json()
    except ValueError:
        return resp.status_code, {"not_json": resp.text[:500]}
    if not isinstance(payload, dict):
        return resp.status_code, {"not_json": resp.text[:500]}
    return resp.status_code, payload


@dataclass
class Streamed:
    """One streamed completion: seconds to the first text, in all, and the text; through
    the proxy, also the prefill leg's seconds (its Server-Timing header)."""

    status: int
    ttft: float
    seconds: float
    chunks: int
    text: str
    error: str = ""
    prefill_s: float = float("nan")


async def stream_completion(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = ANSWER_TOKENS
) -> Streamed:
    """POST a greedy streamed /v1/completions; a failure is in ``error``, never raised."""
    body = {**completion_body(prompt, max_tokens), "stream": True}
    t0, ttft, parts = time.monotonic(), float("nan"), list[str]()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                return Streamed(r.status, ttft, 0.0, 0, "", f"HTTP {r.status}: {await r.text()}")
            async for raw in r.content:
                line = raw.strip()
                if line.startswith(b"data: {"):
                    text = json.loads(line[6:])["choices"][0].get("text") or ""
                    if text and not parts:
                        ttft = time.monotonic() - t0
                    parts.append(text)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Streamed(0, ttft, 0.0, 0, "", f"{type(exc).__name__}: {exc}")
    timing = re.search(r"prefill;dur=([\d.]+)", r.headers.get("Server-Timing", ""))
    prefill_s = float(timing.group(1)) / 1e3 if timing else float("nan")
    return Streamed(200, ttft, time.monotonic() - t0, len(parts), "".join(parts), "", prefill_s)


def token_ids(url: str, prompt: str) -> list[int]:
    """The prompt's token ids, from the server's /tokenize."""
    resp = requests.post(f"{url}/tokenize", json={"model": "model", "prompt": prompt}, timeout=30)
    resp.raise_for_status()
    return [int(t) for t in resp.json()["tokens"]]


def count_tokens(url: str, prompt: str) -> int:
    return len(token_ids(url, prompt))


def stage(prefill_url: str, prompt: str, decode_kv: str | None = None) -> dict[str, Any]:
    """Runs ``prompt`` on a prefill with ``do_remote_decode``; returns the decode's params."""
    params: dict[str, Any] = {"do_remote_decode": True}
    if decode_kv:
        host, port = decode_kv.rsplit(":", 1)
        params.update(decode_host=host, decode_port=int(port))
    status, body = complete(prefill_url, prompt, max_tokens=1, kv_transfer_params=params)
    returned = body.get("kv_transfer_params")
    if status != 200 or not isinstance(returned, dict) or returned.get("error"):
        raise AssertionError(f"staging on {prefill_url} failed: HTTP {status} {str(body)[:400]}")
    return returned


def _is_prefix(text: str, answer: str) -> bool:
    def words(t: str) -> list[str]:  # as copy_task.is_correct splits them
        return t.replace("]", " ] ").replace("[", " [ ").split()

    got, want = words(text), words(answer)
    return got == want[: len(got)]


def outcome(status: int, body: dict[str, Any], answer: str) -> str:
    """``correct`` | ``wrong`` (HTTP 200, wrong tokens) | ``aborted`` (HTTP 200 with
    finish_reason abort/error, and what text came is a prefix of the answer: vLLM answers
    requests it aborts at shutdown that way) | ``error`` (a clean HTTP error: 4xx/5xx with a
    JSON body) | ``unclean`` (no answer, or one that is not JSON)."""
    if status == 200:
        if is_correct(body, answer):
            return "correct"
        try:
            choice = body["choices"][0]
            reason, text = choice.get("finish_reason"), choice.get("text") or ""
        except (KeyError, IndexError, TypeError, AttributeError):
            return "wrong"
        if reason in ("abort", "error") and isinstance(text, str) and _is_prefix(text, answer):
            return "aborted"
        return "wrong"
    if 400 <= status < 600 and "not_json" not in body:
        return "error"
    return "unclean"


def hostile_variants(params: dict[str, Any], closed_port: int) -> dict[str, dict[str, Any]]:
    """Decode params a client could send, made from real ones (``params``): broken
    addresses, wrong types, nonsense sizes. Only the address and ``num_tokens`` are edited;
    everything else stays opaque. ``closed_port``: a port nothing listens on."""
    return {
        "port-1": {**params, "remote_port": -1},
        "bad-host": {**params, "remote_host": "bad host!"},
        "closed-port": {**params, "remote_port": closed_port},
        "port-str": {**params, "remote_port": "http"},
        "port-huge": {**params, "remote_port": 1 << 40},
        "host-dict": {**params, "remote_host": {"x": [1]}},
        "tokens-str": {**params, "num_tokens": "lots"},
        "tokens-huge": {**params, "num_tokens": 10**12},
        "tokens-neg": {**params, "num_tokens": -5},
        "flag-only": {"do_remote_prefill": True},
    }


# --- servers --------------------------------------------------------------------------------


def kv_config(
    role: str,
    engine_id: str,
    side_channel_port: int = 0,
    transport: str = "shm",
    policy: str = "recompute",
    **extra: Any,
) -> dict[str, Any]:
    """``--kv-transfer-config`` for QAICConnector; ``extra`` goes into its extra config."""
    return {
        "kv_connector": "QAICConnector",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "transport": transport,
            "side_channel_port": side_channel_port,
            **extra,
        },
    }


def multi_connector(kv: dict[str, Any]) -> dict[str, Any]:
    """``kv`` as the only child of vLLM's MultiConnector, as operators who add cache tiers
    configure it. The engine id stays on the parent: vLLM's MultiConnector passes it to each
    child and fails on a child that names its own."""
    child = {k: v for k, v in kv.items() if k != "engine_id"}
    return {
        "kv_connector": "MultiConnector",
        "kv_role": kv["kv_role"],
        "engine_id": kv["engine_id"],
        "kv_connector_extra_config": {"connectors": [child]},
    }


class Server:
    """One process group, started from ``argv``; logs to ``<workdir>/<name>.<n>.log``."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], workdir: Path, port: int
    ) -> None:
        self.name, self.argv, self.env, self.workdir, self.port = name, argv, env, workdir, port
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.log_path = workdir / f"{name}.log"
        self.seen: dict[int, ProcInfo] = {}  # every process of this server's groups we saw

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _run_env(self) -> dict[str, str]:
        return dict(self.env)

    def start(self) -> Server:
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} is running"
        self.starts += 1
        self.log_path = self.workdir / f"{self.name}.{self.starts}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                env=self._run_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                process_group=0,  # its own group, in our session (see the module doc)
            )
        self.pids()
        return self

    def pids(self) -> list[int]:
        """Live processes of the current group (remembered for the leak check)."""
        if self.proc is None:
            return []
        members = group_members(self.proc.pid)
        for m in members:
            self.seen.setdefault(m.pid, m)
        return [m.pid for m in members]

    def alive(self) -> bool:
        return self.proc is not None and (self.proc.poll() is None or bool(self.pids()))

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def log_errors(self, limit: int = 8) -> str:
        """The log's first distinct lines that name an error (the root cause of a failed
        start-up usually sits far above the last lines)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        found: list[str] = []
        for line in lines:
            if re.search(r"(Error|Exception)\b|ERROR", line) and line not in found:
                found.append(line.strip()[:400])
                if len(found) == limit:
                    break
        return "\n".join(found)

    def _startup_failure(self, why: str) -> RuntimeError:
        return RuntimeError(
            f"{self.name} {why}; log {self.log_path}\nfirst error lines:\n{self.log_errors()}"
            f"\nlast lines:\n{self.log_tail(25)}"
        )

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> float:
        """Polls /health (`serve.wait_healthy`); returns seconds waited. Fails early when
        the process exits."""
        proc = self.proc
        assert proc is not None

        def gone() -> str | None:
            rc = proc.poll()
            return None if rc is None else f"exited with {rc} during start-up"

        try:
            waited = serve.wait_healthy(self.url, gone, timeout)
        except serve.NotReady as exc:
            raise self._startup_failure(str(exc)) from None
        self.pids()
        return waited

    def kill(self, sig: int = signal.SIGKILL, group: bool = True) -> None:
        """Sends ``sig`` to the whole group, or to the leader only (as a supervisor that
        knows one pid would)."""
        if self.proc is None:
            return
        self.pids()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(self.proc.pid, sig)
            elif self.proc.poll() is None:
                self.proc.send_signal(sig)

    def wait_gone(self, timeout: float) -> bool:
        """True once no process of the group is left (the leader reaped)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None:
                return True
            if self.proc.poll() is not None and not group_members(self.proc.pid):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """TERM the group, wait up to ``grace``, then KILL. Idempotent."""
        if self.proc is None:
            return
        if self.alive():
            self.kill(signal.SIGTERM)
            if not self.wait_gone(grace):
                self.kill(signal.SIGKILL)
                self.wait_gone(10.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)

    def leftover_pids(self) -> list[int]:
        return still_running(self.seen.values())

    def rss(self) -> int:
        return rss_bytes(self.pids())


class VllmServer(Server):
    """``python -m vllm.entrypoints.openai.api_server`` on one core, by default on the
    shipped model."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        core: str,
        kv: dict[str, Any] | None,
        port: int | None = None,
        extra_args: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
        model: Path = MODEL,
    ) -> None:
        port = port or free_port()
        argv = serve.vllm_argv(port, model=model, kv=kv, extra=extra_args or [])
        self.core, self.extra_env = core, dict(extra_env or {})
        env = dict(os.environ)
        super().__init__(name, argv, env, workdir, port)
        self.kv = kv

    @property
    def side_channel(self) -> str:
        """``HOST:PORT`` of the connector's side channel (fixed ports only), an IPv6 host
        bracketed."""
        assert self.kv is not None
        extra = self.kv["kv_connector_extra_config"]
        port, host = extra["side_channel_port"], extra.get("side_channel_host", "127.0.0.1")
        assert port, "side_channel_port 0: the port is only known from kv_transfer_params"
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def engine_id(self) -> str:
        assert self.kv is not None
        return str(self.kv["engine_id"])

    def _run_env(self) -> dict[str, str]:
        # Fresh folders per start: a restart must not find the last incarnation's ipc sockets.
        return serve.vllm_env(
            self.core, self.workdir / f"{self.name}.{self.starts}", self.env, self.extra_env
        )

    def metric(self, name: str, default: float | None = None) -> float:
        return metric(self.url, name, default)


@dataclass
class CleanupReport:
    leftover_pids: dict[str, list[int]] = field(default_factory=dict)
    leaked_qaic: list[str] = field(default_factory=list)  # new qaic_kv_* of our engines
    leaked_other: list[str] = field(default_factory=list)  # other new, unused shm objects
    removed_vllm: list[str] = field(default_factory=list)  # vLLM leftovers we removed
    shm_before: int = 0  # LEAKABLE objects in /dev/shm when the run began (anyone's)
    shm_after: int = 0  # ... after the cleanup

    @property
    def clean(self) -> bool:
        return not (self.leftover_pids or self.leaked_qaic or self.leaked_other)

    def problems(self) -> str:
        parts = []
        if self.leftover_pids:
            parts.append(f"processes still running: {self.leftover_pids}")
        if self.leaked_qaic:
            parts.append(f"qaic_kv_* segments left by the connector: {self.leaked_qaic}")
        if self.leaked_other:
            parts.append(f"other /dev/shm objects left: {self.leaked_other}")
        return "; ".join(parts) or "clean"

    def summary(self) -> str:
        return (
            f"cleanup: {self.problems()}; /dev/shm qaic_kv_/vllm_dist_/psm_/sem.mp- objects "
            f"before={self.shm_before} after={self.shm_after}; vLLM leftovers removed="
            f"{len(self.removed_vllm)}"
        )


class LiveRun:
    """A temporary folder, a unique engine-id prefix, and every server started through it.

    ``close()`` (also on ``__exit__``) stops every server and returns what was left behind.
    """

    def __init__(self, label: str, keep: bool = False) -> None:
        self.tag = re.sub(r"[^A-Za-z0-9]", "", label) + secrets.token_hex(3)
        self.dir = Path(tempfile.mkdtemp(prefix=f"qaic-{label}-"))
        self.keep = keep
        self.servers: list[Server] = []
        self._all_shm_before = segments("")
        self.shm_before = segments()
        self.report: CleanupReport | None = None

    def engine_id(self, role: str) -> str:
        return f"{self.tag}{role}"

    def vllm(
        self,
        name: str,
        core: str,
        kv: dict[str, Any] | None,
        port: int | None = None,
        extra_args: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
        model: Path = MODEL,
    ) -> VllmServer:
        """Starts (does not wait for) a vLLM server; call ``wait_ready`` on it."""
        server = VllmServer(name, self.dir, core, kv, port, extra_args, extra_env, model)
        self.servers.append(server)
        server.start()
        return server

    def proxy(
        self,
        prefills: list[str],
        decodes: list[str],
        decode_kvs: list[str] | None = None,
        host: str = "127.0.0.1",
        options: tuple[str, ...] = (),
    ) -> Server:
        port = free_port()
        argv = [str(PY), "-m", "vllm_qaic_proxy", "--host", host, "--port", str(port)]
        argv += ["--prefill", *prefills, "--decode", *decodes, *options]
        if decode_kvs:
            argv += ["--decode-kv", *decode_kvs]
        server = Server("proxy", argv, {**os.environ, "PYTHONUNBUFFERED": "1"}, self.dir, port)
        self.servers.append(server)
        server.start()
        return server

    def key_file(self) -> str:
        """A fresh side-channel key in a 0600 file of this run."""
        path = self.dir / "side_channel.key"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        return str(path)

    def our_qaic_objects(self, engine_id: str | None = None) -> set[str]:
        """``qaic_kv_*`` objects of this run's engines (of one engine, if given)."""
        prefix = QAIC_PREFIX + (f"{engine_id}_" if engine_id else self.tag)
        return {n for n in segments((QAIC_PREFIX,)) if n.startswith(prefix)}

    def close(self) -> CleanupReport:
        if self.report is not None:
            return self.report
        live = [s for s in self.servers if s.alive()]
        for s in live:
            s.kill(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for s in live:
            if not s.wait_gone(max(0.0, deadline - time.monotonic())):
                s.kill(signal.SIGKILL)
        for s in self.servers:
            s.stop()
        report = CleanupReport(shm_before=len(self.shm_before))
        for s in self.servers:
            left = s.leftover_pids()
            if left:
                report.leftover_pids[s.name] = left
        report.removed_vllm = remove_vllm_leftovers(self.shm_before)
        report.leaked_qaic = sorted(self.our_qaic_objects())
        new_other = {
            n
            for n in segments("") - self._all_shm_before
            if not n.startswith(QAIC_PREFIX) and not n.startswith(VLLM_LEFTOVERS)
        }
        if new_other:
            report.leaked_other = sorted(new_other - in_use())
        report.shm_after = len(segments())
        self.report = report
        if report.clean and not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            print(f"[live_servers] logs kept in {self.dir}", flush=True)
        return report

    def __enter__(self) -> LiveRun:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.keep |= exc_type is not None  # a run that failed keeps its engines' logs
        self.close()


def wait_all_ready(
    *servers: Server, timeout: float = STARTUP_TIMEOUT_S, retries: int = 0
) -> dict[str, float]:
    """Waits for servers started together; returns each one's start-up seconds.

    ``retries``: restart a server that exits during start-up this many times (for set-up
    only, never where the start-up itself is under test). A concurrent run's cleanup that
    removes every new ``sem.mp-*``/``psm_*`` object in /dev/shm (as run_accuracy_test.sh
    does) kills a starting vLLM this way."""
    t0 = time.monotonic()
    ready = {}
    for s in servers:
        for attempt in range(retries + 1):
            try:
                s.wait_ready(max(1.0, timeout - (time.monotonic() - t0)))
                break
            except RuntimeError as exc:
                if attempt == retries or s.alive():
                    raise
                print(f"[live_servers] {s.name} died starting, restarting it: {exc}", flush=True)
                s.start()
        ready[s.name] = round(time.monotonic() - t0, 1)
    return ready


def poll_until(fn: Any, timeout: float, interval: float = 0.5) -> tuple[bool, Any]:
    """Calls ``fn()`` until it returns a truthy value or ``timeout`` passes; returns
    (reached, last value)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return bool(value), value
        time.sleep(interval)


# --- scripts/run_accuracy_test.sh ----------------------------------------------------------


LAST = re.compile(
    r"^accuracy: disagg=(\S+) aggregated=(\S+) agreement=(\S+)% prompts=(\d+) "
    r"transport=(\S+)$"
)


def harness(**env: str) -> tuple[int, str]:
    proc = subprocess.run(
        ["bash", str(HARNESS)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=1200,
        stdin=subprocess.DEVNULL,
    )
    out = proc.stdout + proc.stderr
    print(out[-4000:])
    return proc.returncode, out


def last_line(out: str) -> re.Match:
    lines = [ln for ln in out.splitlines() if ln.startswith("accuracy:")]
    assert lines, "no accuracy line"
    m = LAST.match(lines[-1])
    assert m, lines[-1]
    return m


def shm_names() -> set[str]:
    return segments(LEAKABLE)


def harness_leaves_nothing(**env: str) -> tuple[int, str]:
    """Runs the harness and checks it left no shared-memory objects behind."""
    before = shm_names()
    rc, out = harness(**env)
    left = sorted(shm_names() - before)
    assert not left, f"the run leaked shared-memory objects: {left}"
    return rc, out
