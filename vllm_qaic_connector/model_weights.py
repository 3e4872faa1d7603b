"""Which weights compute the KV: the checkpoint's fingerprint (the handshake carries it) and
a request's LoRA adapter's (its ticket carries it).

Peers may share KV only if the same weights computed it. A model's name cannot say so: a
rolling upgrade replaces the weights under the same path (and, measured, the decode then
answered every prompt wrongly, with HTTP 200), while two hosts often load one checkpoint
from different paths (a local folder here, a hub id there). So the fingerprint reads the
checkpoint's files, not the loaded parameters: a rank holds only its TP shard, and peers'
TP sizes may differ.

What it reads: for a safetensors file, each tensor's name, dtype and shape and 64 bytes at
its start, middle and end; for any other weights file, its size and 4 KiB at 64 places.
That is three small reads per tensor, milliseconds from the page cache. A fine-tune, a
merged adapter or a re-quantized checkpoint rewrites every tensor it touches; a change
that spares every sampled byte is missed. The model's quantization and RoPE settings (which
``hf_overrides`` can change) are part of it too. An adapter's config (rank, scaling,
target modules) is part of its fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TENSOR_SAMPLE = 64  # bytes at each of a tensor's start, middle and end
FILE_SAMPLES, FILE_SAMPLE = 64, 4096  # for files that are not safetensors
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")  # HF config spellings


def kv_settings(quantization: str | None, hf_config: Any, max_model_len: int = 0) -> str:
    """What besides the files changes the KV: the quantization, RoPE (which
    ``hf_overrides`` can change) and, for LongRoPE (Phi-3 and kin), whether vLLM applies
    its long factors, which it does where max_model_len passes the original context."""
    rope = {k: getattr(hf_config, k, None) for k in ROPE_KEYS}
    settings: list[Any] = [quantization, rope]
    for params in (p for p in rope.values() if isinstance(p, dict)):
        if "longrope" in (params.get("rope_type"), params.get("type")):
            key = "original_max_position_embeddings"
            original = params.get(key) or getattr(hf_config, key, None) or 0
            settings.append({"long_factors": max_model_len > int(original)})
    return json.dumps(settings, sort_keys=True, default=str)


def sample_offsets(start: int, end: int, count: int, size: int) -> list[int]:
    """``count`` offsets of ``size``-byte reads spread evenly over ``[start, end)``."""
    last = max(start, end - size)
    return sorted({start + (last - start) * i // max(1, count - 1) for i in range(count)})


def _safetensors(f: BinaryIO, digest: hashlib._Hash) -> None:
    (header_len,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(header_len))
    for name in sorted(k for k in header if k != "__metadata__"):
        tensor = header[name]
        digest.update(f"{name}|{tensor['dtype']}|{tensor['shape']}".encode())
        start, end = tensor["data_offsets"]
        for at in sample_offsets(start, end, 3, TENSOR_SAMPLE):
            f.seek(8 + header_len + at)
            digest.update(f.read(min(TENSOR_SAMPLE, end - at)))


def _any_file(f: BinaryIO, size: int, digest: hashlib._Hash) -> None:
    digest.update(str(size).encode())
    for at in sample_offsets(0, size, FILE_SAMPLES, FILE_SAMPLE):
        f.seek(at)
        digest.update(f.read(FILE_SAMPLE))


def checkpoint_fingerprint(folder: Path, settings: str) -> str:
    """The fingerprint of the weights files in ``folder`` and ``settings``; "" where the
    folder holds none (peers then compare the model's name)."""
    files = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    if not files:
        return ""
    digest = hashlib.sha256(settings.encode())
    safetensors = [p for p in files if p.suffix == ".safetensors"]
    for path in safetensors or files:  # vLLM loads safetensors where there are any
        with path.open("rb") as f:
            if path.suffix == ".safetensors":
                _safetensors(f, digest)
            else:
                _any_file(f, path.stat().st_size, digest)
    return digest.hexdigest()[:16]


def checkpoint_folder(model: str, revision: str | None, download_dir: str | None) -> Path | None:
    """Where vLLM loaded ``model`` from on this host: its folder, or the hub cache's
    snapshot; None where neither is here (another loader, ModelScope)."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            model, revision=revision, cache_dir=download_dir, local_files_only=True
        )
    except Exception:  # not in the hub cache: no fingerprint, not an error
        return None
    return Path(path)


_adapters: dict[tuple[str, ...], str] = {}  # by the adapter's files' names, sizes and times


def adapter_fingerprint(lora: Any) -> str:
    """The fingerprint of a request's LoRA adapter (a ``LoRARequest``), "" for the base
    model; its name where its files are not on this host. Recomputed when its files
    change: an adapter reloaded in place under its name computes other KV."""
    if lora is None:
        return ""
    folder = checkpoint_folder(lora.lora_path, None, None) if lora.lora_path else None
    files = sorted(folder.iterdir()) if folder is not None else []
    key = (lora.lora_name, *(f"{p}|{p.stat().st_size}|{p.stat().st_mtime_ns}" for p in files))
    if key not in _adapters:
        config = folder / "adapter_config.json" if folder is not None else None
        settings = config.read_text() if config is not None and config.is_file() else ""
        found = checkpoint_fingerprint(folder, settings) if folder is not None else ""
        _adapters[key] = found or f"name:{lora.lora_name}"
    return _adapters[key]
