"""Where an object lives (``s3://bucket/key``, ``gs://bucket/key``), how to reach its store
(fsspec with s3fs or gcsfs, the ``servekit[cloud]`` extra) and what version it is at."""

from __future__ import annotations

import base64
import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import FetchFailed, ModelNotFound, SetupError
from ..tables import check_keys

__all__ = [
    "SCHEMES",
    "ObjectInfo",
    "ObjectRef",
    "StorageConfig",
    "is_remote",
    "download",
    "parse",
    "stat",
]

SCHEMES = ("s3", "gs")
_URI = re.compile(r"^(?P<scheme>[a-z0-9]+)://(?P<bucket>[^/]*)/?(?P<key>.*)$")


@dataclass(frozen=True)
class StorageConfig:
    """How servekit reaches object storage (the ``[storage]`` table). Credentials are found
    the way each cloud's SDK finds them: the environment (``AWS_ACCESS_KEY_ID``...,
    ``GOOGLE_APPLICATION_CREDENTIALS``), config files, workload identity."""

    cache: str | None = None
    """Node-local cache of fetched objects (default ``$SERVEKIT_OBJECT_CACHE``, else
    ``~/.cache/servekit/objects``); on Kubernetes, a volume that outlives the pod."""
    s3_endpoint_url: str | None = None
    """An S3-compatible store (MinIO, Ceph, a test server) instead of AWS; botocore's own
    ``AWS_ENDPOINT_URL_S3`` works too."""
    gcs_endpoint_url: str | None = None
    """A GCS-compatible endpoint (an emulator); gcsfs also reads ``STORAGE_EMULATOR_HOST``."""
    progress_s: float = 5.0
    """Seconds between progress lines (size, rate) of a download; 0 = none."""

    def __post_init__(self) -> None:
        if self.cache is not None:
            object.__setattr__(self, "cache", os.fspath(self.cache))
        if not self.progress_s >= 0:
            raise ValueError(f"[storage] progress_s must be >= 0, got {self.progress_s}")

    @property
    def cache_root(self) -> Path:
        if self.cache is not None:
            return Path(self.cache)
        env = os.environ.get("SERVEKIT_OBJECT_CACHE")
        return Path(env) if env else Path.home() / ".cache" / "servekit" / "objects"

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], section: str = "storage") -> StorageConfig:
        check_keys(section, data, {f.name for f in dataclasses.fields(cls)}, cls)
        return cls(**data)


@dataclass(frozen=True)
class ObjectRef:
    """One object: ``scheme://bucket/key``."""

    scheme: str
    bucket: str
    key: str

    @property
    def uri(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"

    @property
    def path(self) -> str:
        """The object as fsspec names it."""
        return f"{self.bucket}/{self.key}"

    def where(self) -> str:
        return f"bucket {self.bucket!r}, key {self.key!r}"


def is_remote(source: str | os.PathLike[str]) -> bool:
    """Whether ``source`` names an object in a store (``scheme://...``) rather than a path."""
    return isinstance(source, str) and "://" in source


def parse(source: str) -> ObjectRef:
    """``s3://bucket/key`` -> ObjectRef; a bad URI is a ValueError naming what is wrong."""
    m = _URI.match(source)
    if m is None:
        raise ValueError(f"{source!r} is not a URI of the form scheme://bucket/key")
    scheme, bucket, key = m["scheme"], m["bucket"], m["key"]
    if scheme not in SCHEMES:
        raise ValueError(f"{source!r}: scheme {scheme!r} is not one of {list(SCHEMES)}")
    if not bucket:
        raise ValueError(f"{source!r}: no bucket")
    if not key or key.endswith("/"):
        raise ValueError(f"{source!r}: no object key (a model source names one file)")
    return ObjectRef(scheme, bucket, key)


@dataclass(frozen=True)
class ObjectInfo:
    """What the store says of an object now: its size, the version that identifies its
    content (S3's ETag and version id, GCS's generation) and, where the store gives one,
    its MD5 to check a download against."""

    size: int
    version: str
    md5: str | None


def filesystem(scheme: str, config: StorageConfig) -> Any:
    """The fsspec filesystem for ``scheme`` (instances are cached by fsspec per options)."""
    try:
        if scheme == "s3":
            import s3fs

            kwargs = {"endpoint_url": config.s3_endpoint_url} if config.s3_endpoint_url else {}
            return s3fs.S3FileSystem(**kwargs)
        # gcsfs's default class probes each bucket's layout over gRPC first; the plain one
        # speaks JSON only, which every GCS endpoint (and emulator) answers.
        from gcsfs.core import GCSFileSystem

        kwargs = {"endpoint_url": config.gcs_endpoint_url} if config.gcs_endpoint_url else {}
        if config.gcs_endpoint_url:
            kwargs["token"] = "anon"
        return GCSFileSystem(**kwargs)
    except ImportError as exc:
        raise SetupError(
            f"{scheme}:// sources need the cloud extra: pip install 'servekit[cloud]' ({exc})"
        ) from None


def _md5_of(scheme: str, info: Mapping[str, Any]) -> str | None:
    if scheme == "gs" and info.get("md5Hash"):
        return base64.b64decode(info["md5Hash"]).hex()
    etag = str(info.get("ETag", "")).strip('"')
    # A multipart upload's ETag is not its MD5 ("<md5 of parts>-<count>").
    return etag if re.fullmatch(r"[0-9a-f]{32}", etag) else None


def stat(ref: ObjectRef, config: StorageConfig) -> ObjectInfo:
    """Ask the store for the object's size and version.

    Raises:
        ModelNotFound: no such object.
        FetchFailed: the store cannot be read (credentials, network), naming why.
    """
    fs = filesystem(ref.scheme, config)
    try:
        info = fs.info(ref.path, refresh=True) if ref.scheme == "s3" else fs.info(ref.path)
    except FileNotFoundError:
        raise ModelNotFound(_missing(fs, ref)) from None
    except Exception as exc:
        raise FetchFailed(f"{ref.uri}: cannot read ({ref.where()}): {_why(exc)}") from None
    if info.get("type") != "file":
        raise ModelNotFound(f"{ref.uri}: not an object but a prefix ({ref.where()})")
    if ref.scheme == "gs":
        version = f"g{info.get('generation', '')}"
    else:
        version = str(info.get("ETag", "")).strip('"') + (
            f".{info['VersionId']}" if info.get("VersionId") else ""
        )
    return ObjectInfo(int(info["size"]), version, _md5_of(ref.scheme, info))


def download(ref: ObjectRef, config: StorageConfig, target: Path, progress: Any) -> None:
    """Stream the object into ``target`` (one GET), reporting to ``progress`` (an fsspec
    Callback); any failure raises FetchFailed naming the object and the error."""
    fs = filesystem(ref.scheme, config)
    try:
        fs.get_file(ref.path, str(target), callback=progress)
    except FileNotFoundError:
        raise ModelNotFound(_missing(fs, ref)) from None
    except Exception as exc:
        raise FetchFailed(f"{ref.uri}: download failed ({ref.where()}): {_why(exc)}") from None


def _missing(fs: Any, ref: ObjectRef) -> str:
    """What is missing: the bucket itself, or the object in it (the store's 404 alone
    does not say which)."""
    try:
        bucket = fs.exists(ref.bucket)
    except Exception:  # cannot tell: say what is known
        bucket = True
    if not bucket:
        return f"{ref.uri}: no such bucket {ref.bucket!r} (check the bucket's name and endpoint)"
    return f"{ref.uri}: no such object ({ref.where()})"


def listing(root: str, config: StorageConfig) -> list[str]:
    """The keys under ``scheme://bucket/prefix``, relative to it (a store of many models).

    Raises:
        FetchFailed: the store cannot be listed, naming the bucket, the prefix and why.
    """
    m = _URI.match(root)
    if m is None or m["scheme"] not in SCHEMES or not m["bucket"]:
        raise ValueError(f"{root!r} is not a URI of the form scheme://bucket[/prefix]")
    prefix = f"{m['bucket']}/{m['key']}".rstrip("/")
    fs = filesystem(m["scheme"], config)
    try:
        found = fs.find(prefix, refresh=True) if m["scheme"] == "s3" else fs.find(prefix)
    except FileNotFoundError:
        found = []
    except Exception as exc:
        raise FetchFailed(
            f"{root}: cannot list (bucket {m['bucket']!r}, prefix {m['key']!r}): {_why(exc)}"
        ) from None
    return sorted(str(key)[len(prefix) + 1 :] for key in found if str(key).startswith(prefix + "/"))


def _why(exc: BaseException) -> str:
    text = str(exc).strip() or "no detail"
    if isinstance(exc, PermissionError):
        text += " (the store refused these credentials, or its policy denies the read)"
    return f"{type(exc).__name__}: {text}"
