"""servekit on Triton: the environment the Python backend stub needs, PyTriton serving."""

from .env import TritonSetupError, apply_triton_environment, triton_environment
from .server import ServedModel, ServerConfig, TritonServer, default_models, serve

__all__ = [
    "ServedModel",
    "ServerConfig",
    "TritonServer",
    "TritonSetupError",
    "apply_triton_environment",
    "default_models",
    "serve",
    "triton_environment",
]
