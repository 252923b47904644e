"""The ``ray`` runtime: servekit on Ray Serve (``app``) and offline batch inference on Ray Data (``batch``)."""

from .app import build_app, ray_config

__all__ = ["build_app", "ray_config"]
