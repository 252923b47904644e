"""The triton front passes a load or unload on to tritonserver and waits as long as the
load takes, without holding what other calls wait on. tritonserver's private port is a
socket server here that never answers a load (one hung on a stub), so the front's own
threads and waits are what is tested; the real load through the front is in
test_triton_backend.py."""

from __future__ import annotations

import asyncio
import contextlib

from servekit.front.private import triton_fetch


def test_slow_loads_hold_no_thread_that_other_calls_need():
    """More loads pending than the loop has worker threads (at most 32): a readiness
    call passed on meanwhile is answered at once, and the loads, answered later, each
    get their own answer."""

    async def run() -> tuple[list[object], tuple[int, bytes, dict[str, str]]]:
        release = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.closing(writer), contextlib.suppress(ConnectionError):
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ")[1]
                if path.endswith(b"/load"):
                    await release.wait()  # a load takes as long as the test says
                body = b'{"path": "%s"}' % path
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))  # fmt: skip
                await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=128)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            loads = [
                asyncio.create_task(
                    triton_fetch(url, {}, "POST", f"/v2/repository/models/m{k}/load", control=True)
                )
                for k in range(40)
            ]
            await asyncio.sleep(0.5)  # every load is with the server by now
            ready = await asyncio.wait_for(triton_fetch(url, {}, "GET", "/v2/health/ready"), 5)
            release.set()
            answers = await asyncio.wait_for(asyncio.gather(*loads), 10)
            return answers, ready
        finally:
            server.close()

    answers, ready = asyncio.run(run())
    assert ready[0] == 200 and b"/v2/health/ready" in ready[1]
    assert [a[1] for a in answers] == [  # type: ignore[index]
        b'{"path": "/v2/repository/models/m%d/load"}' % k for k in range(40)
    ]
