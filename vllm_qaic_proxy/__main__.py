"""``python -m vllm_qaic_proxy``."""

from vllm_qaic_proxy.cli import main

main()
