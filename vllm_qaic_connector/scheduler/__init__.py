"""The scheduler half's helpers (the half itself is `scheduler_side.py` at the package root):
logical block ids, never bytes. A prefill
reserves staging for each handoff and returns its ticket; a decode turns a ticket into a
load for its worker; staging is freed on acknowledgement or lease expiry.

It may import `kv`, `protocol`, `config`, `stats`, `step_metadata`, `region_headers` and vLLM;
never the worker half or a transport (the halves meet only in `step_metadata`).
"""
