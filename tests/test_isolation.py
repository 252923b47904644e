"""One fault, one consequence: a batch that raises is split until only the requests that
raise fail, however many send the same bad row; a broken model fails the whole batch in
four runs; a device out of memory
teaches the batch size that fits; the model's traceback is logged once, then counted."""

from __future__ import annotations

import asyncio
import logging
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from servekit import (
    Batcher,
    BatchingPolicy,
    FunctionRunner,
    InvalidInput,
    ModelSpec,
    RunnerError,
    TensorSpec,
)
from servekit.batching.execute import PROBE_AFTER, Fit, batch_steps, drive, run_requests
from servekit.batching.faults import FaultLog

SPEC = ModelSpec((TensorSpec("x", np.float32, [2]),), (TensorSpec("y", np.float32, [2]),), 96)
"""Max batch 96: the property's largest batch, 32 requests of 3 rows (a batcher forms no
larger one, and a batch past it would fail its output check, not the model)."""


class Picky:
    """Doubles its input; refuses rows whose first value is negative, naming their requests
    (column 1 holds the request's index), as a user's own validation would."""

    def __init__(self, fail_all: bool = False, most_rows: int = 0) -> None:
        self.calls: list[int] = []
        self.fail_all, self.most_rows = fail_all, most_rows

    def __call__(self, inputs):
        x = inputs["x"]
        self.calls.append(len(x))
        if self.fail_all:
            raise ValueError("the model is broken")
        if self.most_rows and len(x) > self.most_rows:
            raise RuntimeError(f"CUDA out of memory. Tried to allocate {len(x)} rows")
        bad = sorted({int(v) for v in x[x[:, 0] < 0, 1]})
        if bad:
            raise ValueError(f"x below 0 in requests {bad}")
        return {"y": x * 2}


def requests(rows: list[int], bad: set[int]) -> list[dict[str, np.ndarray]]:
    out = []
    for i, n in enumerate(rows):
        x = np.ones((n, 2), np.float32)
        x[:, 1] = i
        if i in bad:
            x[-1, 0] = -1
        out.append({"x": x})
    return out


def run(model: Picky, batch: list[dict[str, np.ndarray]], fit: Fit | None = None) -> list:
    steps = batch_steps(
        batch, [len(r["x"]) for r in batch], ["x"], SPEC.check_outputs, "picky", fit=fit
    )
    try:
        return drive(steps, model)
    except RunnerError as exc:  # a batch of one request raises its error
        return [exc]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_exactly_the_requests_holding_failing_rows_fail_within_the_call_bound(data):
    rows = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=32))
    bad = data.draw(st.sets(st.integers(0, len(rows) - 1), max_size=len(rows)))
    model = Picky()
    results = run(model, requests(rows, bad))
    for i, result in enumerate(results):
        if i in bad:
            assert isinstance(result, RunnerError)
            assert "ValueError: x below 0 in requests" in str(result) and f"{i}]" in str(result)
        else:
            assert not isinstance(result, BaseException), (i, result)
            np.testing.assert_array_equal(result["y"], requests(rows, set())[i]["x"] * 2)
    n = len(rows)
    bound = len(bad) * (2 * math.ceil(math.log2(n)) + 1) + 1 if bad else 1
    assert len(model.calls) <= bound, (len(model.calls), bound)


def test_a_model_that_fails_on_every_input_fails_a_batch_of_32_in_four_calls():
    """The batch, its halves, and one request alone (it never answered one: zeros)."""
    model = Picky(fail_all=True)
    results = run(model, requests([1] * 32, set()))
    assert model.calls == [32, 16, 16, 1]
    assert all(isinstance(r, RunnerError) and "the model is broken" in str(r) for r in results)


def test_a_model_broken_after_it_answered_fails_a_batch_in_four_calls_trying_a_good_request():
    fit = Fit()
    model = Picky()
    seen: list[np.ndarray] = []

    def recording(inputs):
        seen.append(inputs["x"].copy())
        return model(inputs)

    first = requests([2, 1, 3], set())
    assert all(not isinstance(r, BaseException) for r in run(recording, first, fit))
    model.fail_all, model.calls = True, []
    results = run(recording, requests([1] * 32, set()), fit)
    assert model.calls == [32, 16, 16, 1]
    np.testing.assert_array_equal(seen[-1], first[1]["x"])  # the fewest rows it answered
    assert all(isinstance(r, RunnerError) and "the model is broken" in str(r) for r in results)


class SameWords:
    """Doubles x; any row holding a negative value raises the same words whichever request
    it came from (a model that names no row), and so, with ``refuse_zeros``, does a row of
    zeros."""

    def __init__(self, refuse_zeros: bool) -> None:
        self.refuse_zeros = refuse_zeros
        self.calls: list[int] = []

    def __call__(self, inputs):
        x = inputs["x"]
        self.calls.append(len(x))
        if (x < 0).any() or (self.refuse_zeros and (x == 0).all(axis=1).any()):
            raise ValueError("negative feature at row 0 col 1")
        return {"y": x * 2}


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_number_of_clients_sending_the_same_bad_row_fail_alone(data):
    """Every bad request holds the same row and raises the same words, so two in different
    halves look like a broken model until one request the model answered before (or,
    when it answered none yet, one of zeros) is answered alone."""
    rows = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=32))
    bad = data.draw(st.sets(st.integers(0, len(rows) - 1), max_size=len(rows)))
    refuse_zeros = data.draw(st.booleans())
    model, fit = SameWords(refuse_zeros), Fit()
    if refuse_zeros:  # then only a request it answered tells: one from an earlier batch
        assert not isinstance(run(model, requests([2], set()), fit)[0], BaseException)
        model.calls.clear()
    batch = requests(rows, set())
    for i in bad:
        batch[i] = {"x": np.array([[-1.0, 7.0]] * rows[i], np.float32)}
    results = run(model, batch, fit)
    for i, result in enumerate(results):
        if i in bad:
            assert isinstance(result, RunnerError) and "negative feature" in str(result)
        else:
            assert not isinstance(result, BaseException), (i, result)
            np.testing.assert_array_equal(result["y"], batch[i]["x"] * 2)
    n = len(rows)
    bound = len(bad) * (2 * math.ceil(math.log2(n)) + 1) + 2 if bad else 1
    assert len(model.calls) <= bound, (len(model.calls), bound)


def test_the_same_bad_input_from_several_clients_fails_them_alone_not_their_batch():
    """Eight clients send the same undecodable image now and then: a batch may hold two of
    them, one in each half, and the decoder's words are the same for both. That is two
    requests' fault (InvalidInput), not a broken model: every other request is answered."""

    def decoder(inputs):
        if (inputs["x"][:, 0] < 0).any():
            raise InvalidInput("input 'x' row 0: cannot decode image (12 bytes)")
        return {"y": inputs["x"] * 2}

    batch = requests([1] * 8, {0, 5})
    results = run(decoder, batch)
    for i, result in enumerate(results):
        if i in {0, 5}:
            assert isinstance(result, InvalidInput) and "cannot decode" in str(result)
        else:
            np.testing.assert_array_equal(result["y"], batch[i]["x"] * 2)


def test_out_of_memory_splits_and_the_batch_that_fitted_is_remembered(caplog):
    fit = Fit()
    model = Picky(most_rows=8)
    with caplog.at_level(logging.WARNING, logger="servekit.batching.execute"):
        results = run(model, requests([1] * 32, set()), fit)
        assert all(not isinstance(r, BaseException) for r in results)
        assert fit.rows == 8
        model.calls.clear()
        again = run(model, requests([2] * 16, {3}), fit)  # 32 rows: four runs of 8 at once
    assert max(model.calls) == 8 and model.calls.count(8) == 4  # never 32 again
    assert [isinstance(r, RunnerError) for r in again] == [i == 3 for i in range(16)]
    said = [r for r in caplog.records if "ran out of memory" in r.getMessage()]
    assert len(said) == 1 and "at most 8 rows" in said[0].getMessage()


def test_the_fitted_rows_probe_back_up_once_memory_is_free_again(caplog):
    """GPU defect 7: one transient out-of-memory does not cap batches forever. After
    PROBE_AFTER batches in a row run in parts without running out, the limit doubles;
    once the device holds the whole batch again, batches run whole."""
    fit = Fit()
    model = Picky(most_rows=8)  # a transient peak: only 8 rows fit
    run(model, requests([1] * 32, set()), fit)
    assert fit.rows == 8
    model.most_rows = 0  # the peak is gone
    for _ in range(PROBE_AFTER - 1):
        run(model, requests([1] * 32, set()), fit)
    assert fit.rows == 8
    with caplog.at_level(logging.INFO, logger="servekit.batching.execute"):
        run(model, requests([1] * 32, set()), fit)
    assert fit.rows == 16 and any("up to 16 rows" in r.getMessage() for r in caplog.records)
    for _ in range(PROBE_AFTER):
        run(model, requests([1] * 32, set()), fit)
    assert fit.rows == 32
    model.calls.clear()
    run(model, requests([1] * 32, set()), fit)
    assert model.calls == [32]  # whole again


def test_when_the_fitted_size_itself_runs_out_the_limit_comes_down():
    """GPU defect 7: a limit that no longer fits is lowered, so each batch does not pay an
    out-of-memory error and two halves from then on."""
    fit = Fit()
    model = Picky(most_rows=8)
    run(model, requests([1] * 32, set()), fit)
    assert fit.rows == 8
    model.most_rows = 4  # another model took memory
    run(model, requests([1] * 32, set()), fit)
    assert fit.rows == 4
    model.calls.clear()
    results = run(model, requests([1] * 32, set()), fit)
    assert model.calls == [4] * 8 and all(not isinstance(r, BaseException) for r in results)


def test_an_out_of_memory_error_restarts_the_count_before_a_probe():
    fit = Fit(rows=8, streak=PROBE_AFTER - 1)
    model = Picky(most_rows=4)
    run(model, requests([1] * 16, set()), fit)
    assert fit.rows == 4 and fit.streak == 0


def test_the_batcher_answers_every_good_caller_and_counts_the_isolated_failures():
    model = Picky()
    batcher = Batcher(FunctionRunner(model, SPEC), BatchingPolicy(max_queue_delay_us=5000))

    async def main():
        batch = requests([1] * 16, {5, 11})
        return await asyncio.gather(*(batcher.infer(r) for r in batch), return_exceptions=True)

    results = asyncio.run(main())
    batcher.close()
    assert [isinstance(r, RunnerError) for r in results] == [i in (5, 11) for i in range(16)]
    s = batcher.stats
    assert s.request_failure == 2 and s.request_isolated == 2 and s.request_success == 14


def test_run_requests_isolates_the_same_way():
    """The path of PyTriton, the Triton backend and Ray's batches."""
    runner = FunctionRunner(Picky(), SPEC)
    results = run_requests(runner, requests([1, 2, 1, 3], {2}))
    assert [isinstance(r, RunnerError) for r in results] == [False, False, True, False]


def test_a_traceback_is_logged_once_per_error_and_place_then_counted(caplog):
    now = [0.0]
    faults = FaultLog(window_s=60, clock=lambda: now[0])

    def fail(words: str) -> Exception:
        try:
            raise ValueError(words)
        except ValueError as exc:
            return exc

    with caplog.at_level(logging.ERROR, logger="servekit.model"):
        for _ in range(5):
            faults("picky", fail("x below 0"))
        faults("picky", fail("another error"))
        now[0] = 61.0
        faults("picky", fail("x below 0"))
    lines = [r for r in caplog.records if r.name == "servekit.model"]
    assert len(lines) == 3
    assert lines[0].exc_info is not None and "ValueError: x below 0" in lines[0].getMessage()
    assert "test_isolation.py" in lines[0].getMessage()  # the place in the user's code
    assert "another error" in lines[1].getMessage()
    assert "5 more in the last 60 s" in lines[2].getMessage() and lines[2].exc_info is None


def test_the_rows_that_fitted_are_in_the_models_metrics():
    from servekit import Metrics

    batcher = Batcher(
        FunctionRunner(Picky(most_rows=8), SPEC), BatchingPolicy(max_queue_delay_us=5000)
    )
    metrics = Metrics()
    metrics.watch(batcher, "m")
    assert "servekit_fitted_batch_rows" not in metrics.render()

    async def main():
        return await asyncio.gather(*(batcher.infer(r) for r in requests([1] * 16, set())))

    assert len(asyncio.run(main())) == 16
    batcher.close()
    assert batcher.fitted_rows == 8
    assert 'servekit_fitted_batch_rows{model="m",version="1"} 8' in metrics.render()
