"""KV transports behind one interface. A new transport is one new `KVTransport` subclass."""

from vllm_qaic_connector.transports.base import KVTransport, create_transport, staging_name

__all__ = ["KVTransport", "create_transport", "staging_name"]
