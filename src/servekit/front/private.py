"""tritonserver's private HTTP port, for the calls the Triton runtimes' front passes on
as they are: ``triton_fetch`` (an index, statistics, a shared-memory registration; a
load or unload, waited for as long as it takes) and ``triton_ready``."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from typing import TypeVar, cast

from ..errors import ModelNotReady

__all__ = ["CONTROL_WAIT_S", "FETCH_WAIT_S", "triton_fetch", "triton_ready"]

_T = TypeVar("_T")

FETCH_WAIT_S = 10.0
"""How long the front waits for tritonserver's answer to a call it passes on as it is
(an index, statistics, a shared-memory registration): each is answered at once."""

CONTROL_WAIT_S = 3600.0
"""How long the front waits for tritonserver's answer to a load or unload: Triton answers
once the model is loaded, which can take minutes (a big model read, a TensorRT engine
built, a Python backend stub started on a busy host). The client's own timeout, as with
Triton's own port, is what ends its wait sooner."""


async def triton_fetch(
    http_url: str,
    headers: Mapping[str, str],
    method: str,
    path: str,
    body: bytes | None = None,
    *,
    control: bool = False,
) -> tuple[int, bytes, dict[str, str]]:
    """tritonserver's answer to a request on its private HTTP port, as it is (a POST
    without ``body`` sends ``{}``), waited for ``FETCH_WAIT_S``; ``control`` (a load or
    unload): for ``CONTROL_WAIT_S``, on a thread of its own (``_on_own_thread``)."""
    wait = CONTROL_WAIT_S if control else FETCH_WAIT_S

    def call() -> tuple[int, bytes, dict[str, str]]:
        request = urllib.request.Request(
            f"{http_url}{path}",
            method=method,
            headers=dict(headers),
            data=(body or b"{}") if method == "POST" else None,
        )
        try:
            with urllib.request.urlopen(request, timeout=wait) as r:
                return r.status, r.read(), {"content-type": "application/json"}
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read(), {"content-type": "application/json"}
        except (urllib.error.URLError, OSError) as exc:
            raise ModelNotReady(f"tritonserver is not answering: {exc}") from None

    return await (_on_own_thread(call) if control else asyncio.to_thread(call))


async def _on_own_thread(fn: Callable[[], _T]) -> _T:
    """``fn()`` on a daemon thread of its own: a load that takes tritonserver long holds
    neither the loop's shared worker threads (readiness checks and other passed-on calls
    wait on those) nor the process's exit (the interpreter joins those at exit)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[_T] = loop.create_future()

    def settle(result: _T | None, exc: BaseException | None) -> None:
        if done.cancelled():
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(cast(_T, result))

    def run() -> None:
        try:
            result, exc = fn(), None
        except BaseException as e:  # noqa: BLE001 (handed to the caller as it is)
            result, exc = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (a stop)
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=run, name="servekit-control", daemon=True).start()
    return await done


async def triton_ready(http_url: str, name: str, version: str | None) -> bool:
    """Whether tritonserver has ``name`` (at ``version``) ready."""
    path = f"/v2/models/{urllib.parse.quote(name, safe='')}"
    if version:
        path += f"/versions/{urllib.parse.quote(version, safe='')}"

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"{http_url}{path}/ready", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    return await asyncio.to_thread(ready)
