"""The worker half's helpers (the half itself is `worker_side.py` at the package root): the
bytes. It registers vLLM's KV cache views,
saves each request's KV into staging in the decode's layout, loads a ticket's KV (staged
copy or direct read), and acknowledges it.

It may import `kv`, `transports`, `protocol`, `qaic`, `config`, `stats`, `step_metadata`,
`region_headers` and vLLM; never the scheduler half.
"""
