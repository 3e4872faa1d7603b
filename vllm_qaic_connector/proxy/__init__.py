"""The disaggregation proxy: an OpenAI-compatible front door that sends each request
to a prefill with ``do_remote_decode``, then to a decode with the ticket the prefill
returned. ``python -m vllm_qaic_connector.proxy`` or ``vllm-qaic-proxy`` runs it.

It imports `protocol` only (plus aiohttp): it runs without vLLM, torch or numpy.
"""

from vllm_qaic_connector.proxy.server import main

__all__ = ["main"]
