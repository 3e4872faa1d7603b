"""Put on one `vllm serve`'s PYTHONPATH (`python -m testbed.serve vllm --no-amx`): its
processes see no AMX tiles, so vLLM's CPU attention packs KV as on an AVX-512 host (`vec`)
beside a server on the same AMX host that packs `amx`: peers on two kinds of CPU, one host."""

import torch

torch.cpu._is_amx_tile_supported = lambda: False
