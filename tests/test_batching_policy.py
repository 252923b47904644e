"""BatchingPolicy and QueuePolicy: Triton's fields, validated with messages that show the value."""

from __future__ import annotations

import pytest

from servekit import BatchingPolicy, QueuePolicy, TimeoutAction


def test_defaults_match_tritons_dynamic_batching_block():
    p = BatchingPolicy()
    assert p.preferred_batch_sizes == () and p.max_queue_delay_us == 0
    assert not p.preserve_ordering and p.priority_levels == 0
    q = p.default_queue_policy
    assert (q.max_queue_size, q.default_timeout_us, q.timeout_action, q.allow_timeout_override) == (
        0,
        0,
        TimeoutAction.REJECT,
        False,
    )


def test_preferred_sizes_are_sorted_and_deduplicated():
    assert BatchingPolicy(
        max_batch_size=16, preferred_batch_sizes=(8, 4, 8)
    ).preferred_batch_sizes == (4, 8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": -1}, "max_batch_size must be >= 0, got -1"),
        (
            {"max_batch_size": 8, "preferred_batch_sizes": (4, 16)},
            "preferred batch size 16 exceeds max_batch_size 8",
        ),
        ({"preferred_batch_sizes": (0,)}, r"preferred_batch_sizes must be >= 1, got \[0\]"),
        ({"max_queue_delay_us": -5}, "max_queue_delay_us must be >= 0, got -5"),
        (
            {"priority_levels": 3},
            r"default_priority_level must be in \[1, 3\] when priority_levels is 3, got 0",
        ),
        ({"default_priority_level": 1}, "needs priority_levels > 0"),
        (
            {
                "priority_levels": 2,
                "default_priority_level": 1,
                "priority_queue_policies": {3: QueuePolicy()},
            },
            r"levels \[3\] are outside \[1, 2\]",
        ),
    ],
)
def test_invalid_policies_are_rejected_with_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BatchingPolicy(**kwargs)


def test_queue_policy_validation():
    with pytest.raises(ValueError, match="max_queue_size must be >= 0, got -1"):
        QueuePolicy(max_queue_size=-1)
    with pytest.raises(ValueError, match="DROP"):
        QueuePolicy(timeout_action="DROP")
    assert QueuePolicy(timeout_action="DELAY").timeout_action is TimeoutAction.DELAY


@pytest.mark.parametrize(
    ("default", "allow", "requested", "expected"),
    [
        (0, False, 500, 0),  # override not allowed: request timeouts are ignored
        (1000, False, 500, 1000),
        (1000, True, 500, 500),  # may shorten
        (1000, True, 5000, 1000),  # may not lengthen
        (0, True, 5000, 5000),  # no default: the request's own applies
        (1000, True, None, 1000),
    ],
)
def test_timeout_override_may_shorten_but_never_lengthen(default, allow, requested, expected):
    q = QueuePolicy(default_timeout_us=default, allow_timeout_override=allow)
    assert q.timeout_us(requested) == expected


def test_priority_levels_map_zero_to_the_default_and_reject_out_of_range():
    p = BatchingPolicy(priority_levels=3, default_priority_level=2)
    assert [p.level_of(x) for x in (0, 1, 2, 3)] == [2, 1, 2, 3]
    with pytest.raises(ValueError, match=r"priority must be in \[0, 3\], got 4"):
        p.level_of(4)
    assert BatchingPolicy().level_of(7) == 1  # priorities off: everything on one level


def test_per_level_queue_policies_override_the_default():
    strict = QueuePolicy(max_queue_size=1)
    p = BatchingPolicy(
        priority_levels=2, default_priority_level=2, priority_queue_policies={1: strict}
    )
    assert p.queue_policy(1) is strict and p.queue_policy(2) == QueuePolicy()


def test_batch_limit_is_the_largest_preferred_size_else_max_batch_size():
    assert BatchingPolicy(max_batch_size=32, preferred_batch_sizes=(4, 8)).batch_limit(64) == 8
    assert BatchingPolicy(max_batch_size=32).batch_limit(64) == 32
    assert BatchingPolicy().batch_limit(64) == 64


def test_policies_are_hashable_and_frozen():
    p = BatchingPolicy(
        priority_levels=1, default_priority_level=1, priority_queue_policies={1: QueuePolicy()}
    )
    assert hash(p) == hash(
        BatchingPolicy(
            priority_levels=1, default_priority_level=1, priority_queue_policies={1: QueuePolicy()}
        )
    )
    with pytest.raises(AttributeError):
        p.max_batch_size = 3  # type: ignore[misc]


def test_preserve_ordering_allows_one_priority_level_as_in_triton():
    BatchingPolicy(preserve_ordering=True, priority_levels=1, default_priority_level=1)
    with pytest.raises(ValueError, match="preserve_ordering allows one priority level"):
        BatchingPolicy(preserve_ordering=True, priority_levels=2, default_priority_level=1)


def test_preserve_ordering_refuses_delayed_timeouts_as_in_triton():
    with pytest.raises(ValueError, match=r"timeout_action DELAY .* level\(s\) \[0\]"):
        BatchingPolicy(
            preserve_ordering=True,
            default_queue_policy=QueuePolicy(timeout_action=TimeoutAction.DELAY),
        )
