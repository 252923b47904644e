"""tritonserver's log on the console: known-harmless lines explained once, errors kept;
and its private folder frees what its stubs held."""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid
from pathlib import Path

from servekit.triton.logs import LogFollower, Workdir, filter_line

START = """\
W1123 13:44:21.880105 675 pinned_memory_manager.cc:273] "Unable to allocate pinned system memory, pinned memory pool will not be available: CUDA driver version is insufficient"
E1123 13:44:21.880352 675 server.cc:241] "CudaDriverHelper has not been initialized."
I1123 13:44:21.880648 675 server.cc:604]
+------------------+------+
| Repository Agent | Path |
+------------------+------+

E1123 13:44:22.898288 675 model_repository_manager.cc:470] "Failed to set config modification time: model_config_content_name_ is empty"
I1123 13:44:22.901295 675 model_lifecycle.cc:472] "loading: tiny_cnn:1"
E1123 13:44:25.020320 675 model_repository_manager.cc:470] "Failed to set config modification time: model_config_content_name_ is empty"
E1123 13:44:26.000000 675 model_lifecycle.cc:641] "failed to load 'broken': model.onnx does not exist"
W1123 13:44:27.000000 675 metrics.cc:1] "an unknown warning"
"""


def test_harmless_lines_are_explained_once_and_errors_stay():
    explained: set[str] = set()
    out = [r for line in START.splitlines() if (r := filter_line(line, explained))]
    texts = [t for _, t in out]
    assert sum("Failed to set config modification time" in t for t in texts) == 1
    assert all("harmless" in t or "CPU serving" in t for t in texts[:3])
    assert (logging.INFO, "tritonserver: loading: tiny_cnn:1") in out
    assert (
        logging.ERROR,
        "tritonserver: failed to load 'broken': model.onnx does not exist",
    ) in out
    assert out[-1] == (logging.WARNING, "tritonserver: an unknown warning")
    assert not any("Repository Agent" in t or t.endswith(": ") for t in texts)


def test_a_crash_s_own_lines_are_errors():
    """Triton's Python backend aborting (triton-inference-server/server#8882) prints in no
    format of Triton's; those lines are what says why tritonserver died."""
    crash = [
        "terminate called after throwing an instance of 'boost::interprocess::lock_exception'",
        "  what():  boost::interprocess::lock_exception",
        "Signal (6) received.",
    ]
    assert [filter_line(line, set()) for line in crash] == [
        (logging.ERROR, f"tritonserver: {line}") for line in crash
    ]
    for line in ("a stub's own print", "Signal (15) received."):  # the second: a stop
        assert filter_line(line, set()) == (logging.INFO, f"tritonserver: {line}")


class Kept(logging.Handler):
    """The records a logger passes, kept."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_the_follower_logs_a_growing_file_and_everything_when_verbose(tmp_path):
    # The follower's own logger, with a handler of the test's: what the root logger and
    # its handlers are (libraries configure logging in this process) is no part of it.
    logger = logging.getLogger("servekit.tritonserver")
    was = (logger.level, logger.disabled)
    # logging.disable(level) mutes every logger whatever its own level; an earlier test
    # or library may leave it set (this test has dropped every line in two full runs).
    muted = logging.root.manager.disable
    path = tmp_path / "tritonserver.log"
    for verbose, expected in ((False, 6), (True, len(START.splitlines()))):
        kept = Kept()
        logger.addHandler(kept)
        logger.setLevel(logging.INFO)
        logger.disabled = False
        logging.disable(logging.NOTSET)
        try:
            path.write_text("")
            follower = LogFollower(path, verbose=verbose, interval_s=0.01).start()
            with path.open("a") as f:
                f.write(START)
            follower.stop()
        finally:
            logger.removeHandler(kept)
            logger.setLevel(was[0])
            logger.disabled = was[1]
            logging.disable(muted)
        assert len(kept.records) == expected, [r.getMessage() for r in kept.records]


MAPS = """import mmap, sys, time
held = [open("/dev/shm/" + n, "r+b") for n in sys.argv[1:]]
maps = [mmap.mmap(f.fileno(), 0) for f in held]
print("mapped", flush=True)
time.sleep(60)
"""


def test_a_stub_region_the_server_maps_is_freed_though_no_stub_names_it():
    """tritonserver makes and maps a stub's region before it starts the stub (a new one,
    or a replacement for a dead one): killed in between, no stub names the region. The
    workdir notes what the server maps and frees it with the rest; a client's registered
    system shared memory, which tritonserver maps too, is never touched."""
    tag = uuid.uuid4().hex
    stub_region, client_region = f"triton_servekit_backend_shm_region_{tag}", f"client-{tag}"
    for name in (stub_region, client_region):
        Path("/dev/shm", name).write_bytes(b"\0" * 4096)
    server = subprocess.Popen(
        [sys.executable, "-c", MAPS, stub_region, client_region], stdout=subprocess.PIPE
    )
    workdir = Workdir("servekit-test-")
    try:
        assert server.stdout is not None and server.stdout.readline() == b"mapped\n"
        assert workdir.stubs(server.pid) == {}  # no stub runs, yet the region is noted
    finally:
        server.kill()
        server.communicate()
        workdir.close()
        kept = Path("/dev/shm", client_region).exists()
        Path("/dev/shm", client_region).unlink(missing_ok=True)
    assert not Path("/dev/shm", stub_region).exists()
    assert kept
