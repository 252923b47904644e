"""``CachedModel``: a front model answered from a ``ResponseCache`` when it answered the same
request before (``response_cache = true``), on HTTP and gRPC alike.

What is kept is the model's whole answer, before the front picks the outputs a request
asks for and encodes them, so the outputs asked for and the response's encoding need not
be in the key; request parameters reach no model, so none changes the answer. The key
holds the model, the version, the served file's identity and every input's name,
datatype, shape and bytes (``servekit.cache.Query``). A failed request is never kept.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..batching import Batcher
from ..batching.sequencer import SequenceBatcher
from ..cache import Query, ResponseCache
from .models import FrontModel

__all__ = ["CachedModel", "file_identity"]


def file_identity(path: str | Path | None, fallback: str) -> str:
    """What a served version was built from: its file's digest, so a reload of a changed
    file (or a replica serving another) never finds the old answers; ``fallback`` (the
    source, say) where there is no file (your own Python model)."""
    if path is None or not Path(path).is_file():
        return fallback
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class CachedModel:
    """``model`` behind ``cache``; ``identity`` is updated when the model is reloaded."""

    versioned = False

    def __init__(self, model: FrontModel, cache: ResponseCache, name: str, identity: str) -> None:
        self.model, self.cache, self.name, self.identity = model, cache, name, identity
        self.spec = model.spec
        self.versions = model.versions

    @property
    def batcher(self) -> Batcher | SequenceBatcher | None:
        return self.model.batcher

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: int = 0,
        timeout_us: int | None = None,
        version: str = "",
    ) -> dict[str, np.ndarray]:
        query = Query.of(self.name, version or "1", self.identity, inputs)
        kept = await self.cache.lookup(query)
        if kept is not None:
            return kept
        answer = await self.model.infer(
            inputs, priority=priority, timeout_us=timeout_us, version=version
        )
        await self.cache.insert(query, answer)
        return answer
