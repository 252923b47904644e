"""Tiny reference models for fast tests: same graph features as ResNet-50, milliseconds to run."""

from __future__ import annotations

import numpy as np
import onnx

from ._onnx import FLOAT, GraphBuilder

__all__ = [
    "SIM_T4",
    "build_accumulate",
    "build_add_sub",
    "build_sim_t4",
    "build_simulated",
    "build_tiny_cnn",
]


def build_tiny_cnn(seed: int = 0, num_classes: int = 10) -> onnx.ModelProto:
    """``input`` [N,3,32,32] -> conv3x3(8) -> ReLU -> global pool -> dense -> ``logits`` [N,10]."""
    rng = np.random.default_rng(seed)
    g = GraphBuilder()
    g.const("conv.weight", (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32))
    g.const("conv.bias", (rng.standard_normal(8) * 0.1).astype(np.float32))
    g.const("fc.weight", rng.standard_normal((num_classes, 8)).astype(np.float32))
    g.const("fc.bias", np.zeros(num_classes, np.float32))
    t = g.node(
        "Conv", ["input", "conv.weight", "conv.bias"], "conv", kernel_shape=[3, 3], pads=[1] * 4
    )
    t = g.node("Relu", [t], "relu")
    t = g.node("GlobalAveragePool", [t], "pool")
    t = g.node("Flatten", [t], "flatten", axis=1)
    g.node("Gemm", [t, "fc.weight", "fc.bias"], "logits", transB=1)
    return g.model(
        "tiny_cnn",
        [("input", FLOAT, ["batch", 3, 32, 32])],
        [("logits", FLOAT, ["batch", num_classes])],
    )


def build_add_sub(
    width: int = 16, *, offset: float = 0.0, heavy: int = 0, weights_mb: float = 0.0
) -> onnx.ModelProto:
    """Triton's classic example: ``OUTPUT0 = INPUT0 + INPUT1``, ``OUTPUT1 = INPUT0 - INPUT1``.

    Other versions with the same signature, for rollout tests: ``offset`` is added to
    ``OUTPUT0`` (other answers); ``heavy`` passes ``INPUT0`` through that many 1024x1024
    identity MatMuls first (the same answers, exactly, and much slower). ``weights_mb``
    carries that many MB of weights that every request reads (``INPUT0`` through a random
    matrix, then a zero one, added to ``OUTPUT0``: the same answers), so the model takes
    real memory when loaded (the model store's tests)."""
    g = GraphBuilder()
    first = "INPUT0"
    if weights_mb:
        k = max(1, int(weights_mb * 1024 * 1024 / (8 * width)))
        rng = np.random.default_rng(0)
        g.const("spread", rng.random((width, k), dtype=np.float32))
        g.const("gather", np.zeros((k, width), np.float32))
        spread = g.node("MatMul", ["INPUT0", "spread"], "spread_out")
        zeros = g.node("MatMul", [spread, "gather"], "zeros")
        first = g.node("Add", ["INPUT0", zeros], "weighed")
    if heavy:
        wide = np.zeros((width, 1024), np.float32)
        wide[:, :width] = np.eye(width, dtype=np.float32)
        g.const("widen", wide)
        g.const("eye", np.eye(1024, dtype=np.float32))
        g.const("narrow", wide.T.copy())
        first = g.node("MatMul", ["INPUT0", "widen"], "wide")
        for i in range(heavy):
            first = g.node("MatMul", [first, "eye"], f"heavy{i}")
        first = g.node("MatMul", [first, "narrow"], "narrowed")
    if offset:
        g.const("offset", np.full((1, width), offset, np.float32))
        total = g.node("Add", [first, "INPUT1"], "sum")
        g.node("Add", [total, "offset"], "OUTPUT0")
    else:
        g.node("Add", [first, "INPUT1"], "OUTPUT0")
    g.node("Sub", ["INPUT0", "INPUT1"], "OUTPUT1")
    io = ["batch", width]
    return g.model(
        "add_sub",
        [("INPUT0", FLOAT, io), ("INPUT1", FLOAT, io)],
        [("OUTPUT0", FLOAT, io), ("OUTPUT1", FLOAT, io)],
    )


def build_accumulate(width: int = 4) -> onnx.ModelProto:
    """A stateful model for the sequence batcher: ``OUTPUT = INPUT + STATE_IN``, and
    ``STATE_OUT`` the same, which servekit feeds back as the next request's ``STATE_IN``
    (implicit state): each sequence answers the running sum of its inputs."""
    g = GraphBuilder()
    total = g.node("Add", ["INPUT", "STATE_IN"], "total")
    g.node("Identity", [total], "OUTPUT")
    g.node("Identity", [total], "STATE_OUT")
    io = ["batch", width]
    return g.model(
        "accumulate",
        [("INPUT", FLOAT, io), ("STATE_IN", FLOAT, io)],
        [("OUTPUT", FLOAT, io), ("STATE_OUT", FLOAT, io)],
    )


SIM_T4 = (1000.0, 200.0)
"""ResNet-50 INT8 on a T4, as a line: about 1 ms a batch plus 0.2 ms an image, so 833
images/s at batch 1 and 4,300-4,800 at batch 32-128 (the "roughly 4-6k images/s" Triton
reaches there at INT8); an approximation for simulation, not a measurement."""


def build_sim_t4(scale: float = 8.0, seed: int = 0) -> onnx.ModelProto:
    """A simulated T4 running ResNet-50 INT8, ``scale`` times slower so two CPU cores can
    keep it busy: ``input`` [N,64,64,3] (NHWC, so it is served as a tensor model and the
    load measures the serving path, not JPEG decoding) -> ``logits`` [N,1000]; each batch
    takes the device's time (``SimulatedDevice``), the graph itself never runs."""
    from ..runners.simulated import DeviceProfile

    rng = np.random.default_rng(seed)
    g = GraphBuilder()
    g.const("fc.weight", rng.standard_normal((1000, 64)).astype(np.float32))
    g.const("fc.bias", np.zeros(1000, np.float32))
    t = g.node("GlobalAveragePool", ["input"], "pool")
    t = g.node("Flatten", [t], "flatten", axis=1)
    g.node("Gemm", [t, "fc.weight", "fc.bias"], "logits", transB=1)
    model = g.model(
        "sim_t4", [("input", FLOAT, ["batch", 64, 64, 3])], [("logits", FLOAT, ["batch", 1000])]
    )
    fixed, per_row = SIM_T4
    profile = DeviceProfile(f"t4-int8-x{scale:g}", fixed * scale, per_row * scale)
    onnx.helper.set_model_props(model, profile.to_metadata())
    return model


def build_simulated(
    name: str, fixed_us: float, per_row_us: float, width: int = 16, max_rows: int = 0
) -> onnx.ModelProto:
    """A simulated device of any profile: ``INPUT0`` [N,width] -> ``OUTPUT0`` [N,width],
    each batch ``fixed_us + per_row_us * rows`` on device ``name`` (``SimulatedDevice``),
    refusing to load with a max batch size over ``max_rows`` (0: none): a batch function
    of known cost, for tests of batching and tuning."""
    from ..runners.simulated import DeviceProfile

    g = GraphBuilder()
    g.node("Identity", ["INPUT0"], "OUTPUT0")
    model = g.model(
        name, [("INPUT0", FLOAT, ["batch", width])], [("OUTPUT0", FLOAT, ["batch", width])]
    )
    onnx.helper.set_model_props(
        model, DeviceProfile(name, fixed_us, per_row_us, max_rows).to_metadata()
    )
    return model
