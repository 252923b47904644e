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
