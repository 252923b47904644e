"""The ``triton`` runtime: tritonserver (bundled with PyTriton) with servekit's Triton backend
on a model repository rendered from a ``ServeConfig``; the environment its stub needs."""

from .env import TritonSetupError, apply_triton_environment, triton_environment

__all__ = ["TritonSetupError", "apply_triton_environment", "triton_environment"]
