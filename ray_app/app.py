"""The servekit Ray Serve application: `serve run ray_app/config.yaml` from the repository root.

Thin: the deployments, their batching and the KServe v2 ingress live in servekit's core
(`servekit.ray.app`); this module only names the application Ray imports.
"""

from servekit.ray import build_app

app = build_app({})
