"""One logger helper: every logger of the package lives inside vLLM's logger tree.

vLLM configures the ``vllm`` logger (handlers, level, ``VLLM_LOGGING_LEVEL``); a child of it
prints the way vLLM's own messages do, without importing vLLM (the proxy and the wire format
run without it).
"""

from __future__ import annotations

import logging


def get_logger(module: str) -> logging.Logger:
    """The logger of ``module`` (pass ``__name__``), under ``vllm.``."""
    return logging.getLogger(f"vllm.{module}")
