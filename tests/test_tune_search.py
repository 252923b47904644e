"""``servekit tune``'s search, as specifications: the space, the constraints, brute and
quick over landscapes whose best point is known (no servers here; test_tune.py serves)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servekit.batching import BatchingPolicy
from servekit.bench.loadgen import Point
from servekit.bench.stats import WindowStats
from servekit.config import ModelConfig, ServeConfig
from servekit.tune import (
    Constraints,
    Knobs,
    SearchSpace,
    Trial,
    best_trial,
    brute,
    pareto_front,
    quick,
)


def point(rows_per_s: float, p99_ms: float, level: int = 1, errors: int = 0) -> Point:
    requests = round(rows_per_s * 10)
    stats = WindowStats(
        requests, errors, 10.0, requests, p99_ms / 2, p99_ms / 2, p99_ms, p99_ms, p99_ms
    )
    return Point("concurrency", level, stats, 3, True, 0.1, False, rows_per_s)


def landscape(value, p99=lambda k: 10.0):
    """An ``evaluate`` whose candidate ``k`` measures ``value(k)`` rows/s at ``p99(k)``."""
    calls: list[Knobs] = []

    def evaluate(k: Knobs, constraints: Constraints) -> Trial:
        calls.append(k)
        return Trial(k, [point(value(k), p99(k))]).judge(constraints)

    return evaluate, calls


SPACE = SearchSpace((1, 4, 8, 16), (1, 2), (0, 500, 2000), (1, 2))


def test_space_orders_values_and_rejects_bad_ones():
    space = SearchSpace((16, 1, 4), (2, 1), (500, 0), (None, 2, 1))
    assert space.max_batch_size == (1, 4, 16) and space.threads == (None, 1, 2)
    assert space.size == 3 * 2 * 2 * 3 == len(list(space.indices()))
    with pytest.raises(ValueError, match="max_batch_size values must be >= 1"):
        SearchSpace((0, 4))
    with pytest.raises(ValueError, match="instances values repeat"):
        SearchSpace(instances=(1, 1))
    with pytest.raises(ValueError, match="at least one value of threads"):
        SearchSpace(threads=())


def test_a_candidate_config_is_the_base_with_its_knobs(tmp_path):
    base = ServeConfig(
        (ModelConfig("add_sub", batching=BatchingPolicy(8, (4, 8), 100), top_k=3),),
        runtime="native",
    )
    config = SPACE.config(base, Knobs(4, 2, 500, None))
    (model,) = config.models
    assert model.batching == BatchingPolicy(4, (4,), 500)
    assert (model.instances, model.threads, model.top_k) == (2, None, 3)
    (tmp_path / "best.toml").write_text(config.to_toml())
    assert ServeConfig.load(tmp_path / "best.toml") == config


def test_neighbours_are_one_step_along_one_knob():
    assert list(SPACE.neighbours((0, 0, 0, 0, 0))) == [
        (1, 0, 0, 0, 0),
        (0, 1, 0, 0, 0),
        (0, 0, 1, 0, 0),
        (0, 0, 0, 1, 0),
    ]
    assert set(SPACE.neighbours((3, 1, 1, 1, 0))) == {
        (2, 1, 1, 1, 0),
        (3, 0, 1, 1, 0),
        (3, 1, 2, 1, 0),
        (3, 1, 0, 1, 0),
        (3, 1, 1, 0, 0),
    }


def test_constraints_prune_and_say_why():
    c = Constraints(p99_ms=50, min_throughput=100)
    ok, slow, late, failing = (
        point(150, 40),
        point(80, 40),
        point(300, 60),
        point(200, 10, errors=3),
    )
    assert c.violations(ok) == []
    assert c.violations(slow) == ["throughput 80.0/s < 100/s"]
    assert c.violations(late) == ["p99 60.0 ms > 50 ms"]
    assert c.violations(failing) == ["3 errors"]
    trial = Trial(Knobs(4, 1, 0, 1), [slow, late]).judge(c)
    assert trial.status == "pruned" and trial.best is None
    assert "throughput 80.0/s < 100/s" in trial.reason and "p99 60.0 ms > 50 ms" in trial.reason
    trial = Trial(Knobs(4, 1, 0, 1), [ok, late, failing]).judge(c)
    assert trial.status == "ok" and trial.best is ok


def test_the_latency_objective_picks_the_lowest_p99():
    c = Constraints(min_throughput=100, objective="latency")
    trial = Trial(Knobs(4, 1, 0, 1), [point(120, 30), point(300, 20), point(90, 5)]).judge(c)
    assert trial.best is not None and trial.best.stats.p99_ms == 20
    with pytest.raises(ValueError, match="objective must be one of"):
        Constraints(objective="cost")


def test_a_failed_trial_stays_failed_and_scores_lowest():
    c = Constraints(p99_ms=10)
    failed = Trial(
        Knobs(128, 1, 0, 1), status="failed", reason="max_batch_size 128 exceeds the model's 64"
    )
    assert failed.judge(c).status == "failed" and failed.score(c) == (0, -math.inf)
    near = Trial(Knobs(1, 1, 0, 1), [point(10, 12)]).judge(c)
    assert near.score(c) > failed.score(c)


def _separable(k: Knobs) -> float:
    """Throughput that peaks at batch 8, two instances, 500 us, two threads."""
    return (
        1000
        - 20 * abs(math.log2(k.max_batch_size) - 3) ** 2
        - 60 * abs(k.instances - 2)
        - 0.05 * abs(k.max_queue_delay_us - 500)
        - 30 * abs((k.threads or 1) - 2)
    )


def test_brute_and_quick_find_the_known_best_and_quick_needs_a_third_of_the_trials():
    c = Constraints()
    evaluate, calls = landscape(_separable)
    every = brute(SPACE, lambda k: evaluate(k, c))
    assert len(every) == SPACE.size == 48
    best = best_trial(every, c)
    assert best is not None and best.knobs == Knobs(8, 2, 500, 2)
    climbed = quick(SPACE, lambda k: evaluate(k, c), c, min_gain=0)
    assert best_trial(climbed, c).knobs == Knobs(8, 2, 500, 2)  # type: ignore[union-attr]
    assert len(climbed) <= SPACE.size / 3


def test_quick_climbs_out_of_an_infeasible_start():
    """Batch 1 breaks the budget: the climb follows the shortfall to feasible points."""
    c = Constraints(p99_ms=50)
    evaluate, _ = landscape(
        lambda k: 100.0 * k.max_batch_size,
        p99=lambda k: 400 / k.max_batch_size + k.instances,
    )
    found = best_trial(quick(SPACE, lambda k: evaluate(k, c), c), c)
    assert found is not None and found.knobs.max_batch_size == 16


@settings(max_examples=60, deadline=None)
@given(
    peak=st.tuples(st.integers(0, 3), st.integers(0, 1), st.integers(0, 2), st.integers(0, 1)),
    weights=st.tuples(*(st.floats(1, 100) for _ in range(4))),
)
def test_quick_finds_the_peak_of_any_separable_landscape(peak, weights):
    """With one peak and values falling away from it along each knob, a first-improvement
    climb cannot stop anywhere else, and never measures a point twice (noise-free
    figures, so no margin for noise: ``min_gain=0``)."""
    c = Constraints()

    def value(k: Knobs) -> float:
        index = (
            SPACE.max_batch_size.index(k.max_batch_size),
            SPACE.instances.index(k.instances),
            SPACE.max_queue_delay_us.index(k.max_queue_delay_us),
            SPACE.threads.index(k.threads),
        )
        return 10_000 - sum(w * abs(i - p) for w, i, p in zip(weights, index, peak, strict=True))

    evaluate, calls = landscape(value)
    found = best_trial(quick(SPACE, lambda k: evaluate(k, c), c, min_gain=0), c)
    assert found is not None and found.knobs == SPACE.knobs((*peak, 0))  # overlap: one value
    assert len(calls) == len(set(calls)) <= SPACE.size


def test_the_pareto_front_holds_the_undominated_candidates():
    c = Constraints()
    trials = [
        Trial(Knobs(1, 1, 0, 1), [point(100, 10)]).judge(c),
        Trial(Knobs(4, 1, 0, 1), [point(300, 30)]).judge(c),
        Trial(Knobs(8, 1, 0, 1), [point(250, 40)]).judge(c),  # beaten on both by batch 4
        Trial(Knobs(16, 1, 0, 1), [point(500, 80)]).judge(c),
        Trial(Knobs(32, 1, 0, 1), status="failed", reason="did not start"),
    ]
    assert [t.knobs.max_batch_size for t in pareto_front(trials)] == [1, 4, 16]


def test_the_baseline_stays_best_when_no_candidate_beats_it():
    from servekit.tune import TuneResult

    c = Constraints(p99_ms=50)
    base = ServeConfig((ModelConfig("add_sub", batching=BatchingPolicy(64)),), runtime="native")
    result = TuneResult(base, SPACE, c, "quick")
    result.baseline = Trial(Knobs(64, 1, 0, None), [point(500, 20)]).judge(c)
    result.trials = [Trial(Knobs(8, 1, 0, 1), [point(400, 20)]).judge(c)]
    assert result.best is result.baseline and result.best_config() == base
    result.trials.append(Trial(Knobs(16, 2, 0, 1), [point(600, 30)]).judge(c))
    config = result.best_config()
    assert config is not None and config.models[0].batching.max_batch_size == 16


def test_where_the_hand_over_idles_the_device_quick_proposes_overlap():
    """The overlap knob is measured off first, then on; where overlapping the hand-over
    serves more (a device idle during it), the climb ends on it, and the candidate's
    config says so. Where it does not, the climb stays off."""
    space = SearchSpace((4, 8), (1, 2), (0,), (1,), (True, False))
    assert space.overlap == (False, True)
    assert SearchSpace(overlap=(True, None, False)).overlap == (None, False, True)
    c = Constraints()
    for gain, want in ((0.2, True), (-0.05, False)):
        evaluate, _ = landscape(
            lambda k: 100 * k.max_batch_size * (1 + gain * k.overlap) - 10 * k.instances  # noqa: B023
        )
        climbed = quick(space, lambda k: evaluate(k, c), c)  # noqa: B023
        best = best_trial(climbed, c)
        assert best is not None and best.knobs == Knobs(8, 1, 0, 1, want)
        assert best.knobs.label().endswith(f"threads 1, overlap {'on' if want else 'off'}")
        base = ServeConfig((ModelConfig("add_sub"),), runtime="triton")
        (model,) = space.config(base, best.knobs).models
        assert model.overlap is want
