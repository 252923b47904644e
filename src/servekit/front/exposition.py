"""The Triton runtimes' public metrics port: tritonserver's exposition and the front's own
(the response cache's ``nv_cache_*``, ``servekit_*``, the rollout's, the in-process
models'), merged into one, so every family is where the documentation says (:8002).

tritonserver's metrics then listen on a private loopback port; the front answers the
public one, asking tritonserver at each scrape. A family both expose is written once;
a series both count (a request the front refused and one the stub failed, say) is summed.

Each request answered with an error is counted in ``nv_inference_request_failure``, as on
servekit's own runtimes (``failures_counted``): tritonserver's Python backend counts the
error responses of servekit's stubs as successes (they count them in
``servekit_request_failure``), and never sees a request the front refused.
"""

from __future__ import annotations

import asyncio
import logging
import re
import urllib.request
from collections.abc import Callable

from ..http.messages import Answer, Handler, HttpRequest
from ..metrics import CONTENT_TYPE

__all__ = ["failures_counted", "merge_expositions", "merged_metrics_handler"]

log = logging.getLogger(__name__)

_JSON = {"content-type": "application/json"}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\S+)?$")
_SUFFIXES = ("_count", "_sum", "_bucket", "_total", "_created")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_FAILURE = "servekit_request_failure"
_NV_FAILURE, _NV_SUCCESS = "nv_inference_request_failure", "nv_inference_request_success"


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


def failures_counted(text: str, *, counted_as_success: bool) -> str:
    """An exposition that, merged with ``text`` (``merge_expositions`` sums a series),
    moves each request in ``text``'s ``servekit_request_failure`` into
    ``nv_inference_request_failure`` of its model and version (tritonserver's series of
    reason ``BACKEND`` where it labels reasons); ``counted_as_success``:
    ``text`` is tritonserver's, which counted those requests as successes, so they are
    taken out of ``nv_inference_request_success``. Moved, not copied: their
    ``servekit_request_failure`` series merge to 0, so a dashboard that adds the two
    families (as one must on tritonserver's port alone) counts each request once."""
    failed: dict[tuple[str, str], float] = {}
    moved: list[str] = []
    series: dict[tuple[str, str, str], str] = {}  # (family, model, version) -> its labels
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1) not in (_FAILURE, _NV_FAILURE, _NV_SUCCESS):
            continue
        name, labels = match.group(1), match.group(2) or ""
        pairs = dict(_LABEL.findall(labels))
        model, version = pairs.get("model", ""), pairs.get("version", "")
        if name == _FAILURE:
            failed[model, version] = failed.get((model, version), 0.0) + _value(match.group(3))
            moved.append(f"{name}{labels} {_num(-_value(match.group(3)))}")
        elif (name, model, version) not in series or pairs.get("reason") == "BACKEND":
            series[name, model, version] = labels  # tritonserver's reason: the backend's
    lines = [f"# TYPE {_NV_FAILURE} counter"]
    if counted_as_success:
        lines.append(f"# TYPE {_NV_SUCCESS} counter")
    head = len(lines)
    for (model, version), n in failed.items():
        if not n:
            continue
        own = f'{{model="{model}",version="{version}"}}'  # tritonserver's order
        lines.append(f"{_NV_FAILURE}{series.get((_NV_FAILURE, model, version), own)} {_num(n)}")
        if counted_as_success:
            labels = series.get((_NV_SUCCESS, model, version), own)
            lines.append(f"{_NV_SUCCESS}{labels} {_num(-n)}")
    if len(lines) == head:
        return ""
    return "\n".join([*lines, f"# TYPE {_FAILURE} counter", *moved]) + "\n"


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
        mine = own()
        merged = merge_expositions(
            theirs,
            mine,
            failures_counted(theirs, counted_as_success=True),
            failures_counted(mine, counted_as_success=False),
        )
        return 200, merged.encode(), {"content-type": CONTENT_TYPE}

    return handle
