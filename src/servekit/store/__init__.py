"""Many models on shared hardware: a catalog of every model known, loads on demand
(one load per model however many requests wait for it), and a memory budget held by
evicting the least recently used idle, unpinned model.

``ModelStore`` is the core every runtime that honours ``[store]`` uses; ``StoreModels``
serves it to servekit's front (HTTP and gRPC), Triton's repository extension included.
"""

from .app import store_app
from .catalog import catalog
from .memory import device_bytes, resident_bytes, rss_bytes
from .meter import Meter
from .registry import StoreModels
from .store import ModelStore, Resident

__all__ = [
    "Meter",
    "ModelStore",
    "Resident",
    "StoreModels",
    "catalog",
    "device_bytes",
    "resident_bytes",
    "rss_bytes",
    "store_app",
]
