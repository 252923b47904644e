"""The servekit backend's pipeline (``servekit.triton.pipeline``): batches run one after
another on the device's thread and are answered in the order given, at most ``depth`` are
held at once (``submit`` waits beyond that), a run that raises answers every request of
its batch with the error, and ``close`` answers what is queued first."""

from __future__ import annotations

import threading
import time

import pytest

from servekit.triton.pipeline import Pipeline


class Recorder:
    def __init__(self, delay_s: float = 0.0, fail_on: int | None = None) -> None:
        self.delay_s, self.fail_on = delay_s, fail_on
        self.running = 0
        self.most_running = 0
        self.sent: list[tuple[list, list]] = []
        self.lock = threading.Lock()

    def run(self, inputs: list) -> list:
        with self.lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        time.sleep(self.delay_s)
        with self.lock:
            self.running -= 1
        if self.fail_on is not None and self.fail_on in inputs:
            raise RuntimeError("device fault")
        return [x * 10 for x in inputs]

    def send(self, senders: list, results: list) -> None:
        self.sent.append((senders, list(results)))


@pytest.mark.parametrize("depth", [2, 4])
def test_batches_run_one_at_a_time_and_are_answered_in_order(depth):
    rec = Recorder(delay_s=0.002)
    pipeline = Pipeline(rec.run, rec.send, depth=depth)
    for i in range(50):
        pipeline.submit([i, i + 1], [f"s{i}", f"t{i}"])
    pipeline.close()
    assert [senders for senders, _ in rec.sent] == [[f"s{i}", f"t{i}"] for i in range(50)]
    assert [results for _, results in rec.sent] == [[10 * i, 10 * i + 10] for i in range(50)]
    assert rec.most_running == 1


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_submit_waits_while_depth_batches_are_held(depth):
    release = threading.Event()
    pipeline = Pipeline(lambda inputs: (release.wait(10), inputs)[1], lambda s, r: None, depth)
    for i in range(depth):
        pipeline.submit([i], [i])  # returns at once: room for it
    blocked = threading.Thread(target=pipeline.submit, args=([depth], [depth]), daemon=True)
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive(), f"a batch past depth {depth} was taken"
    release.set()
    blocked.join(10)
    assert not blocked.is_alive()
    pipeline.close()


def test_batches_handed_over_while_one_runs_run_together_next():
    release = threading.Event()
    runs: list[list] = []

    def run(inputs: list) -> list:
        runs.append(list(inputs))
        release.wait(10)
        return inputs

    pipeline = Pipeline(run, lambda senders, results: None, depth=4)
    pipeline.submit([0], ["a"])
    time.sleep(0.2)  # the first is running
    pipeline.submit([1], ["b"])
    pipeline.submit([2, 3], ["c", "d"])
    release.set()
    pipeline.close()
    assert runs == [[0], [1, 2, 3]]


def test_a_run_that_raises_answers_its_requests_with_the_error_and_the_next_run_goes_on():
    rec = Recorder(fail_on=3)
    pipeline = Pipeline(rec.run, rec.send, depth=2)
    for inputs, senders in (([1, 2], ["a", "b"]), ([3, 4], ["c", "d"]), ([5], ["e"])):
        pipeline.submit(inputs, senders)
        deadline = time.monotonic() + 10
        while len(rec.sent) < 1 + inputs[0] // 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # each answered before the next: runs of one batch each
    pipeline.close()
    (_, first), (_, failed), (_, last) = rec.sent
    assert first == [10, 20] and last == [50]
    assert len(failed) == 2 and all(isinstance(r, RuntimeError) for r in failed)


def test_a_failed_answer_neither_stops_the_pipeline_nor_the_rest_of_its_batch():
    """A sender that raises (its request cancelled) is logged; the batch's other requests
    and every later batch are still answered, and the slot comes back."""
    from servekit.triton.pipeline import send_each

    answered: list = []

    class Sender:
        def __init__(self, name: str) -> None:
            self.name = name

        def send(self, response) -> None:
            if self.name == "gone":
                raise RuntimeError("response sender closed")
            answered.append((self.name, response))

    def send(senders, results):
        send_each(senders, results, lambda s, r: s.send(r))
        if any(s.name == "boom" for s in senders):
            raise RuntimeError("the whole send failed")

    pipeline = Pipeline(lambda inputs: inputs, send, depth=1)
    pipeline.submit([1, 2, 3], [Sender("a"), Sender("gone"), Sender("c")])
    pipeline.submit([4], [Sender("boom")])
    pipeline.submit([5], [Sender("e")])  # depth 1: waits for both slots above to return
    pipeline.close()
    assert answered == [("a", 1), ("c", 3), ("boom", 4), ("e", 5)]


def test_ahead_returns_before_its_batch_ends_so_the_next_is_queued_behind_it():
    """``ahead``: once a batch size's run time is known, ``submit`` returns while its batch
    is still running (a lead before its end), so the next batch is queued before the
    device lets the last one go; batches still run one at a time, in order, each
    answered with its own results."""
    rec = Recorder(delay_s=0.05)
    ended: list[float] = []

    def run(inputs: list) -> list:
        results = rec.run(inputs)
        ended.append(time.monotonic())
        return results

    pipeline = Pipeline(run, rec.send, ahead=True)
    returned = []
    for i in range(8):
        time.sleep(0.002)  # the hand-over
        pipeline.submit([i], [f"s{i}"])
        returned.append(time.monotonic())
    pipeline.close()
    assert [senders for senders, _ in rec.sent] == [[f"s{i}"] for i in range(8)]
    assert [results for _, results in rec.sent] == [[10 * i] for i in range(8)]
    assert rec.most_running == 1
    # The first run teaches the run time: its submit waits for the end. Later submits
    # return before their own batch ends (most of them: the lead is milliseconds, the
    # hand-over measured here, and a starved host can wake the submitter later than that;
    # without ``ahead`` none does), and every later batch was handed over while the one
    # before it ran.
    assert returned[0] >= ended[0]
    early = [returned[i] < ended[i] for i in range(2, 8)]
    assert sum(early) >= 4, (early, returned, ended)
    assert pipeline.overlapped >= 6


def test_ahead_answers_a_failed_run_per_request_and_goes_on():
    rec = Recorder(delay_s=0.01, fail_on=3)
    counted: list[int] = []
    pipeline = Pipeline(rec.run, rec.send, ahead=True, overlapped=lambda: counted.append(1))
    for inputs, senders in (([1, 2], ["a", "b"]), ([3, 4], ["c", "d"]), ([5, 6], ["e", "f"])):
        pipeline.submit(inputs, senders)
    pipeline.close()
    (_, first), (_, failed), (_, last) = rec.sent
    assert first == [10, 20] and last == [50, 60]
    assert len(failed) == 2 and all(isinstance(r, RuntimeError) for r in failed)
    assert len(counted) == pipeline.overlapped
