"""A decoupled model: one request, any number of responses (Triton's decoupled policy).

``Words`` answers a text with each of its words in turn, as a token streamer answers a
prompt: served over a gRPC stream (tritonclient's ``async_stream_infer``) or as
Server-Sent Events over HTTP (``Accept: text/event-stream``). ``delay_s`` in
``[models.args]`` spaces the words out; a client that leaves stops it at its next word.
"""

from __future__ import annotations

import time

import numpy as np

import servekit


class Words(servekit.Model):
    inputs = [("TEXT", "BYTES", [1])]
    outputs = [("WORD", "BYTES", [1]), ("INDEX", "INT32", [1])]
    max_batch_size = 1
    decoupled = True

    def setup(self, delay_s: float = 0.0) -> None:
        self.delay_s = float(delay_s)
        self.made = 0  # words made, by every request: how much work a client cost

    def infer(self, batch):
        text = batch["TEXT"][0, 0]
        words = (text.decode() if isinstance(text, bytes) else str(text)).split()
        for i, word in enumerate(words):
            if word == "fail":
                raise ValueError(f"asked to fail at word {i}")
            if self.delay_s:
                time.sleep(self.delay_s)
            self.made += 1
            yield {
                "WORD": np.array([[word.encode()]], dtype=object),
                "INDEX": np.array([[i]], np.int32),
            }
