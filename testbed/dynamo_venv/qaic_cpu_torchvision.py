"""Installed into the Dynamo venv by scripts/setup_dynamo_env.sh, with a .pth file that
imports it at every start-up there (vLLM's engine processes too).

Dynamo's multimodal helpers import transformers' Qwen2-VL image processor, which imports
torchvision, and with torchvision installed transformers imports it wherever vLLM loads a
config. PyPI's torchvision is a CUDA build: its ops cannot load beside torch+cpu (no
libtorch_cuda), and its import then fails on two fake-kernel registrations that, unlike its
others, do not check whether its ops loaded. This defines those two op schemas just before
torchvision is first imported, so the import finishes; the ops stay unavailable (no image
input is served here). A CPU build of torchvision would make this unnecessary.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

_kept: list[Any] = []  # the schemas live as long as their Library object


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            lib = torch.library.Library("torchvision", "DEF")
            for op in ("nms", "qnms"):
                lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _kept.append(lib)


sys.meta_path.insert(0, _BeforeTorchvision())
