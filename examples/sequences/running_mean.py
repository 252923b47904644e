"""A model that keeps state itself: each sequence's running mean, kept per sequence id.

Served with ``[models.sequence_batching]`` (``serve.toml`` here): servekit sends each
sequence's requests in order to one instance with Triton's control inputs, so the model
can key its state by CORRID, start afresh on START, skip the empty rows (READY 0) and
free a sequence's state when servekit says it ended (``end_sequence``).
"""

from __future__ import annotations

import numpy as np

import servekit


class RunningMean(servekit.Model):
    inputs = [
        ("VALUE", "FP32", [1]),
        ("START", "INT32", [1]),
        ("READY", "INT32", [1]),
        ("CORRID", "UINT64", [1]),
    ]
    outputs = [("MEAN", "FP32", [1])]
    max_batch_size = 8

    def setup(self) -> None:
        self.kept: dict[int, tuple[float, int]] = {}  # sequence id -> (sum, count)

    def infer(self, batch):
        means = np.zeros((len(batch["VALUE"]), 1), np.float32)
        rows = zip(batch["VALUE"][:, 0], batch["START"][:, 0], batch["READY"][:, 0],
                   batch["CORRID"][:, 0], strict=True)  # fmt: skip
        for i, (value, start, ready, corrid) in enumerate(rows):
            if not ready:
                continue  # a slot held for a sequence with nothing to run this time
            total, count = (0.0, 0) if start else self.kept.get(int(corrid), (0.0, 0))
            total, count = total + float(value), count + 1
            self.kept[int(corrid)] = (total, count)
            means[i, 0] = total / count
        return {"MEAN": means}

    def end_sequence(self, sequence_id, reason: str) -> None:
        self.kept.pop(int(sequence_id), None)
