"""Page-locks host memory that a GPU copies to or from, so the copies run as DMA at PCIe
speed (pageable memory goes through the driver's bounce buffer). A mapping is registered
once and unregistered before it goes: CUDA must never keep a registration for an address
range that was unmapped, where a later mapping could land and be read through stale pages."""

from __future__ import annotations

import torch

from vllm_qaic_connector.logs import get_logger

logger = get_logger(__name__)

READ_ONLY = 8  # cudaHostRegisterReadOnly: a peer's segment is mapped without write access


def pin(region: torch.Tensor, read_only: bool) -> bool:
    """Registers ``region`` (a flat uint8 tensor over a host mapping: never empty, mmap
    refuses 0 bytes) with CUDA; False where it could not be: the copies still run, slower."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(region.data_ptr(), region.numel(), READ_ONLY if read_only else 0)
    if int(err) != 0:
        logger.warning("QAICConnector: cannot page-lock %d MiB of staging (%s); copies "
                       "to and from the GPU will be slower", region.numel() >> 20, err)  # fmt: skip
    return int(err) == 0


def unpin(region: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(region.data_ptr())
