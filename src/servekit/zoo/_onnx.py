"""Small helpers to write ONNX graphs deterministically from numpy weights."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# Opset 17 / IR 8 load in every ORT >= 1.14 and in TensorRT 8.6+ and 10.x.
OPSET = 17
IR_VERSION = 8


class GraphBuilder:
    """Accumulates nodes and initializers; names are derived from a running counter."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], output: str, **attrs: Any) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    def model(
        self,
        name: str,
        inputs: list[tuple[str, int, list[Any]]],
        outputs: list[tuple[str, int, list[Any]]],
        doc: str = "",
    ) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            name,
            [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
            [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
            initializer=self.initializers,
        )
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name="servekit",
            doc_string=doc,
        )
        model.ir_version = IR_VERSION
        onnx.checker.check_model(model)
        return model


def param_count(model: onnx.ModelProto) -> int:
    """Number of scalars in the model's initializers (its parameters once BN is folded)."""
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer)


FLOAT = TensorProto.FLOAT
