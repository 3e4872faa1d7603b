"""What the tests, the benchmarks and scripts/run_accuracy_test.sh share: not the test suite,
and not installed (like ``emulator/``); importable from the repository root.

- `shipped_model`: the shipped tiny model (path, geometry): the one constant every test
  builds on.
- `shm_objects`: the one listing of ``/dev/shm`` segments, and vLLM's leftovers there.
- `ports`: free TCP ports below the ephemeral range (``python -m testbed.ports N``).
- `serve`: the one `vllm serve` launcher: command line, environment, core pinning and the
  readiness wait, for Python (`live_servers`) and bash (``python -m testbed.serve``).
- `live_servers`: process groups of real servers (vLLM, the proxy), their clean-up and
  leak checks, requests and metrics; `proxy_clients`: clients that misbehave; `soak`.
- `vllm_harness`: vLLM's real scheduler in-process with this connector; `handshake_ranks`:
  a valid handshake rank; `worker_processes`: worker halves as TP ranks in child processes.
- `netns`: network namespaces joined by a veth pair; `nixl_peer`, `qaic_slot_peer`: the
  children those cross-host tests start.

Dependencies: `shipped_model`, `shm_objects`, `ports` and `serve` import the standard library
only (bash runs `serve` before every server start); the rest may import the connector, vLLM
and torch.
"""
