#!/usr/bin/env bash
# ResNet-50 on one runtime: inputs over the socket against inputs in system shared memory,
# HTTP and gRPC, in one run; server CPU per request from the server's process tree.
# Usage: bench/shared_memory.sh RUNTIME OUT_PREFIX [MODEL]
#   (e.g. native bench/results/shm_native; MODEL: resnet50 (default), or "identity": one
#   ResNet-50 image in and out of an Identity, so the server's cost is the transport alone)
set -euo pipefail
runtime=${1:-native}
out=${2:-bench/results/shm_$runtime}
model=${3:-resnet50}
source=$model
if [ "$model" = identity ]; then
    source=/tmp/servekit_bench_identity.onnx
    .venv/bin/python - "$source" <<'PY'
import sys

import onnx

from servekit.zoo.tiny import build_simulated

identity = build_simulated("identity", 0, 0, width=3 * 224 * 224)
del identity.metadata_props[:]  # no device profile: ONNX Runtime runs the Identity
onnx.save(identity, sys.argv[1])
PY
    model=servekit_bench_identity
fi
token=shm-bench
py=.venv/bin/servekit
$py serve --runtime "$runtime" --model "$source" --control-token "$token" \
    --http-port 8600 --grpc-port 8601 --metrics-port 8602 > "/tmp/shm_bench_$runtime.log" 2>&1 &
pid=$!
trap 'kill -INT $pid; wait $pid || true' EXIT
for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:8600/v2/models/$model/ready" > /dev/null && break
    sleep 1
done
for url in http://127.0.0.1:8600 grpc://127.0.0.1:8601; do
    proto=${url%%:*}
    for shm in none system; do
        $py bench --url "$url" --model "$model" --batch-size 8 --concurrency 1,2 \
            --window 6 --warmup 3 --server-pid "$pid" --shared-memory "$shm" \
            --access-token "$token" --out "${out}_${proto}_${shm}"
    done
done
