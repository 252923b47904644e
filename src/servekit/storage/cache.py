"""The node-local cache of fetched objects.

An object is kept under ``<cache>/<scheme>/<bucket>/<key>/<version>-<size>/<file>``, so a
restart, or a second process on the node, finds it without downloading again, and a new
version of the object is a new entry. A download is staged under a temporary name in the
entry's folder, checked (size, and MD5 where the store gives one) and renamed into place
after its record (``<file>.json``, with its SHA-256): a crash mid-download or a concurrent
reader never sees half a model. One process downloads an entry at a time (a file lock);
the others wait and then find it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import FetchFailed, ModelNotFound
from .objects import ObjectInfo, ObjectRef, StorageConfig, download, is_remote, parse, stat

__all__ = ["COUNTERS", "ObjectCache", "fetch", "figures", "stats"]

log = logging.getLogger(__name__)

COUNTERS = {
    "servekit_storage_downloads_total": "Objects downloaded from object storage",
    "servekit_storage_download_bytes_total": "Bytes downloaded from object storage",
    "servekit_storage_cache_hits_total": "Fetches answered by the node-local cache",
    "servekit_storage_fetch_failures_total": "Fetches that failed (the serving version stays)",
}


class _Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[tuple[str, str], float] = {}

    def add(self, name: str, scheme: str, value: float = 1.0) -> None:
        with self._lock:
            key = (name, scheme)
            self.counts[key] = self.counts.get(key, 0.0) + value

    def get(self, name: str, scheme: str = "s3") -> float:
        with self._lock:
            return self.counts.get((name, scheme), 0.0)


stats = _Stats()
"""This process's fetch counts (what ``figures`` exports)."""


def figures() -> list[tuple[str, str, str, list[tuple[dict[str, str], float]]]]:
    """The counts as metric families (``Metrics.collect``); none before the first fetch."""
    with stats._lock:
        counts = dict(stats.counts)
    if not counts:
        return []
    schemes = sorted({scheme for _, scheme in counts})
    return [
        (name, "counter", about, [({"scheme": s}, counts.get((name, s), 0.0)) for s in schemes])
        for name, about in COUNTERS.items()
    ]


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:120] or "_"


class ObjectCache:
    """Entries of fetched objects under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def folder(self, ref: ObjectRef) -> Path:
        """Where every cached version of ``ref`` lives."""
        parts = [_safe(p) for p in ref.key.split("/") if p not in ("", ".", "..")]
        return self.root.joinpath(ref.scheme, _safe(ref.bucket), *parts)

    def entry(self, ref: ObjectRef, info: ObjectInfo) -> Path:
        """The file ``ref`` at version ``info`` is (or will be) cached as."""
        name = _safe(ref.key.rsplit("/", 1)[-1])
        return self.folder(ref) / f"{_safe(info.version)}-{info.size}" / name

    @staticmethod
    def complete(path: Path) -> bool:
        """Whether ``path`` is a whole entry: the file and its record, sizes agreeing."""
        record = path.with_name(path.name + ".json")
        try:
            return path.stat().st_size == json.loads(record.read_text())["size"]
        except (OSError, ValueError, KeyError):
            return False

    def newest(self, ref: ObjectRef) -> Path | None:
        """The most recently fetched complete entry of ``ref`` (for a store that is down)."""
        folder = self.folder(ref)
        if not folder.is_dir():
            return None
        name = _safe(ref.key.rsplit("/", 1)[-1])
        found = [p / name for p in folder.iterdir() if self.complete(p / name)]
        return max(found, key=lambda p: p.parent.stat().st_mtime, default=None)

    @contextlib.contextmanager
    def locked(self, entry: Path) -> Iterator[None]:
        """Hold the entry's download lock (across processes on this node)."""
        entry.parent.mkdir(parents=True, exist_ok=True)
        with open(entry.parent / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


class _Progress:
    """An fsspec Callback: a line every ``every_s`` seconds with the size and the rate."""

    def __init__(self, uri: str, every_s: float) -> None:
        self.uri, self.every_s = uri, every_s
        self.size, self.value = 0, 0
        self.start = self._last = time.monotonic()

    # fsspec's Callback protocol, as get_file calls it.
    def set_size(self, size: int | None) -> None:
        self.size = int(size or 0)

    def relative_update(self, inc: int = 1) -> None:
        self.value += inc
        now = time.monotonic()
        if self.every_s and now - self._last >= self.every_s:
            self._last = now
            log.info("%s: %s", self.uri, self.line(now))

    def absolute_update(self, value: int) -> None:
        self.relative_update(value - self.value)

    def branched(self, *_: Any, **__: Any) -> None:
        return None

    def call(self, *_: Any, **__: Any) -> None:
        return None

    def line(self, now: float) -> str:
        mb, elapsed = self.value / 1e6, max(now - self.start, 1e-9)
        of = (
            f" of {self.size / 1e6:.1f} MB ({100 * self.value / self.size:.0f}%)"
            if self.size
            else " MB"
        )
        return f"{mb:.1f}{of}, {mb / elapsed:.1f} MB/s"


def _digests(path: Path) -> tuple[str, str]:
    md5, sha = hashlib.md5(usedforsecurity=False), hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            md5.update(chunk)
            sha.update(chunk)
    return md5.hexdigest(), sha.hexdigest()


def _download(ref: ObjectRef, info: ObjectInfo, entry: Path, config: StorageConfig) -> None:
    """Stage, check and rename: on any failure nothing is left but the lock file."""
    staged = entry.with_name(f".{entry.name}.partial-{os.getpid()}-{threading.get_ident()}")
    record = entry.with_name(entry.name + ".json")
    progress = _Progress(ref.uri, config.progress_s)
    log.info("%s: downloading %.1f MB (%s)", ref.uri, info.size / 1e6, ref.where())
    try:
        download(ref, config, staged, progress)
        got = staged.stat().st_size
        if got != info.size:
            raise FetchFailed(
                f"{ref.uri}: truncated download ({ref.where()}): got {got} bytes, "
                f"expected {info.size}"
            )
        md5, sha256 = _digests(staged)
        if info.md5 is not None and md5 != info.md5:
            raise FetchFailed(
                f"{ref.uri}: hash mismatch ({ref.where()}): MD5 {md5}, expected {info.md5}"
            )
        with open(staged, "rb") as f:
            os.fsync(f.fileno())
        meta = {
            "uri": ref.uri,
            "version": info.version,
            "size": info.size,
            "md5": md5,
            "sha256": sha256,
            "fetched": time.time(),
        }
        staged_record = staged.with_name(staged.name + ".json")
        staged_record.write_text(json.dumps(meta))
        os.replace(staged_record, record)
        os.replace(staged, entry)
    except BaseException:
        staged.unlink(missing_ok=True)
        staged.with_name(staged.name + ".json").unlink(missing_ok=True)
        raise
    now = time.monotonic()
    stats.add("servekit_storage_downloads_total", ref.scheme)
    stats.add("servekit_storage_download_bytes_total", ref.scheme, info.size)
    log.info("%s: fetched, %s, into %s", ref.uri, progress.line(now), entry)


def fetch(source: str, config: StorageConfig | None = None) -> Path:
    """The local file of ``source``: an ``s3://``/``gs://`` object through the node-local
    cache (downloaded only when the store holds a version the cache lacks), a path as is.

    A store that cannot be reached while the cache holds a copy serves that copy, said in
    the log.

    Raises:
        ModelNotFound: no such object.
        FetchFailed: the store cannot be read, or the download failed its checks; naming
            the bucket, the key and the error.
    """
    if not is_remote(source):
        return Path(source)
    config = config or StorageConfig()
    ref = parse(source)
    cache = ObjectCache(config.cache_root)
    try:
        info = stat(ref, config)
    except ModelNotFound:
        stats.add("servekit_storage_fetch_failures_total", ref.scheme)
        raise
    except FetchFailed as exc:
        stats.add("servekit_storage_fetch_failures_total", ref.scheme)
        cached = cache.newest(ref)
        if cached is None:
            raise
        log.warning("%s; serving the cached copy %s", exc, cached)
        stats.add("servekit_storage_cache_hits_total", ref.scheme)
        return cached
    entry = cache.entry(ref, info)
    if not cache.complete(entry):
        with cache.locked(entry):
            if not cache.complete(entry):  # another process may have fetched it meanwhile
                try:
                    _download(ref, info, entry, config)
                except BaseException:
                    stats.add("servekit_storage_fetch_failures_total", ref.scheme)
                    raise
                return entry
    stats.add("servekit_storage_cache_hits_total", ref.scheme)
    os.utime(entry.parent)  # the newest copy is the last one used
    return entry
