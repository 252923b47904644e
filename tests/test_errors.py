import pytest

from servekit import errors


@pytest.mark.parametrize(
    ("exc", "status", "code", "triton"),
    [
        (errors.InvalidInput("x"), 400, "INVALID_ARGUMENT", "INVALID_ARG"),
        (errors.ModelNotFound("x"), 404, "NOT_FOUND", "NOT_FOUND"),
        (errors.ModelNotReady("x"), 503, "UNAVAILABLE", "UNAVAILABLE"),
        (errors.ModelBroken("x"), 503, "UNAVAILABLE", "UNAVAILABLE"),
        (errors.SetupFailed("x"), 503, "UNAVAILABLE", "UNAVAILABLE"),
        (errors.DeviceLost("x"), 503, "UNAVAILABLE", "UNAVAILABLE"),
        (errors.Overloaded("x"), 503, "UNAVAILABLE", "UNAVAILABLE"),
        (errors.DeadlineExceeded("x"), 504, "DEADLINE_EXCEEDED", "UNAVAILABLE"),
        (errors.RunnerError("x"), 500, "INTERNAL", "INTERNAL"),
        (RuntimeError("x"), 500, "INTERNAL", "INTERNAL"),
    ],
)
def test_each_error_maps_to_one_http_status_grpc_code_and_triton_code(exc, status, code, triton):
    assert errors.http_status(exc) == status
    assert errors.grpc_code(exc) == code
    assert errors.triton_code(exc) == triton


def test_subclasses_inherit_their_parents_mapping():
    class BadImage(errors.InvalidInput):
        pass

    assert errors.http_status(BadImage("x")) == 400


@pytest.mark.parametrize(("hint_s", "header"), [(0.5, "1"), (2.6, "3"), (30.0, "30")])
def test_an_overloaded_model_s_retry_hint_reaches_the_client_as_whole_seconds(hint_s, header):
    # Through the app, as a client meets it: a 503 with Retry-After in whole seconds, at
    # least 1 (RFC 9110 takes no fractions), and the model's own message.
    import asyncio
    import json

    import numpy as np

    from servekit import FunctionRunner, ModelSpec, TensorSpec
    from servekit.http import KServeApp
    from servekit.http.messages import HttpRequest

    def full(inputs):
        raise errors.Overloaded("the queue is full", retry_after_s=hint_s)

    spec = ModelSpec((TensorSpec("x", np.float32, [1]),), (TensorSpec("y", np.float32, [1]),))
    app = KServeApp({"m": FunctionRunner(full, spec)})
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]})
    request = HttpRequest("POST", "/v2/models/m/infer", {}, body.encode())
    status, answer, headers = asyncio.run(app.handle(request))
    assert (status, headers["retry-after"]) == (503, header)
    assert json.loads(answer) == {"error": "the queue is full"}
