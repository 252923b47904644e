"""The batching decision: a pure function of the waiting requests and the time.

It walks the queue the way Triton's dynamic batcher does and answers "send the first
N requests now" or "wait this long". No clock, no threads: it is unit-tested with
a fake clock.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from .request import Request

__all__ = ["Decision", "decide"]


@dataclass(frozen=True, slots=True)
class Decision:
    take: int
    """Send the first ``take`` requests of the walk now (0 = send nothing)."""
    wait_s: float | None = None
    """With ``take == 0``: decide again after this long even if nothing arrives."""


def decide(
    pending: Sequence[Request],
    now: float,
    *,
    limit: int,
    preferred: Collection[int] = (),
    delay_s: float = 0.0,
    flush: bool = False,
) -> Decision:
    """Choose the next batch from ``pending`` (walk order) for a free instance.

    Args:
        pending: waiting requests in walk order; ``limit + 1`` of them are enough.
        now: current time on the clock the requests' ``arrival`` uses.
        limit: most rows in one batch (largest preferred size, else max_batch_size).
        preferred: preferred batch sizes.
        delay_s: max queue delay; 0 sends whatever is waiting.
        flush: send whatever is waiting regardless of delay (shutdown drain).
    """
    if not pending:
        return Decision(0)
    rows = n = best = 0
    shape = pending[0].shape_key
    oldest = pending[0].arrival
    cannot_grow = False
    for r in pending:
        if n and (rows + r.rows > limit or r.shape_key != shape):
            cannot_grow = True
            break
        rows += r.rows
        n += 1
        oldest = min(oldest, r.arrival)
        if rows in preferred:
            best = n
        if rows >= limit:
            cannot_grow = True
            break
    waited = now - oldest
    # 1 ns of slack: float clocks make "now - arrival" fall a hair short of an exact delay.
    delay_exceeded = delay_s > 0 and waited >= delay_s - 1e-9
    if best and not delay_exceeded:
        return Decision(best)
    if cannot_grow or flush or delay_s <= 0 or delay_exceeded:
        return Decision(n)
    return Decision(0, delay_s - waited)
