"""The numpy add_sub as a LitServe LitAPI with LitServe's batching (bench/user_code.py):
JSON ``{"INPUT0": [16 floats], "INPUT1": [...]}`` on /predict.

    python bench/peers/litserve_app.py --port 8000 --max-batch-size 8
"""

from __future__ import annotations

import argparse

import litserve as ls
import numpy as np


class AddSub(ls.LitAPI):
    def setup(self, device: str) -> None:
        pass

    def decode_request(self, request: dict) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(request["INPUT0"], np.float32), np.asarray(request["INPUT1"], np.float32)

    def batch(self, inputs: list) -> tuple[np.ndarray, np.ndarray]:
        return np.stack([a for a, _ in inputs]), np.stack([b for _, b in inputs])

    def predict(self, x: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        a, b = x
        return a + b, a - b

    def unbatch(self, output: tuple[np.ndarray, np.ndarray]) -> list:
        return list(zip(*output, strict=True))

    def encode_response(self, output: tuple[np.ndarray, np.ndarray]) -> dict:
        return {"OUTPUT0": output[0].tolist(), "OUTPUT1": output[1].tolist()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--batch-timeout-s", type=float, default=0.0005)
    args = ap.parse_args()
    api = AddSub(max_batch_size=args.max_batch_size, batch_timeout=args.batch_timeout_s)
    ls.LitServer(api, accelerator="cpu", workers_per_device=1).run(
        host="127.0.0.1", port=args.port, generate_client_file=False
    )


if __name__ == "__main__":
    main()
