"""The docs' runnable shell blocks run as a newcomer would type them: every fenced block
marked ```` ```sh runnable ```` in README.md and docs/*.md runs in bash (``-euo
pipefail``) in a fresh folder beside the repository's ``k8s/`` and ``examples/``, with
the virtualenv's ``bin`` first on ``PATH``, and must exit 0. Whatever it started in the
background is stopped afterwards, even when it fails."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```sh runnable\n(?P<code>.*?)^```", re.S | re.M)
NEEDS = {"prometheus": "apt-get install -y prometheus", "moto_server": "the test extra (moto)"}
"""Programs a block may need, and where they come from (a block is skipped without one)."""


def runnable_blocks(root: Path = ROOT) -> list[tuple[str, str]]:
    """(``file:line``, code) of every runnable block."""
    found = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append((f"{path.relative_to(root)}:{line}", m["code"]))
    return found


def test_the_docs_have_runnable_blocks_and_the_finder_sees_them(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("```sh\nnot this\n```\n")
    (tmp_path / "docs" / "a.md").write_text("x\n```sh runnable\necho hi\n```\n")
    assert runnable_blocks(tmp_path) == [("docs/a.md:2", "echo hi\n")]
    where = {w.split(":")[0] for w, _ in runnable_blocks()}
    assert {"docs/storage.md", "docs/operations.md", "docs/rollout.md"} <= where


@pytest.mark.parametrize("page", ["models.md", "operations.md", "streaming.md"])
def test_a_user_page_opens_with_a_task_to_run_and_leaves_the_tests_to_development(page):
    text = (ROOT / "docs" / page).read_text()
    first = min(int(w.split(":")[1]) for w, _ in runnable_blocks() if w.startswith(f"docs/{page}:"))
    assert first <= 12, f"docs/{page}: the first runnable block starts on line {first}"
    assert "tests/" not in text, f"docs/{page} names the tests: they belong in development.md"


BLOCK_WAIT_S = 240
"""Under pytest-timeout's 300 s, so a block that hangs fails with its own output."""


@pytest.mark.parametrize(("where", "code"), runnable_blocks(), ids=lambda v: v.split("\n")[0])
def test_a_runnable_block_runs_as_written(where, code, tmp_path):
    bin_dir = Path(sys.executable).parent
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    for program, source in NEEDS.items():
        if re.search(rf"^\s*{program}\b", code, re.M) and not shutil.which(program, path=path):
            pytest.skip(f"{where} needs {program} ({source})")
    for name in ("k8s", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PATH": path, "SERVEKIT_CACHE": str(tmp_path / "cache")}
    log = tmp_path / "block.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", code],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        code_ = None
        try:
            code_ = proc.wait(timeout=BLOCK_WAIT_S)
        except subprocess.TimeoutExpired:
            pass  # a block that hangs fails with its output (SIGINT prints Python's stacks)
        finally:
            stop_group(proc.pid)
            proc.wait(timeout=10)
    said = log.read_text()[-4000:]
    assert code_ is not None, f"{where} still ran after {BLOCK_WAIT_S} s:\n{said}"
    assert code_ == 0, f"{where} exited {code_}:\n{said}"


def stop_group(pgid: int) -> None:
    """SIGINT to what the block left running (servers drain on it), SIGKILL after 30 s."""
    for sig, wait_s in ((signal.SIGINT, 30.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
