#!/usr/bin/env bash
# Dynamo 1.6.1 (issue #73) in a venv of its own, $DYNAMO_VENV (default .venv-dynamo), that
# sees .venv's packages (vLLM 0.32, CPU torch, NIXL) through a .pth file: ai-dynamo's `vllm`
# extra pins vLLM 0.31 and CUDA NIXL, and its vLLM and pytest plugins must stay out of .venv.
# The project's own code comes from PYTHONPATH (testbed/dynamo_up.py sets it). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${DYNAMO_VENV:-.venv-dynamo}
STAMP="$VENV/.qaic-dynamo-v1"
[ -f "$STAMP" ] && exit 0
echo "[setup] creating $VENV (ai-dynamo 1.6.1 over .venv's packages)"
python3.11 -m venv "$VENV"
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
SITE=$(purelib "$VENV/bin/python")
purelib .venv/bin/python > "$SITE/qaic-shared-venv.pth"
cp testbed/dynamo_venv/qaic_cpu_torchvision.py "$SITE/"
echo "import qaic_cpu_torchvision" > "$SITE/qaic-cpu-torchvision.pth"
# --no-deps keeps .venv's vLLM and torch. Of ai-dynamo's own dependencies .venv lacks redis
# and zstandard (imported at start-up); aisimulate (NVIDIA's index only) and kubernetes serve
# the planner, not run here. torchvision: Dynamo's multimodal helpers import transformers'
# Qwen2-VL image processor, which imports it (see testbed/dynamo_venv/).
"$VENV/bin/pip" install --disable-pip-version-check -q --no-deps ai-dynamo==1.6.1 \
  ai-dynamo-runtime==1.6.1 redis==8.1.0 zstandard==0.25.0 torchvision==0.28.0
touch "$STAMP"
echo "[setup] done"
