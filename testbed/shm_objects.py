"""``/dev/shm`` as the tests see it: the one listing of segments, and who still uses them.

``qaic_kv_*`` objects belong to the connector (it must clean them up); ``vllm_dist_*``,
``psm_*`` and ``sem.mp-*`` are vLLM's and multiprocessing's, which outlive killed processes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

SHM_DIR = Path("/dev/shm")
QAIC_PREFIX = "qaic_kv_"
VLLM_LEFTOVERS = ("vllm_dist_", "psm_", "sem.mp-")
LEAKABLE = (QAIC_PREFIX, *VLLM_LEFTOVERS)


def segments(prefixes: str | tuple[str, ...] = LEAKABLE) -> set[str]:
    """Names in /dev/shm that start with one of ``prefixes`` (``""``: every name)."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(prefixes)}
    except FileNotFoundError:
        return set()


def _proc_dirs() -> Iterable[Path]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield Path(entry.path)


def in_use() -> set[str]:
    """/dev/shm names some live process maps or holds open."""
    used: set[str] = set()
    for proc in _proc_dirs():
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                i = line.find("/dev/shm/")
                if i >= 0:
                    used.add(line[i + 9 :].removesuffix(" (deleted)").strip())
        with contextlib.suppress(OSError):
            for fd in os.scandir(proc / "fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(fd.path)
                    if target.startswith("/dev/shm/"):
                        used.add(target[9:].removesuffix(" (deleted)"))
    return used


def remove_vllm_leftovers(before: set[str]) -> list[str]:
    """Removes vLLM's shm objects that appeared since ``before`` and nobody uses any more."""
    new = segments(VLLM_LEFTOVERS) - before
    if not new:
        return []
    used = in_use()
    removed = []
    for name in sorted(new - used):
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / name).unlink()
            removed.append(name)
    return removed
