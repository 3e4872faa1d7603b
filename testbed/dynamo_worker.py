"""``python -m dynamo.vllm`` (Dynamo 1.6.1's vLLM worker) on this project's vLLM 0.32, Dynamo's
files unchanged: run in the Dynamo venv (scripts/setup_dynamo_env.sh) as

    python -m testbed.dynamo_worker [dynamo.vllm arguments]

``dynamo.vllm.main`` imports ``get_engine_zmq_addresses`` from ``vllm.v1.engine.utils`` (vLLM
0.31) for ``--embedding-worker-processes``; vLLM 0.32 has no such function, and the import
stops the worker before it parses its arguments. It is added here as one that refuses, so
that path (never taken by a text model on one engine) fails by name. The venv's other gap,
torchvision on CPU torch, is bridged at every start-up there (testbed/dynamo_venv/).
"""

from __future__ import annotations

import runpy
import sys
from typing import NoReturn

import vllm.v1.engine.utils


def _no_engine_zmq_addresses(*args: object, **kwargs: object) -> NoReturn:
    raise NotImplementedError(
        "vLLM 0.32 has no get_engine_zmq_addresses: Dynamo 1.6.1's "
        "--embedding-worker-processes needs vLLM 0.31"
    )


def main() -> None:
    if not hasattr(vllm.v1.engine.utils, "get_engine_zmq_addresses"):
        vllm.v1.engine.utils.get_engine_zmq_addresses = _no_engine_zmq_addresses  # type: ignore[attr-defined]
    sys.argv[0] = "dynamo.vllm"
    runpy.run_module("dynamo.vllm", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
