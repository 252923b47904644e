"""CPU time of decoding one JSON infer request (``protocol.kserve.decode_request``): the
codec alone, no server, best of rounds. Run it against another checkout to compare:

    PYTHONPATH=/tmp/before/src .venv/bin/python bench/json_decode.py
    .venv/bin/python bench/json_decode.py
"""

from __future__ import annotations

import json
import timeit

import numpy as np

import servekit
from servekit.protocol.kserve import decode_request


def body(inputs: list[tuple[str, str, list[int], list[object]]]) -> bytes:
    return json.dumps(
        {"inputs": [{"name": n, "datatype": d, "shape": s, "data": v} for n, d, s, v in inputs]}
    ).encode()


BODIES = {
    "add_sub: two FP32 [1, 16]": body(
        [
            ("INPUT0", "FP32", [1, 16], [float(i) for i in range(16)]),
            ("INPUT1", "FP32", [1, 16], [1.0] * 16),
        ]  # fmt: skip
    ),
    "INT32 [16]": body([("x", "INT32", [16], list(range(16)))]),
    "INT64 [1000]": body([("x", "INT64", [1000], list(range(1000)))]),
    "FP32 [1, 3, 224, 224]": body(
        [("x", "FP32", [1, 3, 224, 224], np.random.default_rng(0).random(150528).tolist())]
    ),
}


def main() -> None:
    print(f"servekit from {servekit.__file__}")
    print("| request | us per decode (best of 5 rounds) |\n| --- | ---: |")
    for name, raw in BODIES.items():
        n = 5 if len(raw) > 100_000 else 2000
        best = min(timeit.repeat(lambda raw=raw: decode_request(raw), number=n, repeat=5)) / n
        print(f"| {name} | {best * 1e6:,.1f} |")


if __name__ == "__main__":
    main()
