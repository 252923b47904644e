import pytest

from servekit import errors


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (errors.InvalidInput("x"), 400, "INVALID_ARGUMENT"),
        (errors.ModelNotFound("x"), 404, "NOT_FOUND"),
        (errors.ModelNotReady("x"), 503, "UNAVAILABLE"),
        (errors.Overloaded("x"), 503, "UNAVAILABLE"),
        (errors.DeadlineExceeded("x"), 504, "DEADLINE_EXCEEDED"),
        (errors.RunnerError("x"), 500, "INTERNAL"),
        (RuntimeError("x"), 500, "INTERNAL"),
    ],
)
def test_each_error_maps_to_one_http_status_and_grpc_code(exc, status, code):
    assert errors.http_status(exc) == status
    assert errors.grpc_code(exc) == code


def test_subclasses_inherit_their_parents_mapping():
    class BadImage(errors.InvalidInput):
        pass

    assert errors.http_status(BadImage("x")) == 400


def test_overloaded_carries_a_retry_hint():
    assert errors.Overloaded("full", retry_after_s=0.5).retry_after_s == 0.5
