"""The disaggregation proxy: an OpenAI-compatible front door that sends each request
to a prefill with ``do_remote_decode``, then to a decode with the ticket the prefill
returned. ``vllm-qaic-proxy`` or ``python -m vllm_qaic_proxy`` runs it.

A package of its own, beside the connector: it runs on a router host, without vLLM, torch or
numpy. It imports ``vllm_qaic_connector.protocol`` only (plus aiohttp), and nothing in
the connector imports it.
"""

from vllm_qaic_proxy.cli import main

__all__ = ["main"]
