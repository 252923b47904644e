"""A response cache for every runtime (issue 42's core): a ``Query`` holds everything that
decides an answer and is checked in full on a hit, so a collision never returns a wrong
answer; answers are kept in this process (``LocalStore``, an LRU bounded in bytes) or in a
Redis every replica shares (``RedisStore``). Not yet wired into the runtimes."""

from .cache import CACHE_METRICS, ResponseCache
from .query import Query, decode_tensors, encode_tensors
from .stores import LocalStore, RedisStore, Store

__all__ = [
    "CACHE_METRICS",
    "LocalStore",
    "Query",
    "RedisStore",
    "ResponseCache",
    "Store",
    "decode_tensors",
    "encode_tensors",
]
