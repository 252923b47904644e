"""servekit's autoscaling signal as Ray Serve's autoscaling policy.

Every model replica reports ``servekit_replicas_needed`` (``servekit.autoscale``: the
replicas of itself its traffic needs, from its own Batcher's counters) to Serve's
controller through ``record_autoscaling_stats``; ``replicas_needed`` sums the replicas'
reports and asks for that many, rounded up. Ray applies the deployment's
``min_replicas``, ``max_replicas`` and up/downscale delays around it, so the signal
that scales a Kubernetes Deployment (an HPA on the same metric) scales Ray the same way.

Ray pickles this module by value into its controller: it imports nothing of servekit's.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["SIGNAL", "replicas_needed"]

SIGNAL = "servekit_replicas_needed"


def replicas_needed(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Ray Serve's policy function: the sum of the running replicas' signals, rounded up
    (a hair below a whole number stays at it)."""
    reports = (ctx.aggregated_metrics or {}).get(SIGNAL, {})
    total = float(sum(reports.values()))
    if not reports:  # nothing reported yet (replicas starting): keep what is asked
        return ctx.target_num_replicas, {}
    return math.ceil(total - 1e-3), {SIGNAL: total}
