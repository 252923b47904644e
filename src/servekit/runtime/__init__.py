"""The Runtime contract every runtime implements, the model loader (``load_models``), the
record of what a runtime serves (``ServedModels``) and the ``Supervisor`` (signals, SIGHUP
reloads, restarts). Which runtime a ``ServeConfig`` names is chosen above the runtimes,
in ``servekit.serving``."""

from .base import Runtime, ServedModel, load_model_runner, load_models
from .registry import ServedModels
from .supervisor import Supervisor

__all__ = [
    "Runtime",
    "ServedModel",
    "ServedModels",
    "Supervisor",
    "load_model_runner",
    "load_models",
]
