"""The Supervisor's restarts: the first at once, each further one within the window after
twice the last wait, a restart that itself fails said and retried, and a runtime that
keeps dying given up on with the count and the window. The runtime here is a small real
one: its 'process' dies when the test says, and its restart can fail."""

from __future__ import annotations

import itertools
import threading
import time

from servekit.runtime.supervisor import Supervisor


class Flaky:
    """A runtime whose process dies ``deaths`` times, at once after each (re)start;
    ``failing_restarts`` of its restarts raise."""

    def __init__(self, deaths: int, failing_restarts: int = 0) -> None:
        self.deaths, self.failing = deaths, failing_restarts
        self.dead = False
        self.restarted_at: list[float] = []
        self.stopped = False

    def start(self) -> Flaky:
        self.dead = self.deaths > 0
        return self

    def problem(self) -> str | None:
        return "worker killed by SIGKILL" if self.dead else None

    def restart(self) -> None:
        self.restarted_at.append(time.monotonic())
        if self.failing:
            self.failing -= 1
            raise OSError("port 8000 still in use")
        self.deaths -= 1
        self.dead = self.deaths > 0

    def reload(self) -> list[str]:
        return []

    def stop(self) -> None:
        self.stopped = True


def supervise(runtime: Flaky, **kwargs) -> tuple[Supervisor, list[str], threading.Thread]:
    events: list[str] = []
    sup = Supervisor(runtime, check_s=0.01, on_event=events.append, backoff_s=0.1, **kwargs)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(sup.run()))
    thread.start()
    thread.result = result  # type: ignore[attr-defined]
    return sup, events, thread


def test_restarts_back_off_and_a_failed_restart_is_said_and_retried():
    runtime = Flaky(deaths=3, failing_restarts=1)
    sup, events, thread = supervise(runtime, max_restarts=10)
    deadline = time.monotonic() + 10
    while runtime.dead and time.monotonic() < deadline:
        time.sleep(0.01)
    sup.request_stop()
    thread.join(10)
    assert not runtime.dead and runtime.stopped and thread.result == [0]
    gaps = [b - a for a, b in itertools.pairwise(runtime.restarted_at)]
    assert len(runtime.restarted_at) == 4  # one failed restart, then three that worked
    for gap, wait in zip(gaps, (0.1, 0.2, 0.4), strict=True):
        assert gap >= wait, (gaps, events)
    assert events[1] == "worker killed by SIGKILL; restarting (1/10)"
    assert "restart failed: OSError: port 8000 still in use" in events
    assert "worker killed by SIGKILL; restarting in 0.1 s (2/10)" in events
    assert "worker killed by SIGKILL; restarting in 0.4 s (4/10)" in events


def test_a_runtime_that_keeps_dying_is_given_up_on_naming_the_count_and_window():
    runtime = Flaky(deaths=100)
    sup, events, thread = supervise(runtime, max_restarts=3, restart_window_s=60)
    thread.join(20)
    assert thread.result == [1] and runtime.stopped
    assert events[-1] == "worker killed by SIGKILL; gave up after 3 restart(s) within 60 s"


def test_restarts_older_than_the_window_no_longer_count():
    runtime = Flaky(deaths=4)
    sup, events, thread = supervise(runtime, max_restarts=2, restart_window_s=0.05)
    deadline = time.monotonic() + 10
    while runtime.dead and time.monotonic() < deadline:
        time.sleep(0.01)
    sup.request_stop()
    thread.join(10)
    assert thread.result == [0] and not any("gave up" in e for e in events), events
