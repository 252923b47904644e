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
    """A TCP port nothing listens on right now (loopback)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
