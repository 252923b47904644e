"""Which system shared-memory keys a client may register, and the checks a registration
passes before its object is mapped (the hardening Triton added after CVE-2025-23319): a
key names a plain file of ``/dev/shm`` (no path, no symbolic link), never one of the
serving stack's own regions, and the span fits it.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any

from ..errors import InvalidInput

__all__ = ["RESERVED_KEYS", "SHM_ROOT", "check_registration", "open_key"]

SHM_ROOT = "/dev/shm"
_KEY = re.compile(r"^/?[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
RESERVED_KEYS = ("triton_python_backend", "psm_")
"""Key prefixes of the serving stack's own regions (Triton's Python backend stubs,
PyTriton's tensor store): never registrable by a client."""


def open_key(name: str, key: Any, offset: Any, byte_size: Any, root: str = SHM_ROOT) -> int:
    """A descriptor of the shared-memory object ``key`` (read and write), once the
    registration of region ``name`` passes every check; ``InvalidInput`` naming the one
    that failed. The front of the Triton runtimes runs the same checks before it passes a
    registration on (tritonserver answers a missing key as its own error, a 500)."""
    what = f"shared-memory region {name!r}"
    if not isinstance(key, str) or not _KEY.match(key):
        raise InvalidInput(
            f"{what}: key must name a shared-memory object (/name: letters, digits, "
            f"'.', '_', '-'), got {key!r}"
        )
    plain = key.lstrip("/")
    if plain.startswith(RESERVED_KEYS):
        raise InvalidInput(f"{what}: key {key!r} names one of the server's own regions")
    for field, value in (("offset", offset), ("byte_size", byte_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidInput(f"{what}: {field} must be a non-negative integer, got {value!r}")
    try:
        fd = os.open(os.path.join(root, plain), os.O_RDWR | os.O_NOFOLLOW)
    except OSError as exc:
        raise InvalidInput(
            f"{what}: cannot open shared-memory key {key!r}: {exc.strerror}"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidInput(f"{what}: key {key!r} is not a shared-memory object")
        if offset + byte_size > info.st_size or byte_size == 0:
            raise InvalidInput(
                f"{what}: offset {offset} + byte_size {byte_size} does not fit key "
                f"{key!r} of {info.st_size} bytes"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_registration(name: str, key: Any, offset: Any, byte_size: Any) -> None:
    """``open_key``'s checks alone (the front's, before tritonserver maps the key)."""
    os.close(open_key(name, key, offset, byte_size))
