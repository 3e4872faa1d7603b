"""The layout model's helpers (the model itself is `layout.py` at the package root) and the
copies that apply it: CPU packing tile math, byte runs, hybrid groups, TP head mapping,
recurrent (Mamba) state, the native streaming copy, the copy pool and the GPU copy path.

It may import torch, numpy and vLLM's KV-cache specs, and `protocol.wire` for layout names;
never a transport, the scheduler or the worker half.
"""
