"""Recovery's decisions: a request whose worker died is sent again until its deadline, a
request in flight at two deaths is quarantined and its input refused after, suspects go
one at a time, and the counters say what happened. Attempts are scripted here; the
served runtimes, with workers really killed, are in test_recovery_served.py."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servekit.errors import PoisonInput, WorkerDied, grpc_code, http_status
from servekit.recovery import Lost, Recovery, fingerprint

OK = "answer"


class Clock:
    """A clock the test moves; ``sleep`` moves it instead of waiting."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scripted(outcomes: list[str | Lost]):
    """``send`` giving each outcome in turn (the last one again once they run out)."""
    sent: list[int] = []

    async def send() -> str | Lost:
        sent.append(1)
        return outcomes[min(len(sent) - 1, len(outcomes) - 1)]

    return send, sent


def lost(outcome: str | Lost) -> Lost | None:
    return outcome if isinstance(outcome, Lost) else None


def replay(recovery: Recovery, outcomes, *, first=None, deadline=None, live=True, key=b"k"):
    send, sent = scripted(outcomes)
    deadline = time.monotonic() + 60 if deadline is None else deadline
    result = asyncio.run(
        recovery.replay(
            "m",
            send,
            lost,
            deadline=deadline,
            key=lambda: key,
            first=first,
            first_sent_live=live,
        )  # fmt: skip
    )
    return result, len(sent)


def figures(recovery: Recovery) -> dict[str, float]:
    return {name: samples[0][1] for name, _, _, samples in recovery.figures() if samples}


def test_a_request_whose_worker_died_is_sent_again_and_answered():
    recovery = Recovery()
    result, sent = replay(recovery, [Lost.UNREACHABLE, Lost.UNREACHABLE, OK], first=Lost.IN_FLIGHT)
    assert (result, sent) == (OK, 3)
    counts = figures(recovery)
    assert counts["servekit_worker_deaths_total"] == 1
    assert counts["servekit_requests_replayed_total"] == 1
    assert counts["servekit_requests_quarantined_total"] == 0
    assert recovery.live("m")


def test_an_answer_ends_the_outage_and_its_length_is_counted():
    clock = Clock()
    recovery = Recovery(clock=clock)

    async def send() -> str | Lost:
        clock.now += 1.5  # each attempt takes 1.5 s
        return OK

    asyncio.run(
        recovery.replay("m", send, lost, deadline=60, key=lambda: b"", first=Lost.IN_FLIGHT)
    )
    assert figures(recovery)["servekit_no_live_worker_seconds_total"] == 1.5
    recovery.restarted()
    assert recovery.live("m")


def test_a_request_in_flight_at_two_deaths_is_quarantined_and_its_input_refused_after():
    recovery = Recovery(max_deaths=2)
    with pytest.raises(PoisonInput, match="died 2 times with this request in flight"):
        replay(recovery, [Lost.IN_FLIGHT], first=Lost.IN_FLIGHT, key=b"poison")
    with pytest.raises(PoisonInput):  # the same input again: refused before it is sent
        recovery.refuse_poison("m", lambda: b"poison")
    recovery.refuse_poison("m", lambda: b"another input")
    assert figures(recovery)["servekit_requests_quarantined_total"] == 2


def test_a_dead_worker_s_answer_to_a_request_sent_after_the_death_is_no_death_of_its_own():
    """tritonserver answers "stub not healthy" to everything until the restart: only a
    request sent while the worker was thought live was in flight at the death."""
    recovery = Recovery(max_deaths=2)
    recovery._lost("m")  # another request saw the worker go
    result, sent = replay(recovery, [Lost.DEAD, Lost.DEAD, OK], first=Lost.DEAD, live=False)
    assert (result, sent) == (OK, 3)
    assert figures(recovery)["servekit_requests_quarantined_total"] == 0


def test_past_its_deadline_the_request_gets_a_504_saying_the_worker_died():
    recovery = Recovery()
    with pytest.raises(WorkerDied, match="no live worker answered within the request's deadline"):
        replay(recovery, [Lost.UNREACHABLE], first=Lost.IN_FLIGHT, deadline=0.0)
    assert http_status(WorkerDied("x")) == 504 and grpc_code(WorkerDied("x")) == "DEADLINE_EXCEEDED"
    assert http_status(PoisonInput("x")) == 400


def test_the_deadline_is_the_request_s_own_timeout_else_the_server_s():
    recovery = Recovery(timeout_s=30)
    assert recovery.deadline(None, 100.0) == 130.0
    assert recovery.deadline(2_000_000, 100.0) == 102.0


def test_suspects_are_sent_one_at_a_time_so_only_the_poison_dies_twice():
    """Three requests die together; one of them kills every worker it reaches. Re-sent
    one at a time, the poison's second death is its own: it alone is quarantined."""
    recovery = Recovery(max_deaths=2)
    running, most = 0, 0

    def sender(poison: bool):
        async def send() -> str | Lost:
            nonlocal running, most
            running += 1
            most = max(most, running)
            await asyncio.sleep(0.01)
            running -= 1
            return Lost.IN_FLIGHT if poison else OK

        return send

    async def run() -> list[object]:
        calls = [
            recovery.replay(
                "m",
                sender(i == 1),
                lost,
                deadline=asyncio.get_running_loop().time() + 60,
                key=lambda i=i: bytes([i]),
                first=Lost.IN_FLIGHT,
            )  # fmt: skip
            for i in range(3)
        ]
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(run())
    assert results[0] == OK and results[2] == OK
    assert isinstance(results[1], PoisonInput)
    assert most == 1


@settings(max_examples=50, deadline=None)
@given(
    deaths=st.integers(0, 5),
    max_deaths=st.integers(1, 4),
)
def test_a_request_is_quarantined_exactly_when_its_deaths_reach_the_limit(deaths, max_deaths):
    recovery = Recovery(max_deaths=max_deaths)
    outcomes: list[str | Lost] = [Lost.IN_FLIGHT] * deaths + [OK]
    if deaths >= max_deaths:
        with pytest.raises(PoisonInput):
            replay(recovery, outcomes[1:], first=outcomes[0])
    else:
        assert replay(recovery, outcomes[1:], first=outcomes[0])[0] == OK


def test_fingerprints_tell_inputs_and_models_apart():
    assert fingerprint("a", b"x") == fingerprint("a", b"x")
    assert fingerprint("a", b"x") != fingerprint("b", b"x")
    assert fingerprint("a", b"x") != fingerprint("a", b"y")


def test_the_knobs_are_checked():
    with pytest.raises(ValueError, match="request_timeout_s must be > 0"):
        Recovery(timeout_s=0)


def test_a_suspect_whose_deadline_passes_while_it_waits_its_turn_gets_a_504():
    recovery = Recovery()

    async def slow() -> str:
        await asyncio.sleep(0.3)
        return OK

    async def run() -> list[object]:
        now = time.monotonic()
        calls = [
            recovery.replay("m", slow, lost, deadline=now + 10, key=lambda: b"a",
                            first=Lost.IN_FLIGHT),
            recovery.replay("m", slow, lost, deadline=now + 0.15, key=lambda: b"b",
                            first=Lost.IN_FLIGHT),
        ]  # fmt: skip
        return await asyncio.gather(*calls, return_exceptions=True)

    first, second = asyncio.run(run())
    assert first == OK
    assert isinstance(second, WorkerDied) and "while it waited to be re-sent" in str(second)


def test_a_pooled_connection_closed_with_the_request_sent_and_no_server_after_is_a_drop():
    """The forwarder re-sends once on a fresh connection when a reused one closes before
    any answer (an idle close). If the server is gone by then, the request was in flight
    when it died: ``Dropped`` (a death), not "not answering" (no worker yet)."""
    from servekit.front.http import Dropped, HttpForwarder

    async def run() -> object:
        requests = 0

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal requests
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(2)
                requests += 1
                if requests == 2:  # the server dies with the second request in flight
                    server.close()
                    writer.transport.abort()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        forwarder = HttpForwarder(f"http://127.0.0.1:{port}")
        request = forwarder.request_bytes("/v2/models/m/infer", b"{}")
        first = await forwarder.exchange(request)
        second = await forwarder.exchange(request)  # on the pooled connection
        await forwarder.close()
        return first, second

    first, second = asyncio.run(run())
    assert first[0] == 200  # type: ignore[index]
    assert isinstance(second, Dropped)


def test_a_connection_that_answers_what_no_request_asked_is_never_reused():
    """A server that sends a second answer after each one: the forwarder leaves that
    connection, so two requests sent together never share one connection (the first's
    caller would wait for good and the second get the first's answer)."""
    from servekit.front.http import HttpForwarder

    async def run() -> list[object]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with (
                contextlib.closing(writer),
                contextlib.suppress(ConnectionError, asyncio.IncompleteReadError),
            ):
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(re.search(rb"Content-Length: (\d+)", head)[1])  # type: ignore[index]
                    body = await reader.readexactly(length)
                    for answer in (body, b"stale " + body):
                        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                                     % (len(answer), answer))  # fmt: skip
                    await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        forwarder = HttpForwarder(f"http://127.0.0.1:{port}")
        path = "/v2/models/m/infer"
        try:
            answers = [await forwarder.exchange(forwarder.request_bytes(path, b"1"))]
            await asyncio.sleep(0.2)  # the stale answer arrives on the idle connection
            together = [
                forwarder.exchange(forwarder.request_bytes(path, b"%d" % k)) for k in (2, 3)
            ]
            answers += await asyncio.wait_for(asyncio.gather(*together), 10)
            return answers
        finally:
            await forwarder.close()
            server.close()

    answers = asyncio.run(run())
    assert [a[1] for a in answers] == [b"1", b"2", b"3"]  # type: ignore[index]


def test_a_tensors_key_tells_names_shapes_and_data_apart_and_is_made_only_when_asked():
    import numpy as np

    from servekit.recovery import tensors_key

    x = np.arange(4, dtype=np.float32)
    same = tensors_key("m", "", {"x": x.copy()})()
    assert tensors_key("m", "", {"x": x})() == same
    assert tensors_key("m", "", {"x": x.reshape(2, 2)})() != same
    assert tensors_key("m", "", {"y": x})() != same
    assert tensors_key("m", "2", {"x": x})() != same
    assert tensors_key("m", "", {"x": x[::-1]})() != same  # a strided view, hashed as its values

    class Counted(dict):  # a mapping that counts reads: the key reads nothing until called
        reads = 0

        def __getitem__(self, name):
            Counted.reads += 1
            return super().__getitem__(name)

    key = tensors_key("m", "", Counted(x=x))
    assert Counted.reads == 0
    key()
    assert Counted.reads == 1
