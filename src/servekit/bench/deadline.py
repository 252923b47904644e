"""A client with a deadline that retries, as clients behave under overload.

A request's deadline is ``timeout_s`` after it was first sent (open loop: after it was
due). Each attempt waits for its answer only as long as is left before that deadline, and
carries what is left as its KServe ``timeout``, as a client propagating its deadline does
(a server that sheds judges the time its client really has, a load generator running
behind included); an attempt given up is cancelled, which closes its HTTP connection or
cancels its gRPC call, so the server sees a client that left (never a request merely no
longer awaited). With ``retries`` a request refused (503 / UNAVAILABLE) or timed out is
sent again, up to ``retries`` more times, while time is left: after a refusal once the
server's ``Retry-After`` has passed, capped by the deadline (an attempt given up at the
deadline leaves nothing to retry in). A first attempt sent after its deadline (the load
generator behind) still goes, with 1 ms.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ModelNotReady, Overloaded, ServekitError, ServerUnreachable
from .targets import Target

__all__ = ["Outcome", "is_refusal", "request", "retry_after_s"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of one request, over all its attempts."""

    error: BaseException | None
    """Why it failed in the end (its last attempt's error), or None: it was answered."""
    attempts: int
    timed_out: int
    """Attempts given up at their deadline, or answered 504 / DEADLINE_EXCEEDED."""
    refused: int
    """Attempts refused with 503 / UNAVAILABLE."""
    in_time: bool
    """Answered before the request's deadline (always, when there is no deadline)."""


def is_refusal(error: BaseException) -> bool:
    """The server refused the attempt (503 / UNAVAILABLE: a full queue, a request shed, a
    model not ready), as opposed to not being reached at all."""
    return isinstance(error, Overloaded | ModelNotReady) and not isinstance(
        error, ServerUnreachable
    )


def retry_after_s(error: BaseException) -> float:
    """How long the server asked the client to wait before retrying (0: no ask)."""
    return error.retry_after_s if isinstance(error, Overloaded) else 0.0


async def request(
    target: Target,
    timeout_s: float | None,
    retries: int,
    start: float,
    clock: Callable[[], float] = time.perf_counter,
) -> Outcome:
    """Send one request to ``target`` until it is answered, fails for good, or has been
    sent ``retries`` more times; ``start`` is when it began (``clock``'s time), from which
    its deadline counts."""
    attempts = timed_out = refused = 0
    gave_up = f"no answer within {(timeout_s or 0) * 1e3:g} ms: the client gave up"
    error: BaseException | None = None
    while True:
        if timeout_s is not None:
            left = start + timeout_s - clock()
            if attempts and left <= 0:  # nothing left to retry in
                return Outcome(error, attempts, timed_out, refused, False)
            left = max(left, 1e-3)
        attempts += 1
        try:
            if timeout_s is None:
                await target.send()
            else:  # on timeout the attempt is cancelled: its connection closes
                await asyncio.wait_for(target.send(timeout_us=max(1, round(left * 1e6))), left)
            error = None
        except ServekitError as exc:  # before TimeoutError: DeadlineExceeded is one too
            error = exc
        except TimeoutError:
            error = TimeoutError(gave_up)
        if error is None:
            late = timeout_s is not None and clock() - start > timeout_s
            return Outcome(None, attempts, timed_out, refused, not late)
        if isinstance(error, TimeoutError):  # the client's own, or the server's 504
            timed_out += 1
        elif is_refusal(error):
            refused += 1
        else:
            return Outcome(error, attempts, timed_out, refused, False)
        if attempts > retries:
            return Outcome(error, attempts, timed_out, refused, False)
        if not isinstance(error, TimeoutError):
            wait = retry_after_s(error)
            if timeout_s is not None:  # no later than the deadline: the client waits no more
                wait = min(wait, max(0.0, start + timeout_s - clock()))
            if wait > 0:
                await asyncio.sleep(wait)
