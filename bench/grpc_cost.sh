#!/usr/bin/env bash
# Server CPU per 600 KB request over HTTP and over gRPC on the native runtime: one
# ResNet-50-sized FP32 tensor in and the same out of an Identity (ONNX Runtime), 8
# tritonclient clients, so the server's cost is the transport alone.
# Usage: bench/grpc_cost.sh OUT_PREFIX [SRC] [SHM]   (SRC: another checkout's src/, for a
# before, server and bench both; SHM: system, the tensors through system shared memory as
# that checkout's servekit bench --shared-memory sends them)
set -euo pipefail
out=${1:-bench/results/grpc_cost}
src=${2:-}
shm=${3:-none}
model=/tmp/servekit_bench_identity.onnx
.venv/bin/python - "$model" <<'PY'
import sys

import onnx

from servekit.zoo.tiny import build_simulated

identity = build_simulated("identity", 0, 0, width=3 * 224 * 224)
del identity.metadata_props[:]  # no device profile: ONNX Runtime runs the Identity
onnx.save(identity, sys.argv[1])
PY
PYTHONPATH="$src" .venv/bin/servekit serve --runtime native --model "$model" \
    --http-port 8610 --grpc-port 8611 --metrics-port 8612 > /tmp/grpc_cost_server.log 2>&1 &
pid=$!
trap 'kill -INT $pid; wait $pid || true' EXIT
for _ in $(seq 120); do
    curl -sf http://127.0.0.1:8610/v2/models/servekit_bench_identity/ready > /dev/null && break
    sleep 1
done
for url in http://127.0.0.1:8610 grpc://127.0.0.1:8611; do
    PYTHONPATH="$src" .venv/bin/servekit bench --url "$url" --model servekit_bench_identity --concurrency 8 \
        --window 4 --warmup 2 --max-windows 3 --server-pid "$pid" --out "${out}_${url%%:*}" \
        --shared-memory "$shm" \
        > /dev/null
    tail -1 "${out}_${url%%:*}.csv" | awk -F, -v p="${url%%:*}" '{printf "%s: %.0f requests/s, server %.0f us CPU/request\n", p, $13, $21}'
done
