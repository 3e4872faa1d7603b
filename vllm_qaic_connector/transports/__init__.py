"""KV transports behind one interface (`base.KVTransport`). A new transport is one new
module here, named by its kind, holding one `KVTransport` subclass: nothing else in the
package names a transport.

It may import `kv` (byte runs, native copies) and `protocol`; never either half of the
connector, `qaic` or vLLM."""

import importlib

from vllm_qaic_connector.transports.base import KVTransport, staging_name

__all__ = ["KVTransport", "create_transport", "staging_name"]


def create_transport(
    kind: str, name: str, staging_bytes: int, timeout_s: float, *, stages: bool = True
) -> KVTransport:
    """``timeout_s`` bounds every read; ``stages``: this rank saves into its staging (else
    the transport commits no memory to it)."""
    try:
        importlib.import_module(f"{__name__}.{kind}")
        cls = KVTransport.kinds[kind]
    except (ImportError, KeyError):
        raise ValueError(f"unknown transport {kind!r}: no KVTransport of that kind") from None
    return cls(name, staging_bytes, timeout_s=timeout_s, stages=stages)
