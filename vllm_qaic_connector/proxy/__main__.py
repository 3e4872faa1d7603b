"""``python -m vllm_qaic_connector.proxy``."""

from vllm_qaic_connector.proxy.server import main

main()
