"""Where cached answers are kept: this process's memory (an LRU bounded in bytes) or a
Redis that every replica shares. Both keep opaque entries under ``Query.key()``."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Protocol

__all__ = ["LocalStore", "RedisStore", "Store"]

log = logging.getLogger("servekit")


class Store(Protocol):
    """A key-value store of entries; ``drop`` forgets every entry of one model."""

    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, entry: bytes) -> None: ...

    async def drop(self, model: str) -> int: ...

    def size_bytes(self) -> int: ...

    async def aclose(self) -> None:
        """Let go of connections (before the event loop they were made on closes)."""


class LocalStore:
    """An LRU of entries in this process, at most ``budget_bytes`` of them (keys and
    entries counted); an entry larger than the budget is not kept."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"the local cache's size must be > 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self.evictions = 0

    async def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    async def put(self, key: str, entry: bytes) -> None:
        cost = len(key) + len(entry)
        if cost > self.budget_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= len(key) + len(old)
        while self._entries and self._bytes + cost > self.budget_bytes:
            gone_key, gone = self._entries.popitem(last=False)
            self._bytes -= len(gone_key) + len(gone)
            self.evictions += 1
        self._entries[key] = entry
        self._bytes += cost

    async def drop(self, model: str) -> int:
        prefix = f"{model}/"
        gone = [k for k in self._entries if k.startswith(prefix)]
        for key in gone:
            self._bytes -= len(key) + len(self._entries.pop(key))
        return len(gone)

    def size_bytes(self) -> int:
        return self._bytes

    async def aclose(self) -> None:
        return None


class RedisStore:
    """Entries in Redis (``redis://host:port/db``), shared by every replica; Redis's own
    ``maxmemory-policy`` evicts. While Redis does not answer, every call misses (the
    server keeps serving without the cache), retrying after ``retry_s``; it is said once
    when Redis goes and once when it is back."""

    PREFIX = "servekit:cache:"

    def __init__(self, url: str, timeout_s: float = 0.25, retry_s: float = 1.0) -> None:
        try:
            import redis.asyncio as aioredis
        except ImportError:
            raise ValueError(
                f"[server.cache.redis] {url}: needs the redis package "
                "(pip install 'servekit[cache]')"
            ) from None

        self.url, self.retry_s = url, retry_s
        self._client: Any = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._down_until = 0.0
        self.down = False

    async def _call(self, what: str, *args: Any) -> Any:
        if self.down and time.monotonic() < self._down_until:
            return None
        from redis.exceptions import RedisError

        try:
            result = await getattr(self._client, what)(*args)
        # RuntimeError: uvloop's answer to a write on a connection the peer has reset
        # (a Redis killed under load); redis-py has already dropped that connection.
        except (TimeoutError, RedisError, OSError, RuntimeError) as exc:
            if not self.down:
                log.warning("response cache: Redis at %s does not answer (%s); serving "
                            "without the cache until it does", self.url, exc)  # fmt: skip
            self.down, self._down_until = True, time.monotonic() + self.retry_s
            return None
        if self.down:
            log.warning("response cache: Redis at %s answers again", self.url)
            self.down = False
        return result

    async def get(self, key: str) -> bytes | None:
        entry = await self._call("get", self.PREFIX + key)
        return bytes(entry) if entry is not None else None

    async def put(self, key: str, entry: bytes) -> None:
        await self._call("set", self.PREFIX + key, entry)

    async def drop(self, model: str) -> int:
        keys = await self._call("keys", f"{self.PREFIX}{model}/*")
        if not keys:
            return 0
        return int(await self._call("delete", *keys) or 0)

    def size_bytes(self) -> int:
        return 0  # Redis's own INFO memory says; not read on every scrape

    async def aclose(self) -> None:
        """Close the connections; the next call opens new ones (on the loop it runs on)."""
        await self._client.aclose()
