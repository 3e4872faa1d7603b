"""KV transports behind one interface. A new transport is one new `KVTransport` subclass,
named in `create_transport`."""

from vllm_qaic_connector.transports.base import KVTransport, staging_name

__all__ = ["KVTransport", "create_transport", "staging_name"]


def create_transport(
    kind: str, name: str, staging_bytes: int, timeout_s: float, *, stages: bool = True
) -> KVTransport:
    """``timeout_s`` bounds every read; ``stages``: this rank saves into its staging (else
    the transport commits no memory to it)."""
    if kind == "shm":
        from vllm_qaic_connector.transports.shm import ShmTransport

        return ShmTransport(name, staging_bytes, stages=stages)
    if kind == "nixl":
        from vllm_qaic_connector.transports.nixl import NixlTransport

        return NixlTransport(name, staging_bytes, timeout_s=timeout_s, stages=stages)
    raise ValueError(f"unknown transport {kind!r}; choose one of shm, nixl")
