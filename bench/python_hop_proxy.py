"""One Python hop in front of tritonserver's HTTP port, for bench/python_hop.py.

    python bench/python_hop_proxy.py KIND PORT UPSTREAM_PORT [uvloop] [check]

KIND: ``uvicorn`` (an ASGI app forwarding the body with servekit's ``HttpForwarder``),
``raw`` (asyncio Protocols and httptools, a task per request, the bytes passed through)
or ``front`` (servekit's ``Front`` over ``add_sub``). ``uvloop``: run on uvloop;
``check``: the raw hop also parses the JSON header and checks each input's datatype.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httptools

KIND, PORT, UP = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
UVLOOP, CHECK = "uvloop" in sys.argv, "check" in sys.argv


def serve_uvicorn() -> None:
    import uvicorn

    from servekit.front.http import HttpForwarder

    pool: dict[int, HttpForwarder] = {}

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        forwarder = pool.setdefault(0, HttpForwarder(f"http://127.0.0.1:{UP}"))
        length = dict(scope["headers"]).get(b"inference-header-content-length")
        extra = {"inference-header-content-length": length.decode()} if length else {}
        status, data, headers = await forwarder.post(scope["path"], body, extra)
        out = [(k.encode(), v.encode()) for k, v in headers.items()]
        out.append((b"content-length", str(len(data)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": data})

    uvicorn.run(
        app, host="127.0.0.1", port=PORT, log_level="warning", access_log=False,
        loop="uvloop" if UVLOOP else "asyncio",
    )  # fmt: skip


def serve_front() -> None:
    from servekit import zoo
    from servekit.front import Front
    from servekit.runners import load_runner

    spec = load_runner(str(zoo.resolve("add_sub"))).spec
    Front(
        {"add_sub": spec}, "127.0.0.1:1", host="127.0.0.1", port=PORT, ready=lambda: True,
        http_url=f"http://127.0.0.1:{UP}",
    ).start()  # fmt: skip
    while True:
        time.sleep(100)


class Upstream(asyncio.Protocol):
    """One pooled connection to tritonserver."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def on_message_begin(self) -> None:
        self.body: list[bytes] = []
        self.headers: list[tuple[bytes, bytes]] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        waiter, self.waiter = self.waiter, None
        waiter.set_result((self.parser.get_status_code(), self.headers, b"".join(self.body)))

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)


IDLE: list[Upstream] = []


async def post(path: bytes, extra: bytes, body: bytes):
    loop = asyncio.get_running_loop()
    if IDLE:
        conn = IDLE.pop()
    else:
        _, conn = await loop.create_connection(Upstream, "127.0.0.1", UP)
    conn.waiter = loop.create_future()
    conn.transport.write(
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s"
        % (path, len(body), extra, body)
    )
    answer = await conn.waiter
    IDLE.append(conn)
    return answer


class Downstream(asyncio.Protocol):
    """One client connection: each request forwarded as it came."""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)

    def on_message_begin(self) -> None:
        self.body: list[bytes] = []
        self.length: bytes | None = None

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"inference-header-content-length":
            self.length = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        asyncio.ensure_future(self.handle(self.url, self.length, b"".join(self.body)))

    async def handle(self, url: bytes, length: bytes | None, body: bytes) -> None:
        if CHECK:
            header = json.loads(body[: int(length)] if length else body)
            for tensor in header["inputs"]:
                assert tensor["datatype"] == "FP32"
        extra = b"Inference-Header-Content-Length: %s\r\n" % length if length else b""
        status, headers, data = await post(url, extra, body)
        kind = next((v for k, v in headers if k.lower() == b"content-type"), b"application/json")
        split = next(
            (v for k, v in headers if k.lower() == b"inference-header-content-length"), None
        )
        head = b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\n" % (status, kind)
        if split:
            head += b"inference-header-content-length: %s\r\n" % split
        self.transport.write(head + b"content-length: %d\r\n\r\n" % len(data) + data)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)


async def serve_raw() -> None:
    server = await asyncio.get_running_loop().create_server(Downstream, "127.0.0.1", PORT)
    await server.serve_forever()


if __name__ == "__main__":
    if KIND == "uvicorn":
        serve_uvicorn()
    elif KIND == "front":
        serve_front()
    elif UVLOOP:
        import uvloop

        uvloop.run(serve_raw())
    else:
        asyncio.run(serve_raw())
