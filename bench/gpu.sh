#!/usr/bin/env bash
# ResNet-50 on the GPU through servekit's TorchRunner, in one command within the device
# tool's limits (one call, under 10 minutes): raw images/s per batch size and precision,
# and served images/s through the Batcher. Runs on the device image's own python3
# (PyTorch, ONNX, numpy); servekit comes from this checkout's src/, nothing is installed.
#   bash bench/gpu.sh [--seconds 3] [--precisions fp32,fp16,bf16]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
export SERVEKIT_CACHE="${SERVEKIT_CACHE:-/tmp/servekit-cache}"
PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" exec python3 bench/gpu.py --out "$out/gpu.json" "$@"
