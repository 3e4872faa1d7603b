#!/usr/bin/env bash
# The GPU checks, on a machine with CUDA, from the project root: `pytest -m cuda` (every
# vLLM layout pair on device caches, the save/forward race, the bench test, NIXL reads of
# GPU memory), then the bench
# against a pinned copy_. Where vLLM is not installed, ../shared/tools/gpu-carry packs it
# into .gpu-carry/ beforehand, and scripts/gpu_carry_nixl.py packs NIXL (the tests and bench
# paths over NIXL skip without it) into .gpu-carry-nixl/; this script sources both.
# Logs and rows go to $OUT (or /tmp).
set -uo pipefail
out=${OUT:-/tmp}
[ -f .gpu-carry/setup.sh ] && source .gpu-carry/setup.sh
[ -f .gpu-carry-nixl/setup.sh ] && source .gpu-carry-nixl/setup.sh
python3 -c 'import nixl; print("nixl:", nixl.__name__)' || echo "nixl: not importable" >&2
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current,driver_version \
  --format=csv | tee "$out/gpu.txt"
# Staging is POSIX shm: a container's 64 MiB /dev/shm is too small for a real prompt.
if [ "$(df --output=size -k /dev/shm | tail -1)" -lt $((16 << 20)) ]; then
  mount -o remount,size=32G /dev/shm || echo "cannot grow /dev/shm" >&2
fi
python3 -m pytest -m cuda -q -p no:cacheprovider -n "${JOBS:-8}" tests/integration/test_cuda.py \
  tests/integration/test_direct_reads.py 2>&1 |
  tee "$out/pytest-cuda.log"
status=${PIPESTATUS[0]}
nixl_paths=$(python3 -c 'import nixl' 2>/dev/null && echo nixl-staged nixl)
python3 -m testbed.handoff_bench --device cuda --dtype bfloat16 --paths shm-staged \
  shm-reblock $nixl_paths --tokens ${TOKENS:-1024 4096 16384} --json "$out/bench-cuda.json" 2>&1 |
  tee "$out/bench-cuda.log"
exit $(( status || PIPESTATUS[0] ))
