"""``python -m vllm_qaic_proxy``."""

from vllm_qaic_proxy.server import main

main()
