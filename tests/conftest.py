import os

import torch

# The harness machines have 2 cores and other processes; OMP spin-waits across threads
# can stall vLLM's CPU ops, so tests use one intra-op thread.
torch.set_num_threads(1)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
