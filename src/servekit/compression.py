"""Request bodies and gRPC messages compressed with gzip or deflate: what both of
servekit's servers (``http.app``, ``grpc.h2``) accept, inflated under a size limit."""

from __future__ import annotations

import zlib

from .errors import InvalidInput

__all__ = ["ENCODINGS", "inflate"]

ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
"""Encoding name -> zlib's wbits for it (tritonclient's deflate is zlib-wrapped)."""


def inflate(data: bytes, encoding: str, limit: int, what: str) -> bytes:
    """``data`` decompressed as ``encoding`` (a key of ``ENCODINGS``), never past
    ``limit + 1`` bytes whatever it claims: a result longer than ``limit`` is over it.

    A stream that is not ``encoding``, or that ends early, is ``InvalidInput`` naming ``what``."""
    decompressor = zlib.decompressobj(ENCODINGS[encoding])
    try:
        plain = decompressor.decompress(data, limit + 1)
    except zlib.error as exc:
        raise InvalidInput(f"{what} does not decompress as {encoding}: {exc}") from None
    if len(plain) <= limit and not decompressor.eof:
        raise InvalidInput(f"{what} does not decompress as {encoding}: it ends early")
    return plain
