"""Shared fixtures: zoo models built once per session into a private cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from servekit import zoo


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def resnet50_path(model_cache: Path) -> Path:
    return zoo.build("resnet50", model_cache)


@pytest.fixture(scope="session")
def tiny_cnn_path(model_cache: Path) -> Path:
    return zoo.build("tiny_cnn", model_cache)


@pytest.fixture(scope="session")
def add_sub_path(model_cache: Path) -> Path:
    return zoo.build("add_sub", model_cache)


def free_port() -> int:
    """A loopback port nothing listens on (re-exported for the test modules)."""
    from servekit.triton.env import free_port as _free

    return _free()


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """A Prometheus exposition's samples, keyed by (name as exposed, labels); parsed by
    prometheus_client, so a malformed exposition fails the test too."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            # The parser names counter samples the OpenMetrics way (``_total``); Triton's
            # and servekit's exposition do not.
            name = s.name.removesuffix("_total") if family.type == "counter" else s.name
            out[(name, frozenset(s.labels.items()))] = s.value
    return out


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """GET a metrics endpoint and parse it (``parse_metrics``)."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return parse_metrics(r.read().decode())


def sample(samples: dict, name: str, **labels: str) -> float:
    """One sample's value (0 when absent, as a counter that never moved)."""
    return samples.get((name, frozenset(labels.items())), 0.0)
