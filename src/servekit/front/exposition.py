"""The Triton runtimes' public metrics port: tritonserver's exposition and the front's own
(the response cache's ``nv_cache_*``, ``servekit_*``, the rollout's, the in-process
models'), merged into one, so every family is where the documentation says (:8002).

tritonserver's metrics then listen on a private loopback port; the front answers the
public one, asking tritonserver at each scrape. A family both expose is written once;
a series both count (a request the front refused and one the stub failed, say) is summed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import urllib.request
from collections.abc import Callable

from ..http.messages import Answer, Handler, HttpRequest
from ..metrics import CONTENT_TYPE

__all__ = ["merge_expositions", "merged_metrics_handler"]

log = logging.getLogger(__name__)

_JSON = {"content-type": "application/json"}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\S+)?$")
_SUFFIXES = ("_count", "_sum", "_bucket", "_total", "_created")


def merge_expositions(*texts: str) -> str:
    """Prometheus text expositions as one: each family's HELP and TYPE once, its samples
    together, a series (name and labels) exposed by several summed."""
    order: list[str] = []
    meta: dict[str, list[str]] = {}
    samples: dict[str, dict[tuple[str, str], float]] = {}
    for text in texts:
        current = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    current = parts[2]
                    if current not in meta:
                        order.append(current)
                        meta[current], samples[current] = [], {}
                    if not any(m.split(None, 3)[1] == parts[1] for m in meta[current]):
                        meta[current].append(line)
                continue
            match = _SAMPLE.match(line)
            if match is None:
                continue
            name, labels, value = match.group(1), match.group(2) or "", match.group(3)
            family = _family_of(name, current, meta)
            if family not in meta:
                order.append(family)
                meta[family], samples[family] = [], {}
            key = (name, labels)
            held = samples[family]
            held[key] = held.get(key, 0.0) + _value(value)
    out: list[str] = []
    for family in order:
        out.extend(meta[family])
        out.extend(f"{name}{labels} {_num(v)}" for (name, labels), v in samples[family].items())
    return "\n".join(out) + "\n"


def _family_of(name: str, current: str, meta: dict[str, list[str]]) -> str:
    if name in meta:
        return name
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in meta:
            return name[: -len(suffix)]
    return current if current and name.startswith(current) else name


def _value(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")


def _num(v: float) -> str:
    if v != v:
        return "NaN"
    return str(int(v)) if float(v).is_integer() and abs(v) < 2**53 else repr(float(v))


def merged_metrics_handler(upstream: str, own: Callable[[], str]) -> Handler:
    """``GET /metrics``: tritonserver's exposition at ``upstream`` merged with ``own()``;
    where tritonserver does not answer, the front's own alone (said once)."""
    said = False

    def fetch() -> str:
        with urllib.request.urlopen(upstream, timeout=5) as r:
            return str(r.read().decode("utf-8", "replace"))

    async def handle(request: HttpRequest) -> Answer:
        nonlocal said
        if request.method != "GET" or request.path.rstrip("/") != "/metrics":
            return 404, b'{"error": "only GET /metrics is served here"}', _JSON
        try:
            theirs = await asyncio.get_running_loop().run_in_executor(None, fetch)
        except OSError as exc:
            if not said:
                log.warning("tritonserver's metrics at %s do not answer: %s", upstream, exc)
                said = True
            theirs = ""
        return 200, merge_expositions(theirs, own()).encode(), {"content-type": CONTENT_TYPE}

    return handle
