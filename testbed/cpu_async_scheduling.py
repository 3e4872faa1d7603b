"""`vllm serve` with vLLM's async scheduling on CPU, as GPU engines run by default.

vLLM 0.32 schedules step N+1 before step N's output is back on a GPU (``async_scheduling``
resolves to on there), so a connector's scheduler half meets requests with output
placeholders, finishing while a later step is in flight. vLLM's CPU platform turns it off
("async scheduling is not required on CPU"), so the suite never met it. Its CPU model runner
does run it: the tiny model answered 16 copy prompts of 16 right. This module undoes the
platform's override in the API server's process, where the engine's config is made and
from where it travels to the engine core, then runs vLLM's API server with the same argv.

    python -m testbed.cpu_async_scheduling --async-scheduling <vllm api_server args>
"""

from __future__ import annotations

import runpy
import sys
from typing import Any

from vllm.platforms import cpu

_platform_check = cpu.CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]


def _keep_async_scheduling(cls: type, vllm_config: Any) -> None:
    wanted = vllm_config.scheduler_config.async_scheduling
    _platform_check(cls, vllm_config)
    vllm_config.scheduler_config.async_scheduling = wanted
    print(f"[testbed] async scheduling kept {wanted}", file=sys.stderr, flush=True)  # harness


cpu.CpuPlatform.check_and_update_config = classmethod(_keep_async_scheduling)  # type: ignore[method-assign, assignment]

if __name__ == "__main__":
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
