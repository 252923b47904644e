"""The `servekit` Python-based Triton backend (`backend: "servekit"` in config.pbtxt).

Triton runs this file, inside the Python backend stub, for every model that names the
backend; all logic lives in servekit's core (`servekit.triton.backend`), which the stub
imports from the virtualenv first on PATH. `servekit triton` installs it as
`backends/servekit/model.py` next to the Python backend's files.
"""

from servekit.triton.backend import TritonPythonModel

__all__ = ["TritonPythonModel"]
