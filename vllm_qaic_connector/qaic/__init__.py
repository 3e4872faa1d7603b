"""The Qualcomm Cloud AI 100 decode target: the program's retained-state buffers named
``past_key.{i}_<PREFIX>`` (selected by regex), one batch slot per sequence, written one slot
at a time, and the pull of a slot's KV over NIXL.

It may import `kv`, `transports`, `protocol` and `region_headers`; never either half of the
connector or vLLM.
"""
