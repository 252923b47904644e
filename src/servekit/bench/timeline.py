"""Where a device idles: the simulated device's own record of its batches, read back.

``SimulatedDevice`` appends one line per batch to ``SERVEKIT_DEVICE_TIMELINE`` (from
whichever process runs it): when the runner was handed the batch, when the device took
it and when it let it go. From those alone, with no clock of the server's: the share of
time the device was busy, how often the next batch was already waiting when the device
finished one (the hand-over overlapped), and how long the device sat idle between
batches otherwise (the host's hand-back and hand-over: answering the batch, forming
the next, passing it to the worker). ``draw`` shows it as one lane per runtime.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Batch", "Summary", "draw", "read", "summarize"]


@dataclass(frozen=True)
class Batch:
    """One batch on the device (``time.time`` seconds)."""

    handed: float
    """The runner was handed it (the batch is formed and in the worker)."""
    start: float
    """The device took it."""
    end: float
    """The device let it go."""
    rows: int
    pid: int
    device: str = ""
    """The device's name (its profile's)."""


def read(path: str | Path) -> list[Batch]:
    """The batches a timeline file holds, by the time the device took them."""
    lines = Path(path).read_text().splitlines()
    return sorted((Batch(**json.loads(line)) for line in lines if line), key=lambda b: b.start)


@dataclass(frozen=True)
class Summary:
    """A timeline's steady part (its first and last ``trim`` of the span left out)."""

    window_s: float
    batches: int
    busy_share: float
    """The device's busy time over the window."""
    overlapped_share: float
    """Batches handed to the runner before the device let the previous one go."""
    idle_gap_ms: float
    """The median time the device sat idle after a batch whose successor was not yet handed."""
    rows_per_batch: float

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in vars(self).items()}


def summarize(batches: Sequence[Batch], trim: float = 0.2) -> Summary:
    """The device's use over the middle of ``batches`` (their span less ``trim`` each end)."""
    if len(batches) < 3:
        raise ValueError(f"a timeline needs at least 3 batches, got {len(batches)}")
    first, last = batches[0].start, batches[-1].end
    lo, hi = first + trim * (last - first), last - trim * (last - first)
    steady = [b for b in batches if lo <= b.start and b.end <= hi]
    if len(steady) < 3:
        raise ValueError("too few batches in the timeline's steady part")
    window = steady[-1].end - steady[0].start
    busy = sum(b.end - b.start for b in steady)
    pairs = list(zip(steady, steady[1:], strict=False))
    overlapped = sum(1 for prev, nxt in pairs if nxt.handed <= prev.end)
    gaps = [nxt.start - prev.end for prev, nxt in pairs if nxt.handed > prev.end]
    return Summary(
        window_s=window,
        batches=len(steady),
        busy_share=busy / window,
        overlapped_share=overlapped / len(pairs),
        idle_gap_ms=1e3 * statistics.median(gaps) if gaps else 0.0,
        rows_per_batch=statistics.fmean(b.rows for b in steady),
    )


def draw(timelines: Mapping[str, Sequence[Batch]], path: Path, span_s: float = 0.4) -> None:
    """One lane per runtime over ``span_s`` from the middle of its timeline: the device busy
    (dark, the batch's rows written in), and above it the time a batch waited in the
    worker for the device (light: its hand-over overlapped the batch before)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.8 * len(timelines)), dpi=120)
    labels = []
    for lane, (name, batches) in enumerate(timelines.items()):
        middle = (batches[0].start + batches[-1].end) / 2
        shown = [b for b in batches if middle <= b.start and b.end <= middle + span_s]
        summary = summarize(batches)
        y = len(timelines) - 1 - lane
        for b in shown:
            x0 = (b.start - middle) * 1e3
            ax.broken_barh([(x0, (b.end - b.start) * 1e3)], (y, 0.5), color="C0")
            if b.start > b.handed:
                waited = ((b.handed - middle) * 1e3, (b.start - b.handed) * 1e3)
                ax.broken_barh([waited], (y + 0.55, 0.25), color="C1", alpha=0.6)
            ax.text(x0 + 0.5, y + 0.15, str(b.rows), fontsize=6, color="white")
        labels.append((y + 0.4, f"{name}\n{100 * summary.busy_share:.1f} % busy"))
    ax.set_yticks([y for y, _ in labels], [label for _, label in labels], fontsize=8)
    ax.set_xlabel("ms (blue: the device runs a batch of n rows; orange: a batch waits for it)")
    ax.set_xlim(0, span_s * 1e3)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
