"""Rollout's core, with no server: the split's weights and stickiness, the canary's
verdicts window by window, and the configuration's refusals, each naming what is wrong."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servekit import ModelConfig, ServeConfig
from servekit.errors import InvalidInput, ModelNotFound
from servekit.rollout import (
    CanaryPolicy,
    ModelVersion,
    Traffic,
    TrafficPolicy,
    Window,
    judge,
    same_answer,
)
from servekit.rollout.stats import more_errors_p, slower_p, tail_p

# ------------------------------------------------------------------ the split


@settings(max_examples=30, deadline=None)
@given(share=st.integers(0, 100), seed=st.integers(0, 2**32 - 1))
def test_observed_shares_match_the_weights_within_a_binomial_tolerance(share, seed):
    traffic = Traffic("m", [1, 2], TrafficPolicy({1: 100 - share, 2: share}),
                      rng=random.Random(seed).random)  # fmt: skip
    n = 4000
    got = sum(traffic.choose() == 2 for _ in range(n))
    p = share / 100
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(got - n * p) <= 5 * sigma + 1e-9  # 5 sigma: a false alarm 1 in 1.7 million


def test_a_zero_share_version_is_never_chosen_and_a_full_one_always():
    traffic = Traffic("m", [1, 2, 3], TrafficPolicy({1: 0, 2: 100, 3: 0}))
    assert {traffic.choose() for _ in range(500)} == {2}


@given(values=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=30))
def test_the_same_sticky_value_always_gets_the_same_version(values):
    traffic = Traffic("m", [1, 2], TrafficPolicy({1: 50, 2: 50}, sticky="X-Session"))
    assert traffic.sticky == "x-session"
    first = {v: traffic.choose(v) for v in values}
    assert all(traffic.choose(v) == first[v] for v in values for _ in range(3))


def test_sticky_values_spread_with_the_weights():
    traffic = Traffic("m", [1, 2], TrafficPolicy({1: 80, 2: 20}, sticky="x-session"))
    got = sum(traffic.choose(f"user-{i}") == 2 for i in range(5000))
    assert abs(got - 1000) < 5 * math.sqrt(5000 * 0.2 * 0.8)


def test_a_named_version_bypasses_the_split_and_an_unknown_one_is_not_found():
    traffic = Traffic("m", [1, 2], TrafficPolicy({1: 100, 2: 0}))
    assert traffic.version("2") == 2
    with pytest.raises(ModelNotFound, match=r"model 'm' has no version '7'; it has \[1, 2\]"):
        traffic.version("7")


def test_the_shadow_runs_beside_every_other_version_never_beside_itself():
    traffic = Traffic("m", [1, 2], TrafficPolicy({1: 100}, shadow=2))
    assert traffic.shadow_of(1) == 2 and traffic.shadow_of(2) is None


# ------------------------------------------------------------------ bad configuration


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: TrafficPolicy({1: 90, 2: 20}), r"shares must sum to 100, got 110"),
        (lambda: TrafficPolicy({1: 90, 2: 10.5}), r"version 2's share must be a whole percent"),
        (lambda: TrafficPolicy({"one": 100}), r"versions are integers, got 'one'"),
        (lambda: TrafficPolicy({}), r"expected a table of version = percent"),
        (
            lambda: CanaryPolicy(step=(50, 10, 100)),
            r"step must be increasing .* got \[50, 10, 100\]",
        ),
        (lambda: CanaryPolicy(step=(10, 50)), r"ending at 100"),
        (lambda: CanaryPolicy(on_failure="panic"), r"on_failure must be one of"),
        (lambda: CanaryPolicy(max_error_rate=2.0), r"max_error_rate must be in \[0, 1\]"),
        (lambda: ModelVersion(0, "a.onnx"), r"version must be an integer >= 1"),
        (
            lambda: Traffic("m", [1, 2], TrafficPolicy({1: 50, 3: 50})),
            r"unknown version\(s\) \[3\]",
        ),
        (
            lambda: Traffic("m", [1, 2], TrafficPolicy({1: 100}, shadow=5)),
            r"unknown version\(s\) \[5\]",
        ),
    ],
)
def test_a_bad_rollout_setting_is_refused_naming_it(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_live_split_for_an_unknown_version_is_an_invalid_input():
    traffic = Traffic("m", [1, 2], TrafficPolicy({1: 100}))
    with pytest.raises(InvalidInput, match=r"unknown version\(s\) \[9\]"):
        traffic.set_split({"1": 50, "9": 50})
    assert traffic.split == {1: 100}


# ------------------------------------------------------------------ the verdicts


def window(requests: int, latency_s: float, errors: int = 0, mismatches: int = 0) -> Window:
    w = Window()
    for i in range(requests):
        w.add(latency_s, ok=i >= errors)
    w.compared, w.mismatches = (requests, mismatches) if mismatches else (0, 0)
    return w


POLICY = CanaryPolicy(min_requests=100, max_error_rate=0.01, max_p99_ratio=1.5)


def test_no_verdict_before_each_version_has_its_minimum():
    assert judge(window(99, 0.01), window(500, 0.01), POLICY).kind == "wait"
    assert judge(window(100, 0.01), window(100, 0.01), POLICY).kind == "pass"


@pytest.mark.parametrize(
    ("canary", "reason"),
    [
        (
            window(200, 0.01, errors=12),
            "error rate 0.0600 > 0.01 (12 of 200; the baseline's 0.0000, p 0.0002)",
        ),
        (
            window(200, 0.02),
            "p99 20.00 ms is 2.00x the baseline's 10.00 ms > 1.5x (+10.00 ms; slower with "
            "p < 0.0001)",
        ),
        (
            window(200, 0.01, mismatches=1),
            "mismatch rate 0.0050 > 0.0 (1 of 200 shadow answers differ)",
        ),
    ],
)
def test_each_limit_fails_the_canary_with_its_figures(canary, reason):
    verdict = judge(canary, window(200, 0.01), POLICY)
    assert verdict.kind == "fail" and verdict.reasons == (reason,)


def test_a_difference_within_chance_or_under_the_floor_passes():
    """3 errors in 200 against none is not evidence at 99.9 %; a p99 twice as high but only
    0.4 ms higher is under the absolute floor; a noisy tail alike in both passes."""
    assert judge(window(200, 0.01, errors=3), window(200, 0.01), POLICY).kind == "pass"
    assert judge(window(200, 0.0008), window(200, 0.0004), POLICY).kind == "pass"
    rng = np.random.default_rng(0)
    for _ in range(20):  # one distribution, two samples: p99s of 200 differ a lot
        a, b = Window(), Window()
        for w in (a, b):
            for v in rng.lognormal(np.log(0.002), 0.8, 200):
                w.add(float(v), ok=True)
        assert judge(a, b, POLICY).kind == "pass"


@settings(max_examples=50, deadline=None)
@given(st.integers(30, 300), st.floats(1.2, 3.0))
def test_a_canary_slower_throughout_is_found_slower(n, factor):
    rng = np.random.default_rng(n)
    base = rng.lognormal(np.log(0.01), 0.2, n)
    assert slower_p(base * factor, base[::-1].copy()) < 0.01
    assert slower_p(base, base[::-1].copy()) > 0.01


def test_a_canary_slow_only_in_its_tail_is_caught_by_the_tail_test():
    rng = np.random.default_rng(1)
    base = rng.lognormal(np.log(0.01), 0.1, 2000)
    canary = base.copy()
    canary[::20] *= 10  # 5 % of requests ten times slower: the median hardly moves
    assert tail_p(list(canary), list(base)) < 1e-6
    assert tail_p(list(base), list(base)) > 0.05


def test_more_errors_needs_evidence():
    assert more_errors_p(10, 200, 0, 200) == pytest.approx(math.comb(200, 10) / math.comb(400, 10))
    assert more_errors_p(3, 200, 0, 200) > 0.1
    assert more_errors_p(0, 200, 5, 200) == pytest.approx(1.0)
    # The top three of 280 latencies all the canary's 60: chance 1 %, not the 0.05 %
    # a normal approximation would claim.
    assert more_errors_p(3, 60, 0, 220) == pytest.approx(math.comb(60, 3) / math.comb(280, 3))


def feed(traffic: Traffic, version: int, n: int, latency_s: float, ok: bool = True) -> None:
    for _ in range(n):
        traffic.record(version, latency_s, ok)


def test_a_good_canary_is_promoted_step_by_step():
    policy = CanaryPolicy(min_requests=50, step=(10, 50, 100))
    traffic = Traffic("m", [1, 2], TrafficPolicy({1: 95, 2: 5}), policy)
    assert (traffic.state, traffic.canary, traffic.baseline) == ("judging", 2, 1)
    for expected in ({1: 90, 2: 10}, {1: 50, 2: 50}, {1: 0, 2: 100}):
        feed(traffic, 1, 50, 0.010)
        feed(traffic, 2, 50, 0.011)
        assert traffic.split == expected
    assert traffic.state == "promoted"
    assert [e["event"] for e in traffic.events] == ["step", "step", "promoted"]
    assert traffic.verdicts[(2, "promoted")] == 1
    feed(traffic, 2, 500, 1.0)  # judging is over: nothing changes any more
    assert traffic.split == {1: 0, 2: 100}


def test_a_slow_canary_is_rolled_back_and_its_shadow_stops():
    policy = CanaryPolicy(min_requests=50, max_p99_ratio=1.5)
    traffic = Traffic("m", [1, 2], TrafficPolicy({1: 90, 2: 10}, shadow=2), policy)
    feed(traffic, 1, 50, 0.010)
    feed(traffic, 2, 50, 0.100)
    assert traffic.split == {1: 100, 2: 0} and traffic.state == "rolled back"
    assert traffic.shadow is None
    event = traffic.events[-1]
    assert event["event"] == "rollback" and "10.00x the baseline's" in event["why"]
    assert {traffic.choose() for _ in range(200)} == {1}
    assert traffic.state_dict()["canary"]["last_window"]["verdict"] == "fail"


def test_hold_keeps_the_split_and_stops_judging():
    policy = CanaryPolicy(min_requests=10, on_failure="hold")
    traffic = Traffic("m", [1, 2], TrafficPolicy({1: 80, 2: 20}), policy)
    feed(traffic, 1, 10, 0.01)
    feed(traffic, 2, 10, 0.01, ok=False)
    assert traffic.split == {1: 80, 2: 20} and traffic.state == "held"


def test_a_new_split_starts_a_new_judgement():
    policy = CanaryPolicy(min_requests=10)
    traffic = Traffic("m", [1, 2], TrafficPolicy({1: 100, 2: 0}), policy)
    assert traffic.canary == 2  # the smallest share, even at 0 (a shadow may feed it)
    traffic.set_split({"1": 30, "2": 70})
    assert (traffic.canary, traffic.baseline, traffic.state) == (1, 2, "judging")
    assert traffic.events[-1]["event"] == "split"


def copies(policy: CanaryPolicy, split: dict[int, int], shadow: int | None = None):
    """A Traffic and a copy of it (another ingress replica's) that adopts each change."""
    made = Traffic("m", [1, 2, 3], TrafficPolicy(split, shadow=shadow), policy)
    copy = Traffic("m", [1, 2, 3], TrafficPolicy(split, shadow=shadow), policy)
    told: list[dict] = []
    made.on_change = told.append
    return made, copy, told


def seen(t: Traffic) -> tuple:
    return t.split, t.shadow, t.state, t.canary, t.baseline


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.set_split({"1": 30, "3": 70}),
        lambda t: t.set_shadow(3),
        lambda t: (feed(t, 1, 10, 0.01), feed(t, 2, 10, 0.01)),  # a step
        lambda t: (feed(t, 1, 10, 0.01), feed(t, 2, 10, 0.5)),  # a rollback
        lambda t: [(feed(t, 1, 10, 0.01), feed(t, 2, 10, 0.01)) for _ in range(3)],  # promoted
    ],
    ids=["split", "shadow", "step", "rollback", "promoted"],
)
def test_a_copy_that_adopts_each_change_routes_as_the_traffic_that_made_it(change):
    made, copy, told = copies(CanaryPolicy(min_requests=10, step=(10, 50, 100)), {1: 95, 2: 5}, 2)
    change(made)
    assert told and seen(made) != seen(copy)
    for shared in told:
        copy.adopt(shared, "from the other replica")
    assert seen(copy) == seen(made)
    assert copy.events[-1]["event"] == "adopted" and len(told) == len(made.events)
    before = len(told)
    copy.set_split({"1": 100})  # the copy's own change is told to its own listener only
    assert len(told) == before


def test_a_copy_with_a_change_of_its_own_still_unshared_does_not_adopt_another_s():
    made, copy, told = copies(None, {1: 95, 2: 5})
    made.set_split({"1": 50, "2": 50})
    copy.set_split({"1": 10, "2": 90})  # newer, and not yet shared by the copy
    assert not copy.adopt(told[-1], "from the other replica", unless=lambda: True)
    assert copy.split == {1: 10, 2: 90} and copy.events[-1]["event"] == "split"
    assert copy.adopt(told[-1], "from the other replica", unless=lambda: False)
    assert copy.split == {1: 50, 2: 50}


def test_an_adopted_judgement_goes_on_in_the_copy_with_a_fresh_window():
    made, copy, told = copies(CanaryPolicy(min_requests=10, step=(10, 50, 100)), {1: 95, 2: 5})
    feed(copy, 2, 9, 0.01)  # the copy's window of the old split, about to be dropped
    feed(made, 1, 10, 0.01)
    feed(made, 2, 10, 0.01)
    copy.adopt(told[-1], "step")
    assert copy.split == {1: 90, 2: 10} and copy.state == "judging"
    feed(copy, 1, 10, 0.01)
    feed(copy, 2, 9, 0.01)
    assert copy.split == {1: 90, 2: 10}  # 9 of the new window: no verdict yet
    feed(copy, 2, 1, 0.01)
    assert copy.split == {1: 50, 2: 50}


def test_answers_compare_within_their_precision_and_exactly_otherwise():
    a = {"y": np.array([1.0, 2.0], np.float32), "n": np.array([1, 2])}
    assert same_answer(a, {"y": a["y"] + 1e-6, "n": a["n"].copy()})
    assert not same_answer(a, {"y": a["y"] + 1e-2, "n": a["n"]})
    assert not same_answer(a, {"y": a["y"], "n": a["n"] + 1})
    assert not same_answer(a, {"y": a["y"]})
    assert not same_answer(a, {"y": a["y"].astype(np.float64), "n": a["n"]})


def test_a_shadow_beside_a_lone_version_is_its_canary_a_dark_launch():
    traffic = Traffic("m", [1, 2], TrafficPolicy({1: 100}, shadow=2), CanaryPolicy(min_requests=10))
    assert (traffic.canary, traffic.baseline, traffic.state) == (2, 1, "judging")
    feed(traffic, 1, 10, 0.01)
    for _ in range(10):
        traffic.record(2, 0.01, True, shadow=True)
        traffic.compared(2, same=True)
    assert traffic.split == {1: 90, 2: 10}  # passed in the dark: its first step
    assert traffic.counts[2]["shadow_runs"] == 10 and traffic.counts[2]["requests"] == 0


def test_the_file_s_split_is_followed_only_when_the_file_changed_it():
    traffic = Traffic("m", (1, 2), TrafficPolicy({1: 90, 2: 10}))
    assert traffic.follow_file(TrafficPolicy({1: 90, 2: 10})) is None
    traffic.set_split({2: 100})  # a live split the file never mentioned stays
    assert traffic.follow_file(TrafficPolicy({1: 90, 2: 10})) is None
    assert traffic.split == {2: 100}
    assert traffic.follow_file(TrafficPolicy({1: 50, 2: 50})) == (
        "m: traffic split {1: 50, 2: 50} from the file"
    )
    assert traffic.split == {1: 50, 2: 50}
    assert traffic.events[-1]["why"] == "the file's split, re-read"
    with pytest.raises(InvalidInput, match=r"unknown version\(s\) \[3\]"):
        traffic.follow_file(TrafficPolicy({1: 50, 3: 50}))


def test_ray_refuses_to_re_read_a_split_by_name():
    from servekit.serving import create_runtime, reread_traffic

    model = ModelConfig(
        "add_sub", versions=(ModelVersion(2, "add_sub"),), traffic={"split": {1: 100}}
    )
    config = ServeConfig((model,), runtime="ray")
    with pytest.raises(
        ValueError, match="the ray runtime does not re-read traffic splits on SIGHUP"
    ):
        reread_traffic(create_runtime(config), config)
