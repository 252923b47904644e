"""``servekit.bench.cpu``: a server's CPU per process, as the benchmarks read it."""

from __future__ import annotations

import subprocess
import sys
import time

from servekit.bench.cpu import title, tree_cpu_by_title, tree_cpu_s


def test_a_tree_s_cpu_is_summed_by_what_each_process_calls_itself():
    spin = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"
    child = subprocess.Popen(
        [sys.executable, "-c", spin + "time.sleep(30)"]  # spins, then waits to be read
    )
    try:
        deadline = time.monotonic() + 20
        while tree_cpu_s(child.pid) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        by_title = tree_cpu_by_title(child.pid)
        assert title(child.pid) == sys.executable.rsplit("/", 1)[-1]
        assert set(by_title) == {title(child.pid)}
        assert by_title[title(child.pid)] >= 0.25
    finally:
        child.kill()
        child.wait()
