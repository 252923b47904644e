"""The README's first contact, run as written: `make serve`'s command line, then the
"First request" commands and Python against it, and the configuration example, so the
README cannot drift from the code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import free_port
from servekit import Client, ServeConfig
from servekit.config import RUNTIMES

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SERVEKIT = f"{sys.executable} -m servekit"


def section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", README, re.S | re.M)
    assert match, f"README has no section {title!r}"
    return match.group(1)


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def make_serve_command() -> list[str]:
    """The command `make serve` runs (its last line), as this interpreter runs it."""
    lines = subprocess.run(
        ["make", "-n", "-s", "serve"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    command = lines[-1].split()
    assert command[0].endswith("/servekit") and command[1] == "serve", lines
    return [sys.executable, "-m", "servekit", *command[1:]]


@pytest.fixture(scope="module")
def make_serve(model_cache):
    pytest.importorskip("pytriton")
    http, grpc = free_port(), free_port()
    command = make_serve_command() + [
        "--host", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc),
        "--metrics-port", str(free_port()),
    ]  # fmt: skip
    env = {**os.environ, "SERVEKIT_CACHE": str(model_cache)}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with Client(f"http://127.0.0.1:{http}") as c:
            c.wait_ready("efficientnet_lite0_image", timeout_s=240)
            c.wait_ready("resnet50_image", timeout_s=120)
        yield http, grpc, env
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert "serving: SIGHUP reloads" in text
    # Known-harmless tritonserver lines are explained once, not repeated at every load.
    assert text.count("Failed to set config modification time") <= 1, text[-3000:]


def localize(command: str, http: int, grpc: int) -> str:
    return (
        command.replace("localhost:8000", f"127.0.0.1:{http}")
        .replace("localhost:8001", f"127.0.0.1:{grpc}")
        .replace(".venv/bin/servekit", SERVEKIT)
    )


def test_make_serve_answers_the_cat_with_a_cat(make_serve):
    http, _, env = make_serve
    done = subprocess.run(
        [*SERVEKIT.split(), "infer", "--sample", "cat", "--url", f"http://127.0.0.1:{http}",
         "--json"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (predictions,) = json.loads(done.stdout).values()
    assert "cat" in predictions[0]["label"], predictions


def test_the_first_request_commands_run_as_written(make_serve):
    http, grpc, env = make_serve
    (commands,) = blocks(section("First request"), "sh")
    outputs = []
    for line in commands.strip().splitlines():
        done = subprocess.run(
            localize(line, http, grpc), shell=True, capture_output=True, text=True,
            timeout=120, cwd=ROOT, env=env,
        )  # fmt: skip
        assert done.returncode == 0, f"{line}\n{done.stdout}{done.stderr}"
        outputs.append(done.stdout)
    assert outputs[0].strip() == "200"
    assert json.loads(outputs[1])["name"] == "efficientnet_lite0_image"
    assert "cat" in outputs[2] and "espresso" in outputs[3]


def test_the_first_request_python_runs_as_written(make_serve, capsys):
    http, _, _ = make_serve
    (code,) = blocks(section("First request"), "python")
    exec(localize(code, http, 0), {})
    assert "cat" in capsys.readouterr().out


def test_the_configuration_example_is_the_file_and_every_runtime_takes_it():
    (shown,) = blocks(section("One configuration"), "toml")
    path = ROOT / "examples" / "serve.toml"
    assert tomllib.loads(shown) == tomllib.loads(path.read_text())
    config = ServeConfig.load(path)
    for runtime in RUNTIMES:
        config.replace(runtime=runtime).check()
    for line in blocks(section("One configuration"), "sh")[0].strip().splitlines():
        assert line.startswith("servekit ") and "--config examples/serve.toml" in line


def test_the_configuration_example_serves_natively(model_cache):
    import numpy as np

    from servekit.native import NativeServer
    from servekit.samples import sample

    config = ServeConfig.load(ROOT / "examples" / "serve.toml").replace(
        runtime="native", cache_dir=str(model_cache)
    )
    config = config.on_loopback()
    with NativeServer(config), Client(config.server.http_url) as c:
        top = c.classify([sample("coffee")], model="efficientnet_lite0_image")[0][0]
        assert top.label == "espresso"
        x = np.arange(16, dtype=np.float32)[None]
        out = c.infer("add_sub", {"INPUT0": x, "INPUT1": x})
        np.testing.assert_array_equal(out["OUTPUT0"], 2 * x)


def test_the_readme_is_a_guide_not_a_log():
    # What it is, the two commands, a first request, which runtime, links: figures and
    # matrices live in docs/ and BENCHMARKS.md, but for the runtime choice's costs,
    # each one measured there.
    assert len(README.splitlines()) <= 150
    assert README.count("| ---: |") == 1  # one figure table: which runtime
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    measured = benchmarks[benchmarks.index("## Your own Python code") :]
    costs = re.findall(r"\| ([\d,]+) us \|", section("Which runtime"))
    assert len(costs) == 4, costs
    for cost in costs:  # at concurrency 8: "| 8 | ... | <cost> |"
        assert re.search(rf"\| 8 \|[^\n]*\| {cost.replace(',', '')} \|", measured), cost


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped
    (hyphens and underscores kept), spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_benchmarks_is_a_reference_each_figure_with_a_command_and_the_docs_link_to_it():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) < 1000
    headings = re.findall(r"^#{2,3} (.+)$", text, re.M)
    assert not [h for h in headings if re.search(r"session \d|rerun", h, re.I)], headings
    # Every section with a table of figures shows the command that measured them.
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        if "| ---" in part:
            assert "```sh" in part, part.splitlines()[0]
    anchors = {github_anchor(h) for h in headings}
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
    links = [
        (page.name, anchor)
        for page in pages
        for anchor in re.findall(r"BENCHMARKS\.md#([\w\-]+)", page.read_text())
    ] + [("BENCHMARKS.md", a) for a in re.findall(r"\]\(#([\w\-]+)\)", text)]
    assert links and not [(p, a) for p, a in links if a not in anchors]
