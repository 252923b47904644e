"""The Batcher end to end on a real event loop and real worker threads.

Timing-dependent behaviour is driven by gates (a worker held busy while requests
queue) and, for timeouts, an injected fake clock; nothing here sleeps on the wall clock.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import cancelled_first
from servekit import (
    Batcher,
    BatchingPolicy,
    DeadlineExceeded,
    FunctionRunner,
    InvalidInput,
    ModelNotReady,
    ModelSpec,
    Overloaded,
    QueuePolicy,
    RunnerError,
    TensorSpec,
    TimeoutAction,
)

SPEC = ModelSpec((TensorSpec("x", np.float64, [-1]),), (TensorSpec("y", np.float64, [-1]),), 64)
POISON = -1.0


def row_fn(x: np.ndarray) -> np.ndarray:
    """Row-wise, so a row's output never depends on its batch-mates."""
    return x * 2 + x.sum(axis=1, keepdims=True)


class Model:
    """A runner that records every batch (request ids in column 0) and can be held busy."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, inputs):
        x = inputs["x"]
        with self.lock:
            self.batches.append([int(v) for v in x[:, 0]])
        self.started.set()
        self.gate.wait(10)
        poisoned = sorted({int(v) for v in x[(x == POISON).any(axis=1), 0]})
        if poisoned:  # the words name the culprits: two halves never fail alike
            raise ValueError(f"poisoned batch: requests {poisoned}")
        return {"y": row_fn(x)}

    def hold(self) -> None:
        self.gate.clear()
        self.started.clear()

    async def wait_started(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.started.wait, 10)


def request(rid: int, rows: int = 1, width: int = 3) -> dict[str, np.ndarray]:
    x = np.full((rows, width), float(rid))
    x[:, 1:] += np.arange(rows)[:, None] / 10
    return {"x": x}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------- properties

case = st.fixed_dictionaries(
    {
        "max_batch": st.integers(1, 16),
        "preferred": st.lists(st.integers(1, 16), max_size=2),
        "delay_us": st.sampled_from([0, 200]),
        "instances": st.integers(1, 3),
        "ordering": st.booleans(),
        "executor": st.sampled_from(["threads", "loop", "async"]),
        "close_early": st.booleans(),
        "ahead": st.integers(0, 2),
        "requests": st.lists(
            st.tuples(st.integers(1, 4), st.sampled_from([3, 5]), st.booleans(), st.booleans()),
            min_size=1,
            max_size=40,
        ),
        "yields": st.lists(st.integers(0, 3), min_size=40, max_size=40),
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case)
def test_every_caller_gets_exactly_its_own_rows_or_its_batchs_error(c):
    """Random policies, sizes, shapes, arrivals, failures and cancellations, with batches
    sent at once or held back while one runs (``ahead``)."""
    preferred = tuple(sorted({p for p in c["preferred"] if p <= c["max_batch"]}))
    policy = BatchingPolicy(
        max_batch_size=c["max_batch"],
        preferred_batch_sizes=preferred,
        max_queue_delay_us=c["delay_us"],
        preserve_ordering=c["ordering"],
    )
    model = Model()
    limit = policy.batch_limit(64)

    async def on_loop(inputs):  # a coroutine batch function, awaited on the loop
        await asyncio.sleep(0)
        return model(inputs)

    fn = on_loop if c["executor"] == "async" else model
    executor = "loop" if c["executor"] == "async" else c["executor"]

    async def main():
        batcher = Batcher(
            fn, policy, spec=SPEC, instance_count=c["instances"], executor=executor,
            ahead=c["ahead"],
        )  # fmt: skip
        tasks, inputs, cancelled = [], [], set()
        for i, (rows, width, poison, cancel) in enumerate(c["requests"]):
            rows = min(rows, c["max_batch"])
            x = request(i, rows, width)
            if poison:
                x["x"][0, -1] = POISON
            inputs.append(x)
            tasks.append(asyncio.ensure_future(batcher.infer(x)))
            tasks[-1].add_done_callback(lambda _, i=i: completed.append(i))
            if cancel:
                tasks[-1].cancel()
                cancelled.add(i)
            for _ in range(c["yields"][i]):
                await asyncio.sleep(0)
        if c["close_early"]:  # close while requests still wait: all must still be answered
            await asyncio.sleep(0)
            await batcher.aclose()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await batcher.aclose()
        return inputs, results, cancelled, batcher

    completed: list[int] = []
    inputs, results, cancelled, batcher = asyncio.run(main())
    poisoned = {i for i, x in enumerate(inputs) if (x["x"] == POISON).any()}
    executed: dict[int, int] = {}
    beside_poison: set[int] = set()
    for b in model.batches:
        ids = sorted(set(b))
        for rid in ids:  # a request runs again only to find who in a failed run raised
            assert rid not in executed or rid in beside_poison, f"request {rid} ran twice"
            executed.setdefault(rid, len(executed))
        if set(ids) & poisoned:
            beside_poison |= set(ids)
        assert len(b) <= c["max_batch"]
        assert len(b) <= limit or len(ids) == 1
        assert len({inputs[rid]["x"].shape[1] for rid in ids}) == 1, "mixed shapes in one batch"
    for i, (x, res) in enumerate(zip(inputs, results, strict=True)):
        if i in cancelled:
            assert isinstance(res, asyncio.CancelledError)
            assert i not in executed, "a request cancelled before it started was run"
        elif i in poisoned:  # it fails alone, with its own words
            assert isinstance(res, RunnerError) and f"requests [{i}]" in str(res), res
        else:
            assert not isinstance(res, BaseException), f"request {i} failed: {res}"
            np.testing.assert_array_equal(res["y"], row_fn(x["x"]))
    if c["ordering"]:
        # Triton's preserve_ordering: responses in the order the requests arrived (one
        # priority level here). Not the order the model saw the batches: two instance
        # threads may start their batches in either order.
        delivered = [i for i in completed if i not in cancelled and i in executed]
        assert delivered == sorted(delivered)
    s = batcher.stats
    assert s.request_success + s.request_failure == len(executed)
    assert s.request_failure == len(poisoned & set(executed))
    if not poisoned:
        assert s.execution_count == len(model.batches)
        assert s.inference_count == sum(len(b) for b in model.batches)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=2, max_size=20), st.integers(1, 4))
def test_higher_priority_never_waits_behind_lower(levels, max_batch):
    model = Model()
    policy = BatchingPolicy(max_batch_size=max_batch, priority_levels=3, default_priority_level=3)

    async def main():
        async with Batcher(model, policy, spec=SPEC) as batcher:
            model.hold()
            blocker = asyncio.ensure_future(batcher.infer(request(1000)))
            await model.wait_started()
            tasks = [
                asyncio.ensure_future(batcher.infer(request(i), priority=p))
                for i, p in enumerate(levels)
            ]
            await asyncio.sleep(0)
            model.gate.set()
            await asyncio.gather(blocker, *tasks)

    asyncio.run(main())
    order = [int(r) for b in model.batches[1:] for r in b]
    assert [levels[i] for i in order] == sorted(levels[i] for i in order)
    # Within a level, arrival order.
    for level in set(levels):
        ids = [i for i in order if levels[i] == level]
        assert ids == sorted(ids)


# ---------------------------------------------------------- batch forming


def test_preferred_batch_sizes_are_formed_when_enough_requests_wait():
    model = Model()
    policy = BatchingPolicy(
        max_batch_size=16, preferred_batch_sizes=(4,), max_queue_delay_us=10_000_000
    )

    async def main():
        async with Batcher(model, policy, spec=SPEC) as batcher:
            model.hold()
            first = [asyncio.ensure_future(batcher.infer(request(i))) for i in range(4)]
            await model.wait_started()
            rest = [asyncio.ensure_future(batcher.infer(request(i))) for i in range(4, 12)]
            await asyncio.sleep(0)
            model.gate.set()
            await asyncio.gather(*first, *rest)  # would take 10 s if it waited for the delay

    asyncio.run(main())
    assert [len(b) for b in model.batches] == [4, 4, 4]


def test_without_delay_whatever_waits_goes_as_soon_as_the_instance_is_free():
    model = Model()

    async def main():
        async with Batcher(model, BatchingPolicy(max_batch_size=8), spec=SPEC) as batcher:
            model.hold()
            first = asyncio.ensure_future(batcher.infer(request(0)))
            await model.wait_started()
            rest = [asyncio.ensure_future(batcher.infer(request(i))) for i in range(1, 12)]
            await asyncio.sleep(0)
            model.gate.set()
            await asyncio.gather(first, *rest)

    asyncio.run(main())
    assert [len(b) for b in model.batches] == [1, 8, 3]


def test_a_lone_request_runs_after_the_queue_delay():
    """The delay is measured on the batcher's clock: until that clock has moved 2 ms the
    request waits, however long the loop sleeps meanwhile."""
    model, clock = Model(), FakeClock()

    async def main():
        policy = BatchingPolicy(max_batch_size=8, max_queue_delay_us=2000)
        async with Batcher(model, policy, spec=SPEC, clock=clock) as b:
            waiting = asyncio.ensure_future(b.infer(request(7, rows=2)))
            await asyncio.sleep(0.05)  # 25 delays of wall time; the clock has not moved
            assert model.batches == [] and b.pending == 1
            clock.now += 0.0019
            await asyncio.sleep(0.01)
            assert model.batches == []
            clock.now += 0.0001
            out = await asyncio.wait_for(waiting, 10)
            np.testing.assert_array_equal(out["y"], row_fn(request(7, rows=2)["x"]))

    asyncio.run(main())
    assert [len(b) for b in model.batches] == [2]


def test_bytes_tensors_batch_like_any_other():
    spec = ModelSpec((TensorSpec("s", "BYTES", [1]),), (TensorSpec("n", np.int64, [1]),), 8)

    def lengths(d):
        return {"n": np.array([[len(v)] for v in d["s"][:, 0]], dtype=np.int64)}

    async def main():
        async with Batcher(lengths, spec=spec) as b:
            words = [b"a", b"bcd", b"ef"]
            outs = await asyncio.gather(
                *[b.infer({"s": np.array([[w]], dtype=object)}) for w in words]
            )
            return [int(o["n"][0, 0]) for o in outs]

    assert asyncio.run(main()) == [1, 3, 2]


# --------------------------------------------------------------- failures


def test_a_runner_exception_fails_only_its_batch_and_the_batcher_keeps_serving():
    model = Model()

    async def main():
        async with Batcher(model, BatchingPolicy(max_batch_size=4), spec=SPEC) as b:
            bad = request(1)
            bad["x"][0, 2] = POISON
            with pytest.raises(RunnerError, match="poisoned batch"):
                await b.infer(bad)
            good = await b.infer(request(2))
            np.testing.assert_array_equal(good["y"], row_fn(request(2)["x"]))
            assert b.stats.request_failure == 1 and b.stats.request_success == 1

    asyncio.run(main())


async def _first_then_three(fn, release) -> tuple[list, object]:
    """Request 0 alone, then 1, 13 and 2 while it runs; ``release()`` lets the model go."""
    async with Batcher(fn, BatchingPolicy(max_batch_size=8), spec=SPEC) as b:
        first = asyncio.ensure_future(b.infer(request(0)))
        await asyncio.sleep(0)
        rest = [asyncio.ensure_future(b.infer(request(i))) for i in (1, 13, 2)]
        await asyncio.sleep(0)
        release()
        return await asyncio.gather(first, *rest, return_exceptions=True), b.stats


def _only_row_13_failed(results: list, stats) -> None:
    assert isinstance(results[2], InvalidInput)
    for i, res in zip((0, 1, 2), (results[0], results[1], results[3]), strict=True):
        np.testing.assert_array_equal(res["y"], row_fn(request(i)["x"]))
    assert stats.request_failure == 1 and stats.request_success == 3
    assert stats.request_admitted == 4  # every admitted request ends as one or the other


def test_bad_input_found_while_running_fails_only_its_own_request():
    def picky(d):
        if (d["x"] == 13).any():
            raise InvalidInput("cannot decode row")
        return {"y": row_fn(d["x"])}

    gate = threading.Event()

    def gated(d):
        gate.wait(10)
        return picky(d)

    _only_row_13_failed(*asyncio.run(_first_then_three(gated, gate.set)))


def test_bad_input_found_by_a_coroutine_batch_function_fails_only_its_own_request():
    calls: list[int] = []
    gate = asyncio.Event()

    async def picky(d):
        calls.append(len(d["x"]))
        await gate.wait()
        if (d["x"] == 13).any():
            raise InvalidInput("cannot decode row")
        return {"y": row_fn(d["x"])}

    results, stats = asyncio.run(_first_then_three(picky, gate.set))
    assert calls[:2] == [1, 3], "the three later requests should have formed one batch"
    _only_row_13_failed(results, stats)


def test_nan_outputs_fail_their_batch_when_the_batcher_requires_finite_values():
    def blows_up(d):
        y = row_fn(d["x"])
        y[d["x"][:, 0] == 13] = np.nan
        return {"y": y}

    async def main(require_finite: bool):
        async with Batcher(blows_up, spec=SPEC, require_finite=require_finite, name="m") as b:
            good = await b.infer(request(1))
            bad = await asyncio.gather(b.infer(request(13)), return_exceptions=True)
            return good, bad[0], await b.infer(request(2))

    good, bad, after = asyncio.run(main(True))
    assert isinstance(bad, RunnerError) and "m: output 'y' holds NaN or Inf" in str(bad)
    np.testing.assert_array_equal(good["y"], row_fn(request(1)["x"]))
    np.testing.assert_array_equal(after["y"], row_fn(request(2)["x"]))  # still serving
    _, passed, _ = asyncio.run(main(False))
    assert np.isnan(passed["y"]).all()  # without the policy NaN is an answer like any other


def test_garbage_outputs_are_runner_errors_naming_the_problem():
    def short(d):
        return {"y": d["x"][:1]}

    async def main():
        async with Batcher(short, spec=SPEC) as b:
            with pytest.raises(RunnerError, match="expected 3 rows for 3 input rows, got 1"):
                await b.infer(request(0, rows=3))

    asyncio.run(main())


def test_invalid_requests_are_rejected_before_they_queue():
    async def main():
        async with Batcher(
            Model(),
            BatchingPolicy(max_batch_size=4, priority_levels=2, default_priority_level=1),
            spec=SPEC,
        ) as b:
            with pytest.raises(InvalidInput, match="'x': expected dtype FP64, got FP32"):
                await b.infer({"x": np.zeros((1, 3), np.float32)})
            with pytest.raises(InvalidInput, match="batch size 5 exceeds max_batch_size 4"):
                await b.infer(request(0, rows=5))
            with pytest.raises(InvalidInput, match=r"priority must be in \[0, 2\], got 9"):
                await b.infer(request(0), priority=9)
            assert (await b.infer(request(1)))["y"].shape == (1, 3)

    asyncio.run(main())


def test_a_full_queue_raises_overloaded_immediately():
    model = Model()
    policy = BatchingPolicy(max_batch_size=1, default_queue_policy=QueuePolicy(max_queue_size=2))

    async def main():
        async with Batcher(model, policy, spec=SPEC) as b:
            model.hold()
            running = asyncio.ensure_future(b.infer(request(0)))
            await model.wait_started()
            queued = [asyncio.ensure_future(b.infer(request(i))) for i in (1, 2)]
            await asyncio.sleep(0)
            with pytest.raises(Overloaded, match="max_queue_size 2"):
                await b.infer(request(3))
            model.gate.set()
            await asyncio.gather(running, *queued)
            assert b.stats.request_rejected == 1

    asyncio.run(main())


def test_reject_timeout_drops_work_that_waited_too_long():
    model, clock = Model(), FakeClock()
    policy = BatchingPolicy(
        max_batch_size=1, default_queue_policy=QueuePolicy(default_timeout_us=1000)
    )

    async def main():
        async with Batcher(model, policy, spec=SPEC, clock=clock) as b:
            model.hold()
            running = asyncio.ensure_future(b.infer(request(0)))
            await model.wait_started()
            late = asyncio.ensure_future(b.infer(request(1)))
            await asyncio.sleep(0)
            clock.now += 0.002
            model.gate.set()
            await running
            with pytest.raises(DeadlineExceeded, match="timed out after 2000 us"):
                await late
            assert b.stats.request_timeout == 1

    asyncio.run(main())
    assert model.batches == [[0]]  # the late request never ran


def test_request_timeouts_override_only_when_allowed():
    model, clock = Model(), FakeClock()
    policy = BatchingPolicy(
        max_batch_size=1,
        default_queue_policy=QueuePolicy(default_timeout_us=10_000, allow_timeout_override=True),
    )

    async def main():
        async with Batcher(model, policy, spec=SPEC, clock=clock) as b:
            model.hold()
            running = asyncio.ensure_future(b.infer(request(0)))
            await model.wait_started()
            short = asyncio.ensure_future(b.infer(request(1), timeout_us=500))
            default = asyncio.ensure_future(b.infer(request(2)))
            await asyncio.sleep(0)
            clock.now += 0.001
            model.gate.set()
            await running
            with pytest.raises(DeadlineExceeded):
                await short
            await default

    asyncio.run(main())


def test_delay_timeout_runs_late_requests_after_punctual_ones():
    model, clock = Model(), FakeClock()
    policy = BatchingPolicy(
        max_batch_size=1,
        default_queue_policy=QueuePolicy(
            default_timeout_us=1000, timeout_action=TimeoutAction.DELAY
        ),
    )

    async def main():
        async with Batcher(model, policy, spec=SPEC, clock=clock) as b:
            model.hold()
            running = asyncio.ensure_future(b.infer(request(0)))
            await model.wait_started()
            late = asyncio.ensure_future(b.infer(request(1)))
            await asyncio.sleep(0)
            clock.now += 0.002
            punctual = asyncio.ensure_future(b.infer(request(2)))
            await asyncio.sleep(0)
            model.gate.set()
            await asyncio.gather(running, late, punctual)

    asyncio.run(main())
    assert model.batches == [[0], [2], [1]]


def test_preserve_ordering_holds_back_results_of_batches_that_finish_early():
    for ordering in (True, False):
        first_gate, second_done = threading.Event(), threading.Event()

        def fn(d, first_gate=first_gate, second_done=second_done):
            if d["x"][0, 0] == 0:
                first_gate.wait(10)
            else:
                second_done.set()
            return {"y": row_fn(d["x"])}

        async def main(fn=fn, ordering=ordering, first_gate=first_gate, second_done=second_done):
            policy = BatchingPolicy(max_batch_size=1, preserve_ordering=ordering)
            async with Batcher(fn, policy, spec=SPEC, instance_count=2) as b:
                order: list[int] = []
                t0 = asyncio.ensure_future(b.infer(request(0)))
                t1 = asyncio.ensure_future(b.infer(request(1)))
                t0.add_done_callback(lambda _: order.append(0))
                t1.add_done_callback(lambda _: order.append(1))
                await asyncio.get_running_loop().run_in_executor(None, second_done.wait, 10)
                for _ in range(20):
                    await asyncio.sleep(0)
                first_gate.set()
                await asyncio.gather(t0, t1)
                return order

        assert asyncio.run(main()) == ([0, 1] if ordering else [1, 0])


# ------------------------------------------------------------------ close


def test_close_drains_every_accepted_request():
    model = Model()
    policy = BatchingPolicy(max_batch_size=4, max_queue_delay_us=60_000_000)

    async def main():
        b = Batcher(model, policy, spec=SPEC)
        tasks = [asyncio.ensure_future(b.infer(request(i))) for i in range(10)]
        await asyncio.sleep(0)
        await b.aclose()  # the 60 s delay must not hold the drain
        results = await asyncio.gather(*tasks)
        with pytest.raises(ModelNotReady):
            await b.infer(request(99))
        return results

    results = asyncio.run(main())
    assert len(results) == 10
    assert sorted(int(r) for batch in model.batches for r in batch) == list(range(10))


def test_close_without_drain_fails_queued_requests_clearly_and_finishes_running_ones():
    model = Model()

    async def main():
        b = Batcher(model, BatchingPolicy(max_batch_size=1), spec=SPEC)
        model.hold()
        running = asyncio.ensure_future(b.infer(request(0)))
        await model.wait_started()
        queued = asyncio.ensure_future(b.infer(request(1)))
        await asyncio.sleep(0)
        closing = asyncio.ensure_future(b.aclose(drain=False))
        await asyncio.sleep(0)
        model.gate.set()
        await closing
        assert (await running)["y"].shape == (1, 3)
        with pytest.raises(ModelNotReady, match="closed before the request ran"):
            await queued

    asyncio.run(main())


# ---------------------------------------------------------------- threads


def test_threaded_callers_each_get_their_own_rows():
    model = Model()
    errors: list[BaseException] = []
    with Batcher(model, BatchingPolicy(max_batch_size=16), spec=SPEC, instance_count=2) as b:

        def caller(t: int) -> None:
            try:
                for k in range(50):
                    x = request(t * 100 + k, rows=1 + k % 3)
                    np.testing.assert_array_equal(b.infer_sync(x)["y"], row_fn(x["x"]))
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=caller, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    assert b.stats.request_success == 400
    assert b.closed
    with pytest.raises(ModelNotReady):
        b.infer_sync(request(0))


def test_infer_sync_gives_up_after_wait_s_and_the_request_is_dropped():
    model = Model()
    with Batcher(model, BatchingPolicy(max_batch_size=1), spec=SPEC) as b:
        model.hold()
        t = threading.Thread(target=b.infer_sync, args=(request(0),))
        t.start()
        model.started.wait(10)
        with pytest.raises(DeadlineExceeded, match="no result within 0.01 s"):
            b.infer_sync(request(1), wait_s=0.01)
        model.gate.set()
        t.join()
    assert model.batches == [[0]]


def test_infer_sync_on_the_batchers_own_loop_is_refused():
    async def main():
        async with Batcher(Model(), spec=SPEC) as b:
            await b.infer(request(0))
            with pytest.raises(RuntimeError, match="use `await batcher.infer"):
                b.infer_sync(request(1))

    asyncio.run(main())


def test_a_batcher_outlives_the_asyncio_run_that_used_it():
    b = Batcher(Model(), spec=SPEC)

    async def use():
        return await b.infer(request(0))

    assert asyncio.run(use())["y"].shape == (1, 3)
    assert b.infer_sync(request(1))["y"].shape == (
        1,
        3,
    )  # that loop is gone: a private one takes over
    b.close()  # same thread as the finished loop: must not be refused
    assert b.closed


def test_close_after_the_loop_that_used_it_has_ended():
    b = Batcher(Model(), spec=SPEC)

    async def use():
        return await b.infer(request(0))

    asyncio.run(use())
    b.close()  # the loop is gone and this is its thread: closing must not be refused
    assert b.closed


def test_async_callers_on_another_loop_are_served_too():
    with Batcher(Model(), spec=SPEC) as b:
        b.infer_sync(request(0))  # binds the private loop

        async def other():
            return await b.infer(request(1))

        assert asyncio.run(other())["y"].shape == (1, 3)


def test_listeners_see_every_batch():
    records = []

    async def main():
        async with Batcher(
            Model(), BatchingPolicy(max_batch_size=8), spec=SPEC, listeners=[records.append]
        ) as b:
            await asyncio.gather(*[b.infer(request(i, rows=2)) for i in range(3)])

    asyncio.run(main())
    assert sum(r.rows for r in records) == 6
    assert sum(r.requests for r in records) == 3
    assert all(r.error is None and r.compute_us > 0 for r in records)


def test_coroutine_batch_functions_are_awaited_on_the_loop():
    seen_threads = set()

    async def double(d):
        seen_threads.add(threading.get_ident())
        await asyncio.sleep(0)
        return {"y": d["x"] * 2}

    async def main():
        async with Batcher(
            double, BatchingPolicy(max_batch_size=8), spec=SPEC, instance_count=2
        ) as b:
            assert b.executor == "loop"
            outs = await asyncio.gather(*[b.infer(request(i)) for i in range(5)])
            return outs, threading.get_ident()

    outs, loop_thread = asyncio.run(main())
    assert [o["y"][0, 0] for o in outs] == [0, 2, 4, 6, 8]
    assert seen_threads == {loop_thread}


def test_loop_executor_runs_sync_functions_without_a_thread_hop():
    seen_threads = set()

    def double(d):
        seen_threads.add(threading.get_ident())
        return {"y": d["x"] * 2}

    async def main():
        async with Batcher(double, spec=SPEC, executor="loop") as b:
            await asyncio.gather(*[b.infer(request(i)) for i in range(5)])
            return threading.get_ident()

    assert seen_threads == {asyncio.run(main())}


def test_a_coroutine_batch_runs_in_no_request_s_context():
    """A batch belongs to no one request: what the request that launched it set in its
    context (Ray's task id, whose cancellation Ray passes on) never reaches the batch."""
    mine: contextvars.ContextVar[str | None] = contextvars.ContextVar("mine", default=None)
    seen: list[str | None] = []

    async def double(d):
        seen.append(mine.get())
        return {"y": d["x"] * 2}

    async def caller(b: Batcher, i: int):
        mine.set(f"request {i}")
        return await b.infer(request(i))

    async def main():
        async with Batcher(double, BatchingPolicy(max_batch_size=8), spec=SPEC) as b:
            await asyncio.gather(*[caller(b, i) for i in range(3)])

    asyncio.run(main())
    assert seen and set(seen) == {None}


def test_a_call_cancelled_under_a_coroutine_batch_fails_it_and_the_instance_serves_on():
    """A call the batch awaited is cancelled by its owner (as Ray does a handle call): the
    batch fails as on any error of its function (a batch of one: its request gets a
    ``RunnerError`` that says so), never leaves its callers waiting or its instance
    taken, and the next request is answered."""
    owned_elsewhere = cancelled_first(lambda d: {"y": d["x"] * 2})

    async def main():
        async with Batcher(owned_elsewhere, BatchingPolicy(max_batch_size=8), spec=SPEC) as b:
            with pytest.raises(RunnerError, match="cancelled under it"):
                await asyncio.wait_for(b.infer(request(1)), 10)
            return await asyncio.wait_for(b.infer(request(2)), 10)

    assert asyncio.run(main())["y"][0, 0] == 4


def test_executor_choices_are_checked():
    async def f(d):
        return d

    with pytest.raises(ValueError, match="must run with executor='loop'"):
        Batcher(f, spec=SPEC, executor="threads")
    with pytest.raises(ValueError, match="executor must be 'threads' or 'loop', got 'gpu'"):
        Batcher(lambda d: d, spec=SPEC, executor="gpu")


def test_a_batcher_needs_a_batching_spec():
    unbatched = ModelSpec((TensorSpec("x", np.float64, [3]),), (TensorSpec("y", np.float64, [3]),))
    with pytest.raises(ValueError, match="max_batch_size > 0"):
        Batcher(lambda d: d, spec=unbatched)
    with pytest.raises(TypeError, match="needs spec="):
        Batcher(lambda d: d)
    with pytest.raises(ValueError, match="policy max_batch_size 128 exceeds the model's 64"):
        Batcher(lambda d: d, BatchingPolicy(max_batch_size=128), spec=SPEC)


def test_runners_plug_in_directly(tiny_cnn_path):
    from servekit import OnnxRuntimeRunner

    runner = OnnxRuntimeRunner(tiny_cnn_path)
    x = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)

    async def main():
        async with Batcher(runner, BatchingPolicy(max_batch_size=8)) as b:
            return await asyncio.gather(*[b.infer({"input": x[i : i + 1]}) for i in range(3)])

    outs = asyncio.run(main())
    np.testing.assert_allclose(
        np.concatenate([o["logits"] for o in outs]), runner.infer({"input": x})["logits"], rtol=1e-5
    )


def test_function_runner_with_its_own_spec():
    runner = FunctionRunner(lambda d: {"y": row_fn(d["x"])}, SPEC)

    async def main():
        async with Batcher(runner) as b:
            return await b.infer(request(3))

    np.testing.assert_array_equal(asyncio.run(main())["y"], row_fn(request(3)["x"]))


def test_a_versioned_model_s_requests_are_checked_once_and_each_batch_s_outputs_once(
    monkeypatch,
):
    # Every served model sits in a VersionedRunner: the Batcher validates each request on
    # admission and each batch's outputs, and the version runs the batch unchecked.
    from servekit.runners.versioned import VersionedRunner

    counts = {"validate_inputs": 0, "check_outputs": 0}
    for name in counts:
        real = getattr(ModelSpec, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(ModelSpec, name, counted)
    spec = ModelSpec((TensorSpec("x", np.float32, [2]),), (TensorSpec("y", np.float32, [2]),), 8)
    runner = VersionedRunner(FunctionRunner(lambda d: {"y": d["x"] * 2}, spec))
    batches: list[int] = []

    async def run() -> None:
        batcher = Batcher(runner, BatchingPolicy(max_batch_size=8, max_queue_delay_us=20_000))
        batcher.listeners.append(lambda record: batches.append(record.requests))
        rows = [{"x": np.full((1, 2), i, np.float32)} for i in range(16)]
        answers = await asyncio.gather(*(batcher.infer(r) for r in rows))
        assert [a["y"][0, 0] for a in answers] == [2.0 * i for i in range(16)]
        await batcher.aclose()

    asyncio.run(run())
    assert counts == {"validate_inputs": 16, "check_outputs": len(batches)}


def test_ahead_holds_a_partial_batch_while_the_device_is_busy_and_sends_a_full_one():
    """With the one device busy and nothing learned yet, a partial batch waits for it;
    a full one leaves at once (Ray's ingress: ``ahead``)."""
    model = Model()
    policy = BatchingPolicy(max_batch_size=4)

    async def main():
        batcher = Batcher(model, policy, spec=SPEC, instance_count=3, ahead=1)
        model.hold()
        first = asyncio.ensure_future(batcher.infer(request(1)))
        await model.wait_started()
        held = [asyncio.ensure_future(batcher.infer(request(i))) for i in (2, 3)]
        for _ in range(20):
            await asyncio.sleep(0.005)
        assert model.batches == [[1]], "a partial batch left while the device was busy"
        held += [asyncio.ensure_future(batcher.infer(request(i))) for i in (4, 5)]
        for _ in range(200):
            await asyncio.sleep(0.005)
            if len(model.batches) == 2:
                break
        assert model.batches == [[1], [2, 3, 4, 5]], "a full batch waited"
        model.gate.set()
        await asyncio.gather(first, *held)
        await batcher.aclose()

    asyncio.run(main())
