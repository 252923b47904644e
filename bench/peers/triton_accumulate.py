"""tritonserver's own sequence batcher, for comparison: the ``accumulate`` model (OUTPUT =
the running sum of a sequence's INPUTs, float32 [N,4]) as a plain Triton Python-backend
model that keeps each sequence's sum itself, keyed by CORRID (Triton's Python backend
has no implicit state), under PyTriton's bundled tritonserver.

``repository(folder, strategy)`` writes the model repository; ``serve(...)`` runs it with
servekit's launcher (its environment fixes), on tritonserver's own ports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Each sequence's running sum, kept per CORRID; START resets it, END frees it."""

    def initialize(self, args):
        self.kept = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            value = lambda name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
            x, start, end = value("INPUT"), value("START"), value("END")
            ready, corrid = value("READY"), value("CORRID")
            out = np.zeros_like(x)
            for i in range(len(x)):
                if not ready[i, 0]:
                    continue
                key = int(corrid[i, 0])
                before = 0.0 if start[i, 0] else self.kept.get(key, 0.0)
                out[i] = before + x[i]
                if end[i, 0]:
                    self.kept.pop(key, None)
                else:
                    self.kept[key] = out[i].copy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
'''

CONFIG = """
name: "accumulate"
backend: "python"
max_batch_size: {max_batch}
input [{{ name: "INPUT" data_type: TYPE_FP32 dims: [ 4 ] }}]
output [{{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 4 ] }}]
instance_group [{{ count: {instances} kind: KIND_CPU }}]
sequence_batching {{
  max_sequence_idle_microseconds: {idle_us}
  {strategy}
  control_input [
    {{ name: "START" control [{{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }}] }},
    {{ name: "END" control [{{ kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] }}] }},
    {{ name: "READY" control [{{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }}] }},
    {{ name: "CORRID" control [{{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }}] }}
  ]
}}
"""


def repository(
    folder: Path,
    strategy: str = "direct",
    *,
    max_batch: int = 8,
    instances: int = 1,
    candidates: int = 8,
    idle_us: int = 1_000_000,
) -> Path:
    """The model repository of tritonserver's ``accumulate`` under ``folder``."""
    model = folder / "accumulate"
    (model / "1").mkdir(parents=True, exist_ok=True)
    (model / "1" / "model.py").write_text(MODEL)
    chosen = (
        "direct { }"
        if strategy == "direct"
        else f"oldest {{ max_candidate_sequences: {candidates} }}"
    )
    (model / "config.pbtxt").write_text(
        CONFIG.format(max_batch=max_batch, instances=instances, idle_us=idle_us, strategy=chosen)
    )
    return folder


@contextlib.contextmanager
def serve(folder: Path, strategy: str = "direct", **kw: int) -> Iterator[object]:
    """tritonserver serving ``accumulate`` on free loopback ports, its own (no front);
    yields the ``TritonProcess`` (``options.server`` has its URLs)."""
    from servekit import ServerConfig
    from servekit.endpoints import free_port
    from servekit.triton.launcher import TritonOptions, TritonProcess

    server = ServerConfig(
        host="127.0.0.1", http_port=free_port(), grpc_port=free_port(),
        metrics_port=free_port(), front=False, exit_timeout_s=2,
    )  # fmt: skip
    options = TritonOptions(repository(folder, strategy, **kw), server)
    with TritonProcess(options) as triton:
        triton.wait_ready(["accumulate"])
        yield triton
