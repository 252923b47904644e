"""run_requests: a server's grouped requests, each answered or failed on its own."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from servekit import FunctionRunner, InvalidInput, ModelSpec, RunnerError, TensorSpec
from servekit.batching.execute import run_requests

SPEC = ModelSpec((TensorSpec("x", np.float64, [-1]),), (TensorSpec("y", np.float64, [-1]),), 16)


def picky(d):
    x = d["x"]
    if (x == 13).any():
        raise InvalidInput(f"row {int(np.argwhere(x == 13)[0][0])}: unlucky")
    if (x == 66).any():
        raise ZeroDivisionError("engine blew up")
    return {"y": x * 3}


@given(
    st.lists(
        st.tuples(st.integers(1, 3), st.sampled_from([2, 4]), st.sampled_from([0, 13, 66, -1])),
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
        if special:
            x[0, 0] = special
        inputs.append({"x": x})
    results = run_requests(runner, inputs)
    assert len(results) == len(inputs)
    # An engine failure (not bad input) fails every valid request batched with it (same
    # width), unless a bad input in that batch made it re-run one request at a time.
    # Batches are cut at max_batch_size (16) rows, in arrival order.
    batches: list[tuple[int, list[int], int]] = []  # (width, specials, rows)
    open_batch: dict[int, tuple[int, list[int], int]] = {}
    batch_of: list[int] = []
    for rows, w, special in reqs:
        if special == -1:
            batch_of.append(-1)
            continue
        b = open_batch.get(w)
        if b is None or batches[b[0]][2] + rows > 16:
            batches.append((w, [], 0))
            open_batch[w] = (len(batches) - 1, [], 0)
        idx = open_batch[w][0]
        bw, specials, total = batches[idx]
        batches[idx] = (bw, [*specials, special], total + rows)
        batch_of.append(idx)
    crashed = {
        i for i, (_, specials, _) in enumerate(batches) if 66 in specials and 13 not in specials
    }
    for (_, _, special), b, x, result in zip(reqs, batch_of, inputs, results, strict=True):
        if special == -1:
            assert isinstance(result, InvalidInput) and "FP64" in str(result)
        elif special == 13:
            assert isinstance(result, InvalidInput) and "unlucky" in str(result)
        elif special == 66 or b in crashed:
            assert isinstance(result, RunnerError) and "engine blew up" in str(result)
        else:
            np.testing.assert_array_equal(result["y"], x["x"] * 3)


def test_an_invalid_request_is_found_by_rerunning_its_batch_one_by_one():
    calls = []

    def counting(d):
        calls.append(len(d["x"]))
        return picky(d)

    runner = FunctionRunner(counting, SPEC)
    good, bad = {"x": np.ones((1, 2))}, {"x": np.full((1, 2), 13.0)}
    results = run_requests(runner, [good, bad, good])
    assert calls == [3, 1, 1, 1]
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
