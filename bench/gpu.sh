#!/usr/bin/env bash
# ResNet-50 on the GPU through servekit, in one command within the device tool's limits
# (one call, under 10 minutes), on the device image's own python3 (PyTorch, ONNX, numpy);
# servekit comes from this checkout's src/, nothing of it is installed:
#   1. the engine alone, runner.infer and the in-process Batcher at 1 and 2 instances
#      (bench/gpu.py, every precision asked for);
#   2. the CUDA tests of tests/test_gpu_runners.py (two lanes against ONNX Runtime), of
#      tests/test_device_decode.py (JPEGs decoded on the GPU against Pillow) and of
#      tests/test_cuda_shared_memory.py (eight tritonclients through CUDA shared memory),
#      then the same tests again under PyTorch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1),
#      its reports counted in gpu_sanitizer.txt (the target: 0);
#   3. the native server at FP16, 2 instances, 64 clients, with the server's CPU per
#      request (servekit bench): one-image requests over HTTP binary, HTTP with system
#      shared memory and gRPC; the same model taking UINT8 pixels (optimize --pixels, a
#      quarter of the bytes, scaled on the GPU); JPEGs over HTTP to resnet50_image
#      (decoded on the GPU); and 32-image requests over HTTP binary and through CUDA
#      shared memory, inputs and outputs both in the region (16 clients).
# Steps 2 and 3 need what bench/gpu_prepare.sh puts in .whl (carry it): without it a step
# is skipped, saying so.
#   bash bench/gpu_prepare.sh .whl              # here, once
#   bash bench/gpu.sh [--seconds 3] [--precisions fp32,fp16]    # on the device
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

timeout 240 python3 bench/gpu.py --out "$out/gpu.json" "$@"

tests="-q -p no:cacheprovider -o addopts="
if python3 -c "import pytest, hypothesis, onnxruntime" 2> /dev/null; then
    timeout 60 python3 -m pytest $tests tests/test_gpu_runners.py -k "cuda or lanes" \
        2>&1 | tail -3 | tee "$out/gpu_tests.txt" || true
    # JPEGs decoded on the GPU against Pillow: the levels apart and the top-5 kept.
    timeout 60 python3 -m pytest $tests -s tests/test_device_decode.py -k cuda \
        2>&1 | grep -E "nvJPEG|same top-5|passed|failed|skipped" | tee -a "$out/gpu_tests.txt" || true
    timeout 90 python3 -m pytest $tests tests/test_cuda_shared_memory.py \
        2>&1 | tail -15 | tee -a "$out/gpu_tests.txt" || true
    # Every kernel's stream accesses checked: a missing wait or record_stream is a report.
    TORCH_CUDA_SANITIZER=1 timeout 150 python3 -m pytest $tests \
        tests/test_gpu_runners.py -k "cuda or lanes" tests/test_cuda_shared_memory.py \
        > "$out/gpu_sanitizer.log" 2>&1 || true
    echo "CSAN reports: $(grep -c 'CSAN detected' "$out/gpu_sanitizer.log" || true)" \
        | tee "$out/gpu_sanitizer.txt"
    tail -3 "$out/gpu_sanitizer.log" | tee -a "$out/gpu_sanitizer.txt"
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
photos=()
for f in .whl/photos/*.jpg; do [ -e "$f" ] && photos+=(--image "$f"); done
[ ${#photos[@]} -gt 0 ] || echo "gpu.sh: no photos in .whl/photos: JPEG requests are generated 320x240 ones"
# url, shared memory, name, model, images per request, clients
for run in "http://127.0.0.1:8700 none http resnet50 1 64" \
    "http://127.0.0.1:8700 system http_shm resnet50 1 64" \
    "grpc://127.0.0.1:8701 none grpc resnet50 1 64" \
    "http://127.0.0.1:8700 none http_pixels resnet50_pixels 1 64" \
    "http://127.0.0.1:8700 none http_jpeg resnet50_image 1 64" \
    "http://127.0.0.1:8700 none http_b32 resnet50 32 16" \
    "http://127.0.0.1:8700 cuda cuda_shm_b32 resnet50 32 16"; do
    set -- $run
    if [ "$SECONDS" -gt 560 ]; then
        echo "gpu.sh: $3 skipped: the call's 10 minutes are nearly spent"
        continue
    fi
    timeout 30 python3 -m servekit.cli bench --url "$1" --model "$4" --batch-size "$5" \
        --concurrency "$6" --window 3 --warmup 2 --max-windows 3 --server-pid "$pid" \
        --shared-memory "$2" --access-token gpu-bench "${photos[@]}" \
        --out "$out/gpu_native_$3" || echo "gpu.sh: $3 failed"
done
# Which CUDA shared-memory copies stayed on the device (outputs kept there: path="device").
curl -sf http://127.0.0.1:8702/metrics | grep '^servekit_cuda_shared_memory' \
    | tee "$out/gpu_cuda_copies.txt" || echo "gpu.sh: no CUDA shared-memory copies counted"
