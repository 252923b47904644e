"""The best p99 any fixed batching policy reaches on one serial device under Poisson load:
a discrete-event simulation, no server, no HTTP (issue: batching that holds a latency
budget). It bounds what ``bench/budget.py`` can show: where the best policy's p99 is over
the budget, no batcher holds it on one instance.

The device takes ``fixed_ms + per_row_ms * rows`` a batch (``sim_t4`` at scale 8: 8 ms +
1.6 ms a row). A policy is a batch cap and a queue delay, as Triton's: when the device is
free, a batch starts once ``cap`` rows wait or the oldest has waited ``delay``, and takes
up to ``cap`` rows. Each policy runs ``--seconds`` of arrivals for each of ``--seeds``; the
p99 is over arrivals after the first 5 s, averaged over seeds.

    python bench/budget_bound.py --ceiling 531 --shares 0.8 0.85 0.9
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np


def p99_ms(
    rate: float, cap: int, delay_ms: float, fixed_ms: float, per_row_ms: float, seconds: float,
    seed: int,
) -> float:  # fmt: skip
    arrivals = np.cumsum(
        np.random.default_rng(seed).exponential(1 / rate, int(rate * seconds * 1.2))
    )
    arrivals = arrivals[arrivals < seconds]
    n, head, free = len(arrivals), 0, 0.0
    latency = np.empty(n)
    while head < n:
        full_at = arrivals[head + cap - 1] if head + cap - 1 < n else np.inf
        start = max(free, arrivals[head], min(arrivals[head] + delay_ms / 1e3, full_at))
        rows = min(cap, int(np.searchsorted(arrivals, start, side="right")) - head)
        free = start + (fixed_ms + per_row_ms * rows) / 1e3
        latency[head : head + rows] = free - arrivals[head : head + rows]
        head += rows
    return float(np.percentile(latency[arrivals > 5.0], 99) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ceiling", type=float, default=531.0, help="rows/s the shares are of")
    ap.add_argument("--shares", type=float, nargs="+", default=[0.8, 0.85, 0.9])
    ap.add_argument("--fixed-ms", type=float, default=8.0)
    ap.add_argument("--per-row-ms", type=float, default=1.6)
    ap.add_argument("--caps", type=int, nargs="+", default=[8, 12, 16, 20, 24, 28, 32, 40, 48, 64])
    ap.add_argument("--delays-ms", type=float, nargs="+", default=[0, 1, 2, 5, 10, 20, 40])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    print(
        "| share of the ceiling | rows/s | best policy (cap, delay ms) | its p99 ms | cap 32, no delay: p99 ms |"
    )
    print("| --- | --- | --- | --- | --- |")
    for share in args.shares:
        rate = share * args.ceiling

        def p99(cap: int, delay: float, rate: float = rate) -> float:
            return float(np.mean([
                p99_ms(rate, cap, delay, args.fixed_ms, args.per_row_ms, args.seconds, s)
                for s in range(args.seeds)
            ]))  # fmt: skip

        found = {(c, d): p99(c, d) for c, d in itertools.product(args.caps, args.delays_ms)}
        (cap, delay), best = min(found.items(), key=lambda item: item[1])
        plain = found.get((32, 0.0), float("nan"))
        print(f"| {share:g} | {rate:.0f} | {cap}, {delay:g} | {best:.1f} | {plain:.1f} |")


if __name__ == "__main__":
    main()
