"""servekit: one inference-serving core, served natively, on PyTriton, on Triton and on Ray Serve.

The public API is what ``__all__`` lists; everything else is an implementation detail.
"""

from ._version import __version__ as __version__
from .batching import (
    Batcher,
    BatcherStats,
    BatchingPolicy,
    Controls,
    QueuePolicy,
    SequenceBatcher,
    SequenceFlags,
    SequencePolicy,
    StateSpec,
    TimeoutAction,
)
from .client import AsyncClient, Client
from .config import ModelConfig, RayOptions, ServeConfig, ServerConfig
from .custom import Model, infer_function
from .errors import (
    DeadlineExceeded,
    FetchFailed,
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    Overloaded,
    RunnerError,
    ServekitError,
    ServerUnreachable,
    Shed,
    Unauthenticated,
)
from .metrics import Metrics
from .pipeline import ImageClassifier, Pipeline, Prediction, image_classifier
from .runners import BaseRunner, FunctionRunner, OnnxRuntimeRunner, Runner
from .serving import create_runtime, serve
from .spec import DType, ModelSpec, TensorSpec, as_dtype
from .stages import Postprocess, Preprocess
from .storage import StorageConfig

__all__ = [
    "AsyncClient",
    "BaseRunner",
    "Batcher",
    "BatcherStats",
    "BatchingPolicy",
    "Client",
    "Controls",
    "DType",
    "DeadlineExceeded",
    "FetchFailed",
    "FunctionRunner",
    "ImageClassifier",
    "InvalidInput",
    "Metrics",
    "Model",
    "ModelConfig",
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
    "RayOptions",
    "Runner",
    "RunnerError",
    "SequenceBatcher",
    "SequenceFlags",
    "SequencePolicy",
    "ServeConfig",
    "ServekitError",
    "ServerConfig",
    "ServerUnreachable",
    "Shed",
    "StateSpec",
    "StorageConfig",
    "TensorSpec",
    "TimeoutAction",
    "Unauthenticated",
    "as_dtype",
    "create_runtime",
    "image_classifier",
    "infer_function",
    "serve",
]
