"""``TritonRuntime``: a ``ServeConfig`` served by tritonserver with servekit's Triton backend.

The config is rendered to a model repository in a private folder (``model_repository``),
and ``TritonProcess`` runs tritonserver on it behind servekit's front, with the config's
ports and tokens. What ``servekit serve --runtime triton`` runs; ``servekit repo build``
writes the same repository to a folder of your own for ``servekit triton``.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from ..config import ServeConfig
from ..protocol.routed import traffic_of
from ..runtime.base import static_budgets
from ..runtime.registry import watched_identity
from .launcher import TritonOptions, TritonProcess
from .repo import build_repository, model_repository

__all__ = ["TritonRuntime"]

log = logging.getLogger(__name__)


class TritonRuntime:
    """The ``triton`` runtime: start, use, stop (or a context manager)."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config.check("triton")
        self.process: TritonProcess | None = None
        self._root: Path | None = None
        self.traffic = traffic_of(self.config.models)
        """Each versioned model's split and canary (the front's), kept across restarts."""

    @classmethod
    def from_config(cls, config: ServeConfig) -> TritonRuntime:
        return cls(config)

    @property
    def repository(self) -> Path | None:
        return self._root

    def start(self) -> TritonRuntime:
        """Render and build the repository, start tritonserver, wait for every model."""
        for line in static_budgets(self.config):
            log.warning("%s", line)
        self._root = Path(tempfile.mkdtemp(prefix="servekit-repository-"))
        try:
            models = model_repository(self.config)
            build_repository(self._root, models, cache_dir=self.config.cache_dir)
            self.process = TritonProcess(
                TritonOptions(self._root, self.config.server),
                traffic=self.traffic,
                autoscale=self.config.autoscale_policies(),
                shed_late=[m.name for m in self.config.models if m.batching.shed_late],
                cached={
                    m.name: watched_identity(m, self.config)
                    for m in self.config.models
                    if m.response_cache
                },
            ).start()
            self.process.wait_ready(
                [m.name for m in models if m.broken is None]
                + [  # each version of a routed model ("<name>/versions/<v>/ready")
                    f"{name}/versions/{v}" for name, t in self.traffic.items() for v in t.versions
                ]
            )
        except BaseException:
            self.stop()
            raise
        return self

    def problem(self) -> str | None:
        return self.process.problem() if self.process is not None else "not started"

    def restart(self) -> None:
        assert self.process is not None
        self.process.restart()

    def reload(self) -> list[str]:
        assert self.process is not None
        return self.process.reload()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def __enter__(self) -> TritonRuntime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
