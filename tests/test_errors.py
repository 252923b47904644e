import pytest

from servekit import errors


@pytest.mark.parametrize(
    ("exc", "status", "code", "triton"),
    [
        (errors.InvalidInput("x"), 400, "INVALID_ARGUMENT", "INVALID_ARG"),
        (errors.ModelNotFound("x"), 404, "NOT_FOUND", "NOT_FOUND"),
        (errors.ModelNotReady("x"), 503, "UNAVAILABLE", "UNAVAILABLE"),
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


def test_overloaded_carries_a_retry_hint():
    assert errors.Overloaded("full", retry_after_s=0.5).retry_after_s == 0.5
