#!/usr/bin/env bash
# ResNet-50 on the GPU through servekit, in one command within the device tool's limits
# (one call, under 10 minutes), on the device image's own python3 (PyTorch, ONNX, numpy);
# servekit comes from this checkout's src/, nothing of it is installed:
#   1. the engine alone, runner.infer and the in-process Batcher at 1 and 2 instances
#      (bench/gpu.py, every precision asked for);
#   2. the CUDA tests of tests/test_gpu_runners.py (two lanes against ONNX Runtime) and of
#      tests/test_device_decode.py (JPEGs decoded on the GPU against Pillow);
#   3. the native server at FP16, 2 instances, over HTTP binary, HTTP with system shared
#      memory and gRPC, 64 clients, with the server's CPU per request (servekit bench);
#      and over HTTP binary the same model taking UINT8 pixels (optimize --pixels), a
#      quarter of the bytes, scaled on the GPU.
# Step 2 needs pytest, hypothesis and onnxruntime, step 3 servekit's HTTP/gRPC wheels, all
# carried in .whl (../shared/device/wheels.sh .whl, then pip download the first three for
# Python 3.12 into it): without them a step is skipped, saying so.
#   bash bench/gpu.sh [--seconds 3] [--precisions fp32,fp16]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
export SERVEKIT_CACHE="${SERVEKIT_CACHE:-/tmp/servekit-cache}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

timeout 330 python3 bench/gpu.py --out "$out/gpu.json" "$@"

if python3 -c "import pytest, hypothesis, onnxruntime" 2> /dev/null; then
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_runners.py -k "cuda or lanes" \
        2>&1 | tail -3 | tee "$out/gpu_tests.txt" || true
    # JPEGs decoded on the GPU against Pillow: the levels apart and the top-5 kept.
    timeout 90 python3 -m pytest -q -s -p no:cacheprovider tests/test_device_decode.py -k cuda \
        2>&1 | grep -E "nvJPEG|same top-5|passed|failed|skipped" | tee -a "$out/gpu_tests.txt" || true
else
    echo "gpu.sh: no pytest/hypothesis/onnxruntime here (carry them in .whl): step 2 skipped"
fi
if ! python3 -c "import tritonclient, uvicorn" 2> /dev/null; then
    echo "gpu.sh: no tritonclient/uvicorn here (carry them in .whl): step 3 skipped"
    exit 0
fi

python3 -m servekit.cli optimize resnet50 --precision fp32 --pixels \
    --output /tmp/resnet50.pixels.onnx
cat > /tmp/gpu_serve.toml <<'TOML'
[server]
http_port = 8700
grpc_port = 8701
metrics_port = 8702

[[models]]
name = "resnet50"
source = "resnet50"
engine = "torch"
precision = "fp16"
instances = 2
overlap = true

[models.batching]
max_batch_size = 128
preferred_batch_sizes = [64, 128]
max_queue_delay_us = 2000

[[models]]
name = "resnet50_pixels"
source = "/tmp/resnet50.pixels.onnx"
engine = "torch"
precision = "fp16"
instances = 2
overlap = true

[models.batching]
max_batch_size = 128
preferred_batch_sizes = [64, 128]
max_queue_delay_us = 2000
TOML
python3 -m servekit.cli serve --runtime native --config /tmp/gpu_serve.toml \
    --control-token gpu-bench > "$out/gpu_server.log" 2>&1 &
pid=$!
trap 'kill -INT $pid 2> /dev/null; wait $pid 2> /dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf http://127.0.0.1:8700/v2/health/ready > /dev/null && break
    sleep 1
done
for run in "http://127.0.0.1:8700 none http resnet50" \
    "http://127.0.0.1:8700 system http_shm resnet50" "grpc://127.0.0.1:8701 none grpc resnet50" \
    "http://127.0.0.1:8700 none http_pixels resnet50_pixels"; do
    set -- $run
    timeout 60 python3 -m servekit.cli bench --url "$1" --model "$4" --concurrency 64 \
        --window 5 --warmup 3 --max-windows 3 --server-pid "$pid" --shared-memory "$2" \
        --access-token gpu-bench --out "$out/gpu_native_$3" || echo "gpu.sh: $3 failed"
done
