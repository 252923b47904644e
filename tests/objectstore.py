"""Real object stores on loopback for the tests: moto's standalone S3 server and a GCS
emulator, each a process of its own, and a proxy in front of one that misbehaves the way a
store or a network does (a short body, a flipped byte, a connection that dies mid-body)."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from conftest import free_port, wait_until

# moto accepts any key unless told otherwise; the SDKs only need some to sign with.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "servekit-test",
    "AWS_SECRET_ACCESS_KEY": "servekit-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _bin(name: str) -> str:
    path = Path(sys.executable).with_name(name)
    return str(path) if path.exists() else shutil.which(name) or name


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def _serving(argv: list[str], what: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """``argv`` (given the port to take) as a process on a free loopback port; yields its
    URL once it listens, and always stops it."""
    port = free_port()
    proc = subprocess.Popen(
        [a.format(port=port) for a in argv], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(lambda: _listening(port), f"{what} listening", 60,
                   alive=lambda: proc.poll() is None)  # fmt: skip
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def moto_server(*, auth: bool = False) -> contextlib.AbstractContextManager[str]:
    """moto's S3 server; with ``auth`` it checks credentials from the first request on
    (and knows no key)."""
    env = {**os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if auth else {})}
    return _serving([_bin("moto_server"), "-H", "127.0.0.1", "-p", "{port}"], "moto_server", env)


def gcs_emulator() -> contextlib.AbstractContextManager[str]:
    """gcp-storage-emulator, in memory."""
    argv = [_bin("gcp-storage-emulator"), "start", "--host", "127.0.0.1", "--port", "{port}",
            "--in-memory"]  # fmt: skip
    return _serving(argv, "the GCS emulator")


class FaultyProxy:
    """An HTTP proxy to ``upstream`` whose object bodies (GETs of more than 1 kB) are
    passed whole (``mode = "pass"``), cut short with a matching Content-Length
    (``"short"``), with one byte flipped (``"flip"``), or cut mid-body with the full
    Content-Length announced and the connection closed (``"die"``); a faulty body comes
    without the store's own checksum headers."""

    def __init__(self, upstream: str) -> None:
        self.mode = "pass"
        self.bodies = 0
        host, port = upstream.removeprefix("http://").split(":")
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                return None

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                up = http.client.HTTPConnection(host, int(port), timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                up.request(self.command, self.path, body=body, headers=headers)
                answer = up.getresponse()
                data = answer.read()
                up.close()
                object_body = self.command == "GET" and len(data) > 1024
                mode = proxy.mode if object_body else "pass"
                if object_body:
                    proxy.bodies += 1
                if mode == "short":
                    data = data[: len(data) // 2]
                elif mode == "flip":
                    data = data[:100] + bytes([data[100] ^ 0xFF]) + data[101:]
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    # botocore checks a body against these when present; many S3-compatible
                    # stores send none, and then servekit's own checks are all there is.
                    if mode != "pass" and k.lower().startswith("x-amz-checksum-"):
                        continue
                    if k.lower() not in ("content-length", "connection", "transfer-encoding",
                                         "date", "server"):  # fmt: skip
                        self.send_header(k, v)
                length = answer.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", str(length or len(data)))
                if mode == "die":
                    self.send_header("Connection", "close")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data if mode != "die" else data[: len(data) // 2])
                if mode == "die":
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _relay

        self.port = free_port()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultyProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
