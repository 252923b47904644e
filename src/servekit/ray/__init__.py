"""servekit on Ray Serve (``build_app``); needs the ``ray`` extra."""

from .app import build_app, policy_to_dict

__all__ = ["build_app", "policy_to_dict"]
