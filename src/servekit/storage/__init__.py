"""Model files from object storage: ``s3://`` and ``gs://`` sources fetched through a
node-local cache keyed by the object's version, staged and renamed so no reader ever sees
half a model (``fetch``). Local paths pass through untouched."""

from ..errors import FetchFailed
from .cache import ObjectCache, fetch, figures, stats
from .objects import ObjectRef, StorageConfig, is_remote, parse

__all__ = [
    "FetchFailed",
    "ObjectCache",
    "ObjectRef",
    "StorageConfig",
    "fetch",
    "figures",
    "is_remote",
    "parse",
    "stats",
]
