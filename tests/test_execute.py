"""run_requests: a server's grouped requests, each answered or failed on its own."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from servekit import FunctionRunner, InvalidInput, ModelSpec, RunnerError, TensorSpec
from servekit.batching.execute import run_requests

SPEC = ModelSpec((TensorSpec("x", np.float64, [-1]),), (TensorSpec("y", np.float64, [-1]),), 16)


def picky(d):
    """Triples x; fails for a 13 (the request's fault) or a 66 (the engine's), naming the
    requests (column 1 holds each one's id), as a model's own words would; for a 77 in
    words that name none, the same for every request that holds one."""
    x = d["x"]
    if (x == 77).any():
        raise ValueError("x holds a 77")
    for value, error in ((13, InvalidInput), (66, ZeroDivisionError)):
        rows = np.argwhere(x == value)[:, 0]
        if len(rows):
            ids = sorted({int(x[r, 1]) for r in rows})
            raise error(f"{'unlucky' if value == 13 else 'engine blew up'} in requests {ids}")
    return {"y": x * 3}


@given(
    st.lists(
        st.tuples(st.integers(1, 3), st.sampled_from([2, 4]), st.sampled_from([0, 13, 66, 77, -1])),
        max_size=12,
    )
)
def test_each_request_gets_its_own_rows_or_its_own_error(reqs):
    runner = FunctionRunner(picky, SPEC)
    inputs = []
    for i, (rows, width, special) in enumerate(reqs):
        x = np.full((rows, width), float(i + 100))
        if special == -1:
            inputs.append({"x": x.astype(np.float32)})  # wrong dtype: fails validation alone
            continue
        if special == 77:  # several clients sending the very same bad row
            x = np.full((1, 2), 77.0)
        elif special:
            x[0, 0] = special
        inputs.append({"x": x})
    results = run_requests(runner, inputs)
    assert len(results) == len(inputs)
    # Whatever fails (bad input, or the engine on one request's values, in words of its
    # own or the same words as other requests) fails its own request alone: its batch is
    # halved until only it is left.
    for (_, _, special), x, result in zip(reqs, inputs, results, strict=True):
        if special == -1:
            assert isinstance(result, InvalidInput) and "FP64" in str(result)
        elif special == 13:
            assert isinstance(result, InvalidInput) and "unlucky" in str(result)
        elif special == 66:
            assert isinstance(result, RunnerError) and "engine blew up" in str(result)
        elif special == 77:
            assert isinstance(result, RunnerError) and "ValueError: x holds a 77" in str(result)
        else:
            np.testing.assert_array_equal(result["y"], x["x"] * 3)


def test_an_invalid_request_is_found_by_halving_its_batch():
    calls = []

    def counting(d):
        calls.append(len(d["x"]))
        return picky(d)

    runner = FunctionRunner(counting, SPEC)
    good, bad = {"x": np.ones((1, 2))}, {"x": np.full((1, 2), 13.0)}
    results = run_requests(runner, [good, bad, good])
    assert calls == [3, 1, 2, 1, 1]  # all, the left half, the right, its halves
    assert isinstance(results[1], InvalidInput)
    assert not isinstance(results[0], Exception) and not isinstance(results[2], Exception)


def test_requests_are_never_run_more_than_max_batch_size_rows_at_a_time():
    seen = []

    def record(d):
        seen.append(len(d["x"]))
        return {"y": d["x"]}

    results = run_requests(FunctionRunner(record, SPEC), [{"x": np.ones((5, 2))} for _ in range(7)])
    assert all(not isinstance(r, Exception) for r in results)
    assert seen == [15, 15, 5]


def test_a_sticky_cuda_error_is_never_bisected_and_the_device_serves_no_more():
    """An illegal address fails every later call in the process: halving cannot help, so
    the batch runs once, its requests get ``DeviceLost`` (a 503 naming CUDA's words), and
    the next batch is refused without a call."""
    from servekit.batching.execute import device_lost
    from servekit.errors import DeviceLost, http_status

    calls = []

    def model(inputs):
        calls.append(len(inputs["x"]))
        if (inputs["x"] < 0).any():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {"y": inputs["x"] * 2}

    runner = FunctionRunner(model, SPEC)
    requests = [{"x": np.full((1, 2), -1.0 if i == 3 else float(i))} for i in range(8)]
    results = run_requests(runner, requests, name="m")
    assert calls == [8]  # once: never split
    assert all(isinstance(r, DeviceLost) for r in results), results
    said = "model m: device lost: CUDA error: an illegal memory access was encountered"
    assert {str(r) for r in results} == {said} and http_status(results[0]) == 503
    assert device_lost(runner) == said.removeprefix("model m: ")
    again = run_requests(runner, [{"x": np.ones((1, 2))}], name="m")
    assert calls == [8] and isinstance(again[0], DeviceLost)  # no call on a lost device
