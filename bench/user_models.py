"""The cheap numpy model every server runs as user code in bench/user_code.py: add_sub's
signature (two FP32 [16] in, their sum and difference out), so serving cost shows."""

from __future__ import annotations

import numpy as np

import servekit


class AddSub(servekit.Model):
    inputs = [("INPUT0", "FP32", [16]), ("INPUT1", "FP32", [16])]
    outputs = [("OUTPUT0", "FP32", [16]), ("OUTPUT1", "FP32", [16])]
    max_batch_size = 8

    def infer(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        a, b = batch["INPUT0"], batch["INPUT1"]
        return {"OUTPUT0": a + b, "OUTPUT1": a - b}
