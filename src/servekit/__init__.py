"""servekit: one inference-serving core, served in-process, on Triton and on Ray Serve.

The public API is what ``__all__`` lists; everything else is an implementation detail.
"""

from .batching import Batcher, BatcherStats, BatchingPolicy, QueuePolicy, TimeoutAction
from .errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    Overloaded,
    RunnerError,
    ServekitError,
    Unauthenticated,
)
from .metrics import Metrics
from .pipeline import ImageClassifier, Pipeline, Prediction, image_classifier
from .runners import BaseRunner, FunctionRunner, OnnxRuntimeRunner, Runner
from .spec import DType, ModelSpec, TensorSpec, as_dtype
from .stages import Postprocess, Preprocess

__version__ = "0.1.0"

__all__ = [
    "BaseRunner",
    "Batcher",
    "BatcherStats",
    "BatchingPolicy",
    "DType",
    "DeadlineExceeded",
    "FunctionRunner",
    "ImageClassifier",
    "InvalidInput",
    "Metrics",
    "ModelNotFound",
    "ModelNotReady",
    "ModelSpec",
    "OnnxRuntimeRunner",
    "Overloaded",
    "Pipeline",
    "Postprocess",
    "Prediction",
    "Preprocess",
    "QueuePolicy",
    "Runner",
    "RunnerError",
    "ServekitError",
    "TensorSpec",
    "TimeoutAction",
    "Unauthenticated",
    "as_dtype",
    "image_classifier",
]
