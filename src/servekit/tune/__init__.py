"""``servekit tune``: Model Analyzer's configuration search for every runtime.

``SearchSpace`` is the grid of knobs, ``measure`` serves and loads one candidate,
``brute``/``quick`` search, ``tune`` runs a search for one runtime and ``write_outputs``
writes ``best.toml``, the report and the plots.
"""

from .measure import Measurement, measure
from .report import pareto_front, write_outputs
from .run import SEARCHES, TuneResult, baseline_knobs, for_runtime, tune
from .search import Constraints, Trial, best_trial, brute, quick
from .space import KNOBS, Knobs, SearchSpace

__all__ = [
    "KNOBS",
    "SEARCHES",
    "Constraints",
    "Knobs",
    "Measurement",
    "SearchSpace",
    "Trial",
    "TuneResult",
    "baseline_knobs",
    "best_trial",
    "brute",
    "for_runtime",
    "measure",
    "pareto_front",
    "quick",
    "tune",
    "write_outputs",
]
