"""One traffic for every ingress replica of a run (``servekit.ray.shared``), through a real
Ray's GCS key-value store: each ``SharedTraffic`` here stands for an ingress replica on
its own host (the cluster test serves it for real across three hosts)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("ray", reason="needs the ray extra")

from conftest import ray_serve, wait_until
from servekit.rollout import CanaryPolicy, Traffic, TrafficPolicy


@pytest.fixture(scope="module")
def real_ray() -> Iterator[None]:
    with ray_serve():
        yield


@pytest.fixture
def ray(real_ray: None) -> Iterator[Callable[..., list[Traffic]]]:
    """A real Ray, and ``replicas(n, run_id, policy)``: n Traffics, each shared as an
    ingress replica shares its own; every sharer closed after the test."""
    from servekit.ray.shared import SharedTraffic

    sharers: list[SharedTraffic] = []

    def replicas(
        n: int, run_id: str, policy: CanaryPolicy | None = None, kind: type[Traffic] = Traffic
    ) -> list[Traffic]:
        out = []
        for _ in range(n):
            t = kind("m", [1, 2], TrafficPolicy({1: 90, 2: 10}), policy)
            sharers.append(SharedTraffic(run_id, {"m": t}, f"replica-{len(sharers)}", poll_s=0.05))
            out.append(t)
        return out

    try:
        yield replicas
    finally:
        for s in sharers:
            s.close()


def same(traffic: list[Traffic]) -> bool:
    return len({(str(t.split), t.state) for t in traffic}) == 1


def test_a_change_in_one_replica_reaches_every_other_and_a_late_one(ray):
    from servekit.ray import drain

    run = f"test/{uuid.uuid4().hex}"
    a, b, c = ray(3, run)
    b.set_split({"1": 0, "2": 100})
    wait_until(lambda: a.split == c.split == {1: 0, 2: 100}, "the split everywhere", 10)
    assert a.events[-1]["event"] == "adopted"
    (late,) = ray(1, run)  # a replica started later (a host back) starts from it
    wait_until(lambda: late.split == {1: 0, 2: 100}, "the split in a late replica", 10)
    (other,) = ray(1, f"test/{uuid.uuid4().hex}")  # another run's replica shares nothing
    drain.clear(run)  # the run is over: a replica of it started now starts from the file
    (after,) = ray(1, run)
    time.sleep(0.5)
    assert other.split == after.split == {1: 90, 2: 10}


def test_changes_made_at_once_in_every_replica_end_the_same_everywhere(ray):
    traffic = ray(4, f"test/{uuid.uuid4().hex}")

    def change(t: Traffic, i: int) -> None:
        for k in range(10):
            t.set_split({"1": (7 * i + k) % 101, "2": 100 - (7 * i + k) % 101})

    threads = [threading.Thread(target=change, args=(t, i)) for i, t in enumerate(traffic)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_until(lambda: same(traffic), "one split in every replica", 15)


class SetWhileAdopting(Traffic):
    """A replica whose split is set by a request just as another replica's change is
    being applied here."""

    raced = False

    def adopt(self, shared, why, **kw):
        if not self.raced:
            self.raced = True
            self.set_split({"1": 33, "2": 67})
        return super().adopt(shared, why, **kw)


def test_a_change_made_while_another_s_is_applied_is_the_newer_one_everywhere(ray):
    run = f"test/{uuid.uuid4().hex}"
    (a,) = ray(1, run, kind=SetWhileAdopting)
    (b,) = ray(1, run)
    b.set_split({"1": 0, "2": 100})
    wait_until(lambda: b.split == {1: 33, 2: 67}, "the later change in replica b", 10)
    time.sleep(0.5)  # a few turns of both sharers: nothing more is to come
    assert a.raced and a.split == b.split == {1: 33, 2: 67}
    assert a.events[-1]["event"] == "split"  # b's change skipped in a


def test_a_canary_s_verdict_in_one_replica_is_every_replica_s(ray):
    a, b = ray(2, f"test/{uuid.uuid4().hex}", CanaryPolicy(min_requests=20, max_p99_ratio=1.5))
    for _ in range(20):
        a.record(1, 0.01, True)
        a.record(2, 0.5, True)  # slow in replica a: rolled back there
    assert a.state == "rolled back"
    wait_until(lambda: b.state == "rolled back", "the rollback in replica b", 10)
    assert b.split == {1: 100, 2: 0} and b.canary == 2
    for _ in range(20):  # b judges no more: its canary was rolled back
        b.record(1, 0.01, True)
        b.record(2, 0.01, True)
    assert b.split == {1: 100, 2: 0}


def test_a_trace_setting_changed_in_one_replica_is_every_replicas(real_ray):
    """Triton's trace extension on one ingress replica (``Tracing.update``): the other
    replicas, and one started later, sample by the same settings."""
    pytest.importorskip("opentelemetry.sdk", reason="needs the tracing extra")
    from servekit.ray.shared import SharedTraffic
    from servekit.tracing import Tracing

    run = f"test/{uuid.uuid4().hex}"
    tracers = [Tracing("http://127.0.0.1:9/v1/traces", rate=1.0) for _ in range(3)]
    sharers = [
        SharedTraffic(run, {}, f"replica-{i}", poll_s=0.05, tracing=t)
        for i, t in enumerate(tracers[:2])
    ]
    try:
        a, b, late = tracers
        a.update("", {"trace_level": ["OFF"]})
        a.update("add_sub", {"trace_rate": "4", "trace_level": ["TIMESTAMPS"]})
        wait_until(lambda: b.shared() == a.shared(), "the settings in replica b", 10)
        assert b.setting("").level == "OFF" and b.setting("add_sub").rate == 4
        assert not b.sample("other")  # sampled by the server's setting: off
        sharers.append(SharedTraffic(run, {}, "replica-late", poll_s=0.05, tracing=late))
        wait_until(lambda: late.shared() == a.shared(), "the settings in a late replica", 10)
        b.update("add_sub", {"trace_rate": None})  # back to the server's own: everywhere
        wait_until(lambda: a.setting("add_sub").rate == 1, "the cleared rate in replica a", 10)
    finally:
        for s in sharers:
            s.close()
        for t in tracers:
            t.shutdown()
