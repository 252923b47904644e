"""Rendering specs and policies to PyTriton, the client's plumbing, the launcher's checks."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="needs the triton extra")

from servekit import (
    BatchingPolicy,
    DeadlineExceeded,
    FunctionRunner,
    InvalidInput,
    ModelNotFound,
    ModelSpec,
    Overloaded,
    QueuePolicy,
    RunnerError,
    TensorSpec,
    TimeoutAction,
)
from servekit.errors import from_grpc_code, from_http_status
from servekit.pytriton.binding import (
    ERROR_OUTPUT,
    infer_callable,
    pytriton_tensors,
)
from servekit.triton import TritonSetupError, triton_environment

SPEC = ModelSpec(
    (TensorSpec("image", "BYTES", [1]), TensorSpec("x", np.float32, [3, -1])),
    (TensorSpec("y", np.int64, [2]),),
    16,
)


def test_tensors_render_with_numpy_dtypes_and_triton_dims():
    image, x = pytriton_tensors(SPEC.inputs)
    assert (image.name, image.dtype, image.shape) == ("image", np.bytes_, (1,))
    assert (x.name, x.dtype, x.shape) == ("x", np.float32, (3, -1))


def test_policy_renders_every_knob_to_pytritons_dynamic_batcher():
    policy = BatchingPolicy(
        max_batch_size=8,
        preferred_batch_sizes=(2, 4),
        max_queue_delay_us=700,
        priority_levels=2,
        default_priority_level=2,
        default_queue_policy=QueuePolicy(
            max_queue_size=10, default_timeout_us=99, allow_timeout_override=True
        ),
        priority_queue_policies={1: QueuePolicy(timeout_action=TimeoutAction.DELAY)},
    )
    config = policy.to_pytriton(SPEC.max_batch_size)
    assert config.batching and config.max_batch_size == 8
    b = config.batcher
    assert b.max_queue_delay_microseconds == 700 and b.preferred_batch_size == [2, 4]
    assert (b.priority_levels, b.default_priority_level) == (2, 2)
    assert BatchingPolicy(preserve_ordering=True).to_pytriton(16).batcher.preserve_ordering
    q = b.default_queue_policy
    assert (q.max_queue_size, q.default_timeout_microseconds, q.allow_timeout_override) == (
        10,
        99,
        True,
    )
    assert q.timeout_action.value == "REJECT"
    assert b.priority_queue_policy[1].timeout_action.value == "DELAY"


def test_default_policy_takes_the_models_batch_limit_and_unbatched_models_do_not_batch():
    config = BatchingPolicy().to_pytriton(16)
    assert config.max_batch_size == 16 and config.batcher.preferred_batch_size is None
    assert not BatchingPolicy().to_pytriton(0).batching
    with pytest.raises(ValueError, match="32 exceeds the model's 16"):
        BatchingPolicy(max_batch_size=32).to_pytriton(16)


class FakeRequest:
    def __init__(self, **data):
        self.data = data


def test_the_infer_callable_answers_each_request_and_codes_its_errors():
    spec = ModelSpec((TensorSpec("x", np.float32, [2]),), (TensorSpec("y", np.float32, [2]),), 8)
    fn = infer_callable(FunctionRunner(lambda d: {"y": d["x"] + 1}, spec), "plus1")
    good = FakeRequest(x=np.zeros((2, 2), np.float32))
    bad = FakeRequest(x=np.zeros((1, 2), np.float64))
    out = fn([good, bad, good])
    np.testing.assert_array_equal(out[0]["y"], np.ones((2, 2)))
    code, message, flags = out[1][ERROR_OUTPUT]
    assert code == b"INVALID_ARG" and flags == b"isolated"  # the others were answered
    assert message.decode() == "plus1: input 'x': expected dtype FP32, got FP64"
    np.testing.assert_array_equal(out[2]["y"], np.ones((2, 2)))


@pytest.mark.parametrize(
    ("status", "message", "cls"),
    [
        (400, "bad", InvalidInput),
        (404, "no such model", ModelNotFound),
        (503, "Exceeds maximum queue size", Overloaded),
        (504, "late", DeadlineExceeded),
        (500, "boom", RunnerError),
    ],
)
def test_remote_http_statuses_map_back_to_servekit_errors(status, message, cls):
    assert type(from_http_status(status, message)) is cls


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        ("StatusCode.INVALID_ARGUMENT", InvalidInput),
        ("NOT_FOUND", ModelNotFound),
        ("INTERNAL", RunnerError),
    ],
)
def test_remote_grpc_codes_map_back_to_servekit_errors(code, cls):
    assert type(from_grpc_code(code, "m")) is cls


def test_client_urls_must_name_a_scheme_host_and_port():
    from servekit.client import _parse

    assert _parse("grpc://localhost:8001") == ("grpc", "localhost:8001")
    assert _parse("127.0.0.1:8000") == ("http", "127.0.0.1:8000")
    with pytest.raises(ValueError, match="http:// or grpc://"):
        _parse("ftp://x:1")
    with pytest.raises(ValueError, match="host and a port"):
        _parse("http://localhost")


def test_the_environment_puts_libpython_and_the_venv_first():
    import sys
    import sysconfig
    from pathlib import Path

    found = triton_environment({"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/x"})
    ld = found.env["LD_LIBRARY_PATH"].split(":")
    assert ld[0] == sysconfig.get_config_var("LIBDIR")
    assert ld[1].endswith("nvidia_pytriton.libs") and ld[-1] == "/opt/x"
    assert found.env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    assert found.stub.exists() and found.libpython.exists()


def test_a_python_without_a_shared_libpython_is_refused_clearly(monkeypatch, tmp_path):
    import sysconfig

    real = sysconfig.get_config_var
    monkeypatch.setattr(
        sysconfig, "get_config_var", lambda k: str(tmp_path) if k == "LIBDIR" else real(k)
    )
    with pytest.raises(TritonSetupError, match="links libpython3.*--enable-shared"):
        triton_environment()
