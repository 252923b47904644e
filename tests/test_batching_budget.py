"""Batching under a latency budget (``batching.budget``), on an injected clock: what it
learns of the batch times and the arrivals, and that no request is held past the point
where the learned batch time says it would miss the budget while a batch could start."""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servekit import BatchingPolicy, ModelSpec, TensorSpec
from servekit.batching import Batcher
from servekit.batching.budget import BatchTimes, Budget, decide_within
from servekit.batching.request import Request


class Done:
    def done(self) -> bool:
        return False


def req(i: int, rows: int, arrival: float) -> Request:
    return Request(i, {}, rows, ((4,),), 1, arrival, math.inf, Done())  # type: ignore[arg-type]


# An increasing batch time: fixed plus per row, each in seconds.
lines = st.tuples(st.floats(1e-4, 0.02), st.floats(0.0, 0.005))


@given(
    st.lists(st.tuples(st.integers(1, 6), st.floats(0, 0.2)), min_size=1, max_size=30),
    lines,
    st.integers(1, 64),  # limit
    st.integers(1, 64),  # target
    st.floats(0.005, 0.3),  # budget
    st.floats(0, 0.4),  # now, past the arrivals
)
def test_a_hold_never_passes_the_last_moment_a_batch_of_the_target_meets_the_budget(
    raw, line, limit, target, budget, after
):
    arrivals = sorted(t for _, t in raw)
    pending = [req(i, rows, t) for i, ((rows, _), t) in enumerate(zip(raw, arrivals, strict=True))]
    now = arrivals[-1] + after
    fixed, per_row = line

    def batch_s(rows: int) -> float:
        return fixed + per_row * rows

    d = decide_within(pending, now, limit=limit, budget_s=budget, target=target, batch_s=batch_s)
    waiting = sum(r.rows for r in pending)
    oldest = pending[0].arrival
    if d.take:
        assert 1 <= d.take <= len(pending)
        assert sum(r.rows for r in pending[: d.take]) <= limit or d.take == 1
        return
    # Held: fewer rows than the target wait, the batch could still grow, and every
    # moment until the wake-up leaves the oldest request its budget after a target batch
    # (and so after the smaller batch that could start now).
    assert waiting < min(target, limit)
    assert d.wait_s is not None and d.wait_s > 0
    wake = now + d.wait_s
    assert wake + batch_s(max(target, waiting)) <= oldest + budget + 1e-9
    assert now + batch_s(waiting) <= oldest + budget + 1e-9


def test_the_line_is_learned_from_the_batches_and_its_percentile_covers_the_slow_ones():
    times = BatchTimes(percentile=90)
    assert times.mean(8) is None
    times.observe(4, 0.010)
    assert times.mean(8) == pytest.approx(0.020)  # one size seen: proportional, above the truth
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows = int(rng.integers(1, 33))
        times.observe(rows, (0.008 + 0.0016 * rows) * float(rng.uniform(0.95, 1.15)))
    assert times.mean(32) == pytest.approx(0.0592 * 1.05, rel=0.05)
    assert times.mean(1) < times.mean(16) < times.mean(32)
    assert times.at_percentile(32) > times.mean(32)


def test_the_arrival_rate_follows_a_change_of_load_within_seconds():
    budget = Budget(0.1, 99, limit=32, clock=lambda: 0.0)
    now = 0.0
    for _ in range(500):  # 100 rows/s for 5 s
        now += 0.01
        budget.arrived(1, now)
    assert budget.rate(now) == pytest.approx(100, rel=0.1)
    for _ in range(1500):  # then 500 rows/s
        now += 0.002
        budget.arrived(1, now)
    assert budget.rate(now) == pytest.approx(500, rel=0.1)
    assert budget.rate(now + 5) < 5  # and falls away when they stop


def simulate(arrivals, fixed, per_row, budget_s, limit=32, instances=1):
    """Serve ``arrivals`` ((time, rows), sorted) on ``instances`` devices whose batches take
    ``fixed + per_row * rows``, deciding with a ``Budget`` at every moment something
    changes; returns each request's (arrival, answered) and every hold's check."""
    budget = Budget(budget_s, 99, limit=limit, instances=instances, clock=lambda: 0.0)
    queue: list[Request] = []
    answered: list[tuple[float, float]] = []
    holds: list[tuple[float, float]] = []  # (latest start the learned time allows, wake-up)
    events: list[tuple[float, int, object]] = []  # (time, order, what)
    order = 0
    for i, (t, rows) in enumerate(arrivals):
        heapq.heappush(events, (t, order, req(i, rows, t)))
        order += 1
    free, wake = instances, None
    while events:
        now, _, what = heapq.heappop(events)
        if isinstance(what, Request):
            budget.arrived(what.rows, now)
            queue.append(what)
        elif isinstance(what, list):  # a batch done
            free += 1
            budget.ran(sum(r.rows for r in what), fixed + per_row * sum(r.rows for r in what))
            budget.answered([now - r.arrival for r in what], now)
            answered += [(r.arrival, now) for r in what]
        elif what != wake:
            continue  # a wake-up since replaced
        while free and queue:
            d = budget.decide(queue, now, busy=instances - free)
            if not d.take:
                rows = sum(r.rows for r in queue)
                t = budget.times.at_percentile(max(budget.target, rows))
                if t is not None:
                    holds.append((queue[0].arrival + budget.working_s - t, now + d.wait_s))
                wake = now + d.wait_s
                heapq.heappush(events, (wake, order, wake))
                order += 1
                break
            batch, queue = queue[: d.take], queue[d.take :]
            free -= 1
            took = fixed + per_row * sum(r.rows for r in batch)
            heapq.heappush(events, (now + took, order, batch))
            order += 1
    return answered, holds, budget


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 0.02), st.integers(1, 4)), min_size=1, max_size=300),
    lines,
    st.floats(0.01, 0.5),
    st.integers(1, 2),
)
def test_on_an_injected_clock_no_request_is_held_past_its_last_moment_and_all_are_answered(
    gaps, line, budget_s, instances
):
    arrivals, now = [], 0.0
    for gap, rows in gaps:
        now += gap
        arrivals.append((now, rows))
    answered, holds, _ = simulate(arrivals, *line, budget_s, instances=instances)
    assert len(answered) == len(arrivals)  # nobody is held for ever
    for latest, wake in holds:
        assert wake <= latest + 1e-9


def test_light_load_waits_little_heavy_load_keeps_up_and_overload_asks_for_replicas():
    fixed, per_row = 0.008, 0.0016  # sim_t4: 59.2 ms for 32 rows, 540 rows/s at most
    rng = np.random.default_rng(1)

    def poisson(rate: float, seconds: float) -> list[tuple[float, int]]:
        t, out = 0.0, []
        while t < seconds:
            t += float(rng.exponential(1 / rate))
            out.append((t, 1))
        return out

    found = {}
    for share in (0.2, 0.9, 1.3):
        arrivals = poisson(540 * share, 20)
        answered, _, budget = simulate(arrivals, fixed, per_row, 0.1)
        settled = [done - at for at, done in answered if at > 5]
        end = arrivals[-1][0]
        found[share] = (np.percentile(settled, 99), budget.target, budget.replicas_needed(end))
        found[share] += (max(done for _, done in answered) - end,)
    p99, target, needed, _ = found[0.2]
    assert p99 < 0.04 and target <= 3 and needed < 0.5  # a light load is not held for long
    p99, target, needed, behind = found[0.9]
    assert target >= 12 and behind < 0.2 and 0.8 < needed < 1.3  # batches that keep up
    p99, target, needed, behind = found[1.3]
    assert p99 > 1 and behind > 1 and needed > 1.2  # past capacity: more replicas, not less


SPEC = ModelSpec((TensorSpec("x", np.float32, [4]),), (TensorSpec("y", np.float32, [4]),), 32)


def test_the_batcher_holds_a_budget_and_says_what_it_chose():
    from conftest import parse_metrics
    from servekit.metrics import Metrics

    policy = BatchingPolicy(max_batch_size=32, latency_budget_ms=50)
    formed: list[int] = []

    def model(inputs):
        x = inputs["x"]
        formed.append(len(x))
        time.sleep(0.002 + 0.0002 * len(x))
        return {"y": x * 2}

    async def main() -> Batcher:
        async with Batcher(model, policy, spec=SPEC) as b:
            xs = [np.full((1, 4), i, np.float32) for i in range(400)]

            async def one(x):
                await asyncio.sleep(float(np.random.default_rng(int(x[0, 0])).uniform(0, 1)))
                return await b.infer({"x": x})

            outs = await asyncio.gather(*(one(x) for x in xs))
            for x, out in zip(xs, outs, strict=True):
                assert (out["y"] == 2 * x).all()
            return b

    b = asyncio.run(main())
    assert b.stats.request_success == 400
    budget = b.budget
    assert budget is not None and budget.times.known  # learned from the batches it ran
    assert 0 < budget.attainment(time.monotonic()) <= 1
    assert budget.times.mean(32) > budget.times.mean(1)
    assert sum(n for rows, n in b.stats.batch_rows.items() if rows > 1)  # batched at all
    # The rows gauge is the mean of the batches the model was actually given, lately.
    assert budget.batch_rows() == pytest.approx(np.mean(formed[-64:]))
    metrics = Metrics(gpu=False)
    metrics.watch(b, "m")
    gauges = {name: value for (name, _), value in parse_metrics(metrics.render()).items()}
    assert gauges["servekit_batch_rows"] == pytest.approx(np.mean(formed[-64:]))
    assert gauges["servekit_batch_target_rows"] == budget.target
    # One instance: a free instance never has another running, so no batch is held for
    # the target; batches still grow past one row, taking all that waits.
    assert max(formed) > budget.target or budget.target == 1


def test_a_budget_beside_a_queue_delay_or_preferred_sizes_is_refused_by_name():
    with pytest.raises(ValueError, match="leave out max_queue_delay_us"):
        BatchingPolicy(latency_budget_ms=100, max_queue_delay_us=500)
    with pytest.raises(ValueError, match="leave out preferred_batch_sizes"):
        BatchingPolicy(latency_budget_ms=100, preferred_batch_sizes=(8,))
    with pytest.raises(ValueError, match=r"latency_percentile must be in \(0, 100\]"):
        BatchingPolicy(latency_budget_ms=100, latency_percentile=0)
    policy = BatchingPolicy.from_dict({"latency_budget_ms": 100, "latency_percentile": 95})
    assert BatchingPolicy.from_dict(policy.to_dict()) == policy
    assert policy.static_delay_us() == 10_000


def test_eight_clients_over_http_get_their_answers_and_the_budget_s_gauges(tmp_path):
    """Native, a simulated device of known cost (2 ms + 0.5 ms a row), a 50 ms budget."""
    import onnx
    import tritonclient.http as httpclient

    from conftest import each_client, scrape
    from servekit import ModelConfig, ServeConfig, ServerConfig
    from servekit.native import NativeServer
    from servekit.zoo.tiny import build_simulated

    onnx.save(build_simulated("budget-test", 2000, 500, width=4), tmp_path / "dev.onnx")
    model = ModelConfig(
        str(tmp_path / "dev.onnx"), "dev", image=False, instances=2,
        batching=BatchingPolicy(max_batch_size=16, latency_budget_ms=50),
    )  # fmt: skip
    assert model.autoscale.latency_budget_ms == 50  # one budget, the signal's too
    config = ServeConfig((model,), ServerConfig(exit_timeout_s=2), runtime="native")
    config = config.on_loopback()
    with NativeServer(config):
        url = config.server.http_url.removeprefix("http://")

        def work(k: int) -> None:
            c = httpclient.InferenceServerClient(url)
            try:
                for i in range(40):
                    x = np.full((1, 4), 100 * k + i, np.float32)
                    t = httpclient.InferInput("INPUT0", [1, 4], "FP32")
                    t.set_data_from_numpy(x)
                    out = c.infer("dev", [t]).as_numpy("OUTPUT0")
                    assert out.shape == (1, 4)
            finally:
                c.close()

        each_client(work)
        got = scrape(config.server.metrics_url)
        served = httpclient.InferenceServerClient(url).get_model_config("dev")
    labels = {"model": "dev", "version": "1"}
    # The config says the budget, and the hold in force: the last batch's, as the gauge.
    params = {k: v["string_value"] for k, v in served["parameters"].items()}
    assert params["latency_budget_ms"] == "50" and params["latency_percentile"] == "99"
    assert params["queue_delay"] == "adaptive"  # the batcher chooses each hold
    assert 0 < float(params["working_budget_ms"]) <= 50
    delay = got[("servekit_batch_delay_seconds", frozenset(labels.items()))]
    held_us = served["dynamic_batching"].get("max_queue_delay_microseconds", "0")
    assert int(held_us) == round(delay * 1e6) != 5000  # not the static rendering's tenth
    assert (
        params["target_rows"]
        == f"{got[('servekit_batch_target_rows', frozenset(labels.items()))]:g}"
    )
    assert 1 <= got[("servekit_batch_rows", frozenset(labels.items()))] <= 16
    assert got[("servekit_latency_budget_seconds", frozenset(labels.items()))] == 0.05
    assert 0 < got[("servekit_latency_budget_attainment", frozenset(labels.items()))] <= 1
    assert 1 <= got[("servekit_batch_target_rows", frozenset(labels.items()))] <= 16
    assert got[("nv_inference_request_success", frozenset(labels.items()))] == 320
    assert got[("nv_inference_pending_request_count", frozenset(labels.items()))] == 0


def test_where_tritonserver_batches_the_budget_is_a_fixed_delay_and_said_at_start():
    from tritonclient.grpc import model_config_pb2 as pb

    from servekit import ModelConfig, ServeConfig
    from servekit.protocol.pbtxt import model_config as render
    from servekit.runtime.base import static_budgets

    policy = BatchingPolicy(max_batch_size=32, latency_budget_ms=80)
    config = pb.ModelConfig()
    policy.to_triton(config, 64)
    assert config.dynamic_batching.max_queue_delay_microseconds == 8000
    assert policy.to_pytriton(64).batcher.max_queue_delay_microseconds == 8000
    serve = ServeConfig((ModelConfig("m.onnx", batching=policy),), runtime="pytriton")
    (line,) = static_budgets(serve)
    assert "model m: tritonserver's dynamic batcher assembles its batches" in line
    assert "latency_budget_ms = 80 is served as a fixed max_queue_delay_us = 8000" in line
    spec = ModelSpec((TensorSpec("x", "FP32", (4,)),), (TensorSpec("y", "FP32", (4,)),), 64)
    rendered = render("m", spec, policy)  # what the triton runtime's repository holds
    assert {k: v.string_value for k, v in rendered.parameters.items()} == {
        "latency_budget_ms": "80", "latency_percentile": "99", "queue_delay": "fixed"
    }  # fmt: skip
    unbatched = dataclasses.replace(spec, max_batch_size=0)
    assert not render("m", unbatched, policy).parameters  # no batcher, no budget
    with pytest.raises(ValueError, match=r"give the budget once, in \[models.batching\]"):
        ModelConfig("m.onnx", batching=policy, autoscale={"latency_budget_ms": 50})


@pytest.mark.parametrize("runtime", ["pytriton", "triton"])
def test_where_tritonserver_batches_the_config_says_the_budget_and_its_fixed_delay(
    runtime, add_sub_path
):
    """``/v2/models/<m>/config`` over HTTP and gRPC (through servekit's front, from
    tritonserver) names the budget as native's does, with ``queue_delay = fixed``: the
    delay in ``max_queue_delay_microseconds`` is the tenth of the budget every batch waits."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from conftest import needs_runtime
    from servekit import ModelConfig, ServeConfig, ServerConfig
    from servekit.serving import create_runtime

    needs_runtime(runtime)
    policy = BatchingPolicy(max_batch_size=8, latency_budget_ms=40, latency_percentile=95)
    model = ModelConfig(str(add_sub_path), "add_sub", batching=policy)
    config = ServeConfig((model,), ServerConfig(exit_timeout_s=2), runtime=runtime)
    config = config.on_loopback()
    with create_runtime(config):
        http = httpclient.InferenceServerClient(config.server.http_url.removeprefix("http://"))
        grpc = grpcclient.InferenceServerClient(config.server.grpc_url.removeprefix("grpc://"))
        try:
            served = http.get_model_config("add_sub")
            over_grpc = grpc.get_model_config("add_sub").config
        finally:
            http.close()
            grpc.close()
    params = {k: v["string_value"] for k, v in served["parameters"].items()}
    budget = {k: params.get(k) for k in ("latency_budget_ms", "latency_percentile", "queue_delay")}
    assert budget == {"latency_budget_ms": "40", "latency_percentile": "95", "queue_delay": "fixed"}
    assert "working_budget_ms" not in params and "target_rows" not in params  # nothing adapts
    held_us = int(served["dynamic_batching"]["max_queue_delay_microseconds"])
    assert held_us == policy.static_delay_us() == 4000
    assert {k: v.string_value for k, v in over_grpc.parameters.items()} == params
    assert over_grpc.dynamic_batching.max_queue_delay_microseconds == held_us
