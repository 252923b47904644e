"""An example of your own model: text in, a score out, numpy only.

``setup`` reads a lexicon (one ``word weight`` per line) named in ``[models.args]``;
``infer`` scores a batch of texts by the words it knows. A stand-in for a tokenizer and
a small model: the shape of what a user serves, not a good sentiment model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import servekit


class Sentiment(servekit.Model):
    inputs = [("TEXT", "BYTES", [1])]
    outputs = [("SCORE", "FP32", [1]), ("KNOWN", "INT32", [1])]
    max_batch_size = 32

    def setup(self, lexicon: str, scale: float = 1.0) -> None:
        # A relative path is the lexicon's place beside this file, wherever the
        # serving process runs (a Triton stub, a Ray replica).
        path = Path(lexicon) if Path(lexicon).is_absolute() else Path(__file__).parent / lexicon
        self.weights: dict[str, float] = {}
        for line in path.read_text().splitlines():
            word, weight = line.split()
            self.weights[word] = float(weight) * scale

    def infer(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        texts = batch["TEXT"][:, 0]
        score = np.zeros((len(texts), 1), np.float32)
        known = np.zeros((len(texts), 1), np.int32)
        for row, text in enumerate(texts):
            try:
                words = bytes(text).decode("utf-8").lower().split()
            except UnicodeDecodeError:
                raise servekit.InvalidInput(f"input 'TEXT' row {row}: not UTF-8 text") from None
            hits = [self.weights[w] for w in words if w in self.weights]
            score[row, 0] = sum(hits)
            known[row, 0] = len(hits)
        return {"SCORE": score, "KNOWN": known}
