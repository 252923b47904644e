"""An example of your own model: text in, a score out, numpy only (docs/models.md).

``setup`` reads a lexicon (one ``word weight`` per line) named in ``[models.args]``;
``infer`` scores a batch of texts by the words it knows. A stand-in for a tokenizer and
a small model: the shape of what a user serves, not a good sentiment model.
"""

from pathlib import Path

import numpy as np

import servekit


class Sentiment(servekit.Model):
    inputs = [("TEXT", "BYTES", [1])]  # (name, dtype, dims), no batch dim
    outputs = [("SCORE", "FP32", [1]), ("KNOWN", "INT32", [1])]
    max_batch_size = 32  # 0: no batch dimension

    def setup(self, lexicon: str = "lexicon.txt", scale: float = 1.0) -> None:
        # Once per instance, in the process that serves it, with [models.args].
        path = Path(lexicon) if Path(lexicon).is_absolute() else Path(__file__).parent / lexicon
        self.weights = {
            w: float(x) * scale for w, x in map(str.split, path.read_text().splitlines())
        }

    def infer(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:  # or async def
        texts = batch["TEXT"][:, 0]  # BYTES arrive as objects (bytes)
        score = np.zeros((len(texts), 1), np.float32)
        known = np.zeros((len(texts), 1), np.int32)
        for row, text in enumerate(texts):
            try:
                words = bytes(text).decode("utf-8").lower().split()
            except UnicodeDecodeError:
                raise servekit.InvalidInput(f"input 'TEXT' row {row}: not UTF-8 text") from None
            hits = [self.weights[w] for w in words if w in self.weights]
            score[row, 0], known[row, 0] = sum(hits), len(hits)
        return {"SCORE": score, "KNOWN": known}
