"""Engine runners: the Runner contract and its implementations (engines import lazily)."""

from .base import BaseRunner, FunctionRunner, Runner
from .onnx import OnnxRuntimeRunner

__all__ = ["BaseRunner", "FunctionRunner", "OnnxRuntimeRunner", "Runner"]
