"""PyTriton binding the numpy add_sub function itself (@batch), no servekit in the path:
the peer of servekit's pytriton runtime serving the same code (bench/user_code.py).

    python bench/peers/pytriton_direct.py --http-port 8000 --grpc-port 8001 --metrics-port 8002
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    for port in ("http", "grpc", "metrics"):
        ap.add_argument(f"--{port}-port", type=int, required=True)
    ap.add_argument("--max-batch-size", type=int, default=8)
    args = ap.parse_args()
    # The two environment fixes the Python backend stub needs on this machine, nothing else.
    from servekit.triton.env import apply_triton_environment

    apply_triton_environment()
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    @batch
    def infer(INPUT0, INPUT1):  # noqa: N803 - PyTriton passes inputs by name
        return {"OUTPUT0": INPUT0 + INPUT1, "OUTPUT1": INPUT0 - INPUT1}

    tensors = [Tensor(name=n, dtype=np.float32, shape=(16,)) for n in ("INPUT0", "INPUT1")]
    outputs = [Tensor(name=n, dtype=np.float32, shape=(16,)) for n in ("OUTPUT0", "OUTPUT1")]
    config = TritonConfig(
        http_address="127.0.0.1", http_port=args.http_port, grpc_address="127.0.0.1",
        grpc_port=args.grpc_port, metrics_port=args.metrics_port,
    )  # fmt: skip
    with Triton(config=config) as triton:
        triton.bind(
            "add_sub", infer, inputs=tensors, outputs=outputs,
            config=ModelConfig(max_batch_size=args.max_batch_size, batcher=DynamicBatcher()),
        )  # fmt: skip
        triton.serve()


if __name__ == "__main__":
    main()
