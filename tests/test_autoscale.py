"""The autoscaling signal (``servekit.autoscale``): the formula's meaning at its
landmarks, its monotony, the window, and a restart; then the gauge every runtime exports."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servekit.autoscale import AutoscalePolicy, Counters, Demand, replicas_needed
from servekit.config import ModelConfig, ServeConfig

POLICY = AutoscalePolicy(latency_budget_ms=100, target_batch_fill=0.8, target_queue_share=0.5)


def traffic(requests=100, batch=1, queue_ms=0.0, compute_ms=1.0) -> Counters:
    """``requests`` requests in batches of ``batch``, each waiting ``queue_ms``."""
    return Counters(requests, requests, requests / batch, requests * queue_ms * 1e3,
                    requests * compute_ms * 1e3)  # fmt: skip


def test_the_landmarks_of_the_formula():
    assert replicas_needed(Counters(), 8, POLICY) == 0  # no traffic, no replica needed
    # Lone requests with no queue: 1/8 full batches against a target of 0.8.
    assert replicas_needed(traffic(batch=1), 8, POLICY) == pytest.approx(1 / 8 / 0.8)
    # Full batches: the replica runs past its target fill.
    assert replicas_needed(traffic(batch=8), 8, POLICY) == pytest.approx(1.25)
    # Queueing that takes exactly the allowed share of the slack (100 - 10 ms compute):
    at_target = traffic(batch=2, queue_ms=0.5 * 90, compute_ms=10)
    assert replicas_needed(at_target, 8, POLICY) == pytest.approx(1.0)
    # Twice that queue asks for twice the replicas, however full the batches are.
    assert replicas_needed(traffic(batch=8, queue_ms=90, compute_ms=10), 8, POLICY) == (
        pytest.approx(2.0)
    )
    # Compute over the budget leaves a tenth of it as slack: any queue counts heavily.
    assert replicas_needed(traffic(batch=1, queue_ms=5, compute_ms=150), 8, POLICY) == (
        pytest.approx(1.0)
    )


def test_batches_fill_counts_only_as_far_as_the_instances_are_busy():
    # 100 full batches of 8, 10 ms each, over 10 s: the instance ran a tenth of the time.
    sparse = traffic(requests=800, batch=8, compute_ms=10)
    assert replicas_needed(sparse, 8, POLICY, elapsed_s=10) == pytest.approx(0.1 / 0.8)
    # The same batches over 1 s kept it busy throughout: the fill alone counts.
    assert replicas_needed(sparse, 8, POLICY, elapsed_s=1) == pytest.approx(1.25)
    # Two instances share the work: each was busy half the time.
    assert replicas_needed(sparse, 8, POLICY, elapsed_s=1, instances=2) == pytest.approx(0.5 / 0.8)
    # Lone requests (fill 1/8) on a busy instance: the fill is the smaller, and counts.
    lone = traffic(requests=100, batch=1, compute_ms=10)
    assert replicas_needed(lone, 8, POLICY, elapsed_s=1) == pytest.approx(1 / 8 / 0.8)
    # A queue counts however idle the instances were (a burst queued behind one batch).
    queued = traffic(requests=800, batch=8, queue_ms=90, compute_ms=10)
    assert replicas_needed(queued, 8, POLICY, elapsed_s=10) == pytest.approx(2.0)


def test_the_batchers_own_hold_is_no_queue_to_scale_for():
    # 100 lone requests of 10 ms in 10 s (busy a tenth of the time), each held the whole
    # max_queue_delay (2 ms) for companions. More replicas would not shorten the hold:
    # only the busy share counts, where the 2 ms read 0.44 of a replica against a queue
    # target of 4.5 ms (5 % of the 90 ms slack), and ten such replicas summed to 4.4.
    tight = AutoscalePolicy(latency_budget_ms=100, target_batch_fill=0.8, target_queue_share=0.05)
    held = traffic(batch=1, queue_ms=2, compute_ms=10)
    assert replicas_needed(held, 8, tight, elapsed_s=10, hold_us=2000) == pytest.approx(0.1 / 0.8)
    assert replicas_needed(held, 8, tight, elapsed_s=10) == pytest.approx(2 / 4.5)
    # What waited past the hold counts as before: 4.5 ms past it is the allowed share.
    past = traffic(batch=1, queue_ms=2 + 4.5, compute_ms=10)
    assert replicas_needed(past, 8, tight, elapsed_s=10, hold_us=2000) == pytest.approx(1.0)
    now = [0.0]
    demand = Demand(8, tight, clock=lambda: now[0], hold_us=2000)
    demand.observe(Counters())
    now[0] = 10
    assert demand.observe(held) == pytest.approx(0.1 / 0.8)


@given(st.integers(1, 64), st.floats(0.1, 200), st.floats(0.01, 1000), st.integers(1, 8))
def test_n_replicas_of_sparse_traffic_never_sum_past_the_busy_share(batch, compute, s, n):
    # However the traffic is split over ``n`` replicas, with no queue their signals sum to
    # at most the instances' busy share over the target fill: idle replicas scale in.
    total = traffic(requests=64 * n, batch=batch, compute_ms=compute)
    busy = total.executions * compute / 1e3 / s
    each = Counters(*(v / n for v in total.astuple()))
    summed = n * replicas_needed(each, 64, POLICY, elapsed_s=s)
    assert summed <= busy / POLICY.target_batch_fill + 1e-9


@given(
    st.integers(1, 64), st.floats(0, 500), st.floats(0, 500), st.floats(0.1, 200),
    st.integers(1, 64),
)  # fmt: skip
def test_more_queue_or_fuller_batches_never_ask_for_fewer_replicas(batch, q1, q2, compute, extra):
    lo, hi = sorted((q1, q2))
    base = replicas_needed(traffic(batch=batch, queue_ms=lo, compute_ms=compute), 64, POLICY)
    assert (
        replicas_needed(traffic(batch=batch, queue_ms=hi, compute_ms=compute), 64, POLICY) >= base
    )
    fuller = min(64, batch + extra)
    assert replicas_needed(traffic(batch=fuller, queue_ms=lo, compute_ms=compute), 64, POLICY) >= (
        base
    )


def test_the_window_forgets_old_traffic_and_a_restart_starts_afresh():
    now = [0.0]
    demand = Demand(8, AutoscalePolicy(window_s=30), clock=lambda: now[0])
    assert demand.observe(Counters()) == 0
    now[0] = 10
    busy = traffic(requests=80, batch=8, compute_ms=1000)  # 10 batches of 1 s in 10 s
    assert demand.observe(busy) == pytest.approx(1.25)
    now[0] = 50  # the busy spell began before the window: only what came after counts
    lone = traffic(8, 1, compute_ms=5000)  # 8 lone requests of 5 s in the 40 s since
    later = Counters(*(a + b for a, b in zip(busy.astuple(), lone.astuple(), strict=True)))
    assert demand.observe(later) == pytest.approx(1 / 8 / 0.8)
    now[0] = 90
    assert demand.observe(later) == 0  # nothing new within the window
    now[0] = 95  # the server restarted: its counters began again from zero
    assert demand.observe(traffic(requests=4, batch=4)) == pytest.approx(4 / 8 / 0.8)


def test_the_policy_is_read_from_the_config_and_checked():
    config = ServeConfig.from_dict(
        {"models": [{"source": "add_sub", "autoscale": {"latency_budget_ms": 20}}]}
    )
    assert config.models[0].autoscale == AutoscalePolicy(latency_budget_ms=20)
    assert ServeConfig.from_dict(config.to_dict()) == config
    with pytest.raises(
        ValueError, match=r"unknown key\(s\) \['budget'\] in \[models.0.autoscale\]"
    ):
        ServeConfig.from_dict({"models": [{"source": "add_sub", "autoscale": {"budget": 1}}]})
    with pytest.raises(ValueError, match="target_batch_fill must be in"):
        ModelConfig("add_sub", autoscale=AutoscalePolicy(target_batch_fill=1.5))
