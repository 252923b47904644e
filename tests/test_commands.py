"""The real commands as a user runs them: `servekit serve` and `servekit triton` in their own
processes, reached over loopback, stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="needs the triton extra")

from conftest import free_port, wait_until
from servekit import OnnxRuntimeRunner
from servekit.client import Client
from servekit.runtime.processes import processes
from servekit.triton.repo import build_repository, reference_repository
from servekit.zoo.tiny import build_tiny_cnn


def spawn(argv: list[str], stdout=subprocess.PIPE, cwd: Path | None = None) -> subprocess.Popen:
    """``argv`` in its own process; with a pipe, a thread keeps what it prints as it comes
    (``output()``), so a test can wait for a line."""
    proc = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.STDOUT, cwd=cwd)
    if stdout is subprocess.PIPE:
        lines: list[bytes] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, b"")))
        reader.start()
        proc.reader = reader
        proc.output = lambda: b"".join(list(lines)).decode(errors="replace")
    return proc


def running(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` still runs; if not, what it printed is shown with the failure."""
    if proc.poll() is None:
        return True
    print(proc.output()[-3000:])
    return False


def wait_ready(url: str, model: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    with Client(url) as c:
        wait_until(
            lambda: c.is_ready(model), f"{model} ready", timeout_s, alive=lambda: running(proc)
        )


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.reader.join(30)
            proc.stdout_text = proc.output()
            proc.stdout.close()


def test_serve_command_with_a_config_file_reloads_its_model_on_sighup(tmp_path, tiny_cnn_path):
    http = free_port()
    model = tmp_path / "tiny_cnn.onnx"
    shutil.copyfile(tiny_cnn_path, model)
    config = tmp_path / "serve.toml"
    config.write_text(
        f"""
model = "{model}"
top_k = 3
[server]
host = "127.0.0.1"
http_port = {http}
grpc_port = {free_port()}
metrics_port = {free_port()}
[batching]
max_batch_size = 4
max_queue_delay_us = 1000
"""
    )
    proc = spawn([sys.executable, "-m", "servekit.cli", "serve", "--config", str(config)])
    try:
        wait_ready(f"http://127.0.0.1:{http}", "tiny_cnn_image", proc)
        with Client(f"http://127.0.0.1:{http}") as c:
            preds = c.classify([_jpeg()], model="tiny_cnn_image")
            assert len(preds[0]) == 3
            meta = c.metadata("tiny_cnn")
            assert meta["inputs"][0]["shape"] == [-1, 3, 32, 32]
        # By default the public HTTP port is servekit's front, not Triton's own endpoint.
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2", timeout=10) as r:
            assert json.loads(r.read())["name"] == "servekit"
        reload_on_sighup(proc, f"http://127.0.0.1:{http}", "tiny_cnn", model)
        # A model's worker process (its Python backend stub) dies: tritonserver 2.51 keeps
        # calling the model ready and fails its requests, so servekit restarts Triton.
        (stub,) = [
            pid for pid, argv in processes("/").items() if argv[0].endswith("triton_python_backend_stub")
            and "tiny_cnn_0_0" in argv and _descends_from(pid, proc.pid)
        ]  # fmt: skip
        os.kill(stub, signal.SIGKILL)
        with Client(f"http://127.0.0.1:{http}") as c:
            x = {"input": np.zeros((1, 3, 32, 32), np.float32)}
            wait_until(lambda: c.infer("tiny_cnn", x), "an answer after the restart", 90,
                       alive=lambda: running(proc))  # fmt: skip
    finally:
        code = stop(proc)
    assert code == 0
    log = proc.stdout_text
    assert "tiny_cnn: reloaded from" in log and "(reload 1)" in log
    assert "reload failed, the serving version stays" in log and "tiny_cnn.onnx" in log
    assert "model instance(s) ['tiny_cnn_0_0']: worker process died; restarting (1/5)" in log
    # Into a pipe: whole lines, and PyTriton's own banner and chatter stay at debug level.
    assert "; ready once every model is loaded\n" in log.split("starting the pytriton", 1)[1]
    assert log.split("starting the pytriton", 1)[1].index("\n") > 120
    for chatter in ("Patch ModelClient", "Infer function available", "Read more about"):
        assert chatter not in log, chatter


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return False


def reload_on_sighup(proc: subprocess.Popen, url: str, name: str, model: Path) -> None:
    """Put tiny_cnn with other weights in place of ``model`` whole, SIGHUP: the server
    answers with the new weights; then a file that does not load: the new weights stay."""
    x = {"input": np.ones((1, 3, 32, 32), np.float32)}
    with OnnxRuntimeRunner(model) as one:
        before = one.infer(x)["logits"]
    replace(model, build_tiny_cnn(seed=1).SerializeToString())
    with OnnxRuntimeRunner(model) as two:
        after = two.infer(x)["logits"]
    proc.send_signal(signal.SIGHUP)
    with Client(url) as c:
        wait_until(
            lambda: not np.allclose(c.infer(name, x)["logits"], before, rtol=1e-5),
            "the model swapped in on SIGHUP", 120,
        )  # fmt: skip
        np.testing.assert_allclose(c.infer(name, x)["logits"], after, rtol=1e-5)
        replace(model, b"not a model")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "reload failed" in proc.output(), "the failed reload reported", 60)
        np.testing.assert_allclose(c.infer(name, x)["logits"], after, rtol=1e-5)


def replace(path: Path, data: bytes) -> None:
    """Write ``data`` next to ``path`` and rename it over, so a reader never sees half."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _jpeg() -> bytes:
    from servekit.stages import synthetic_image

    return synthetic_image(0)


def triton_cli(repo, http: int, *flags: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    """``servekit triton`` on ``repo`` in its own process, HTTP on ``http``."""
    return spawn(
        [sys.executable, "-m", "servekit.cli", "triton", "--model-repository", str(repo), "--host", "127.0.0.1",
         "--http-port", str(http), "--grpc-port", str(free_port()), "--metrics-port", str(free_port()), *flags],
        stdout,
    )  # fmt: skip


def post_json(port: int, path: str, body: dict) -> tuple[int, dict]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=json.dumps(body))
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


HOSTILE = {  # aborts tritonserver 2.51 (SIGABRT) when it reaches its own HTTP port
    "inputs": [
        {"name": "input", "datatype": "FP32", "shape": [100000000, 3, 32, 32], "data": [0.0]}
    ]
}


def test_triton_command_serves_the_repository_behind_the_front(
    tmp_path, model_cache, tiny_cnn_path
):
    from servekit.triton.repo import runner_model

    repo = tmp_path / "repo"
    build_repository(
        repo, [*reference_repository(), runner_model("tiny", tiny_cnn_path)], cache_dir=model_cache
    )
    http = free_port()
    proc = triton_cli(repo, http)
    try:
        wait_ready(f"http://127.0.0.1:{http}", "resnet50_ensemble", proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2", timeout=10) as r:
            assert json.loads(r.read())["name"] == "servekit"
        with Client(f"http://127.0.0.1:{http}") as c:
            out = c.infer("resnet50_ensemble", {"image": np.array([[_jpeg()]], dtype=object)})
            assert out["scores"].shape == (1, 5)
        # The request that aborts tritonserver is a 400 from the front, checked against the
        # spec the front read from Triton's model config; Triton never sees it.
        status, payload = post_json(http, "/v2/models/tiny/infer", HOSTILE)
        assert status == 400 and "claims 307200000000 elements" in payload["error"], payload
        ok = {
            "inputs": [
                {"name": "input", "datatype": "FP32", "shape": [1, 3, 32, 32], "data": [0.5] * 3072}
            ]
        }
        status, payload = post_json(http, "/v2/models/tiny/versions/1/infer", ok)
        assert status == 200 and payload["model_version"] == "1", payload
        status, payload = post_json(http, "/v2/models/tiny/versions/7/infer", ok)
        assert status == 404 and "7" in payload["error"], payload
        status, payload = post_json(http, "/v2/models/nothing/infer", ok)
        assert status == 404 and "nothing" in payload["error"], payload
        assert proc.poll() is None and len(_tritonservers(repo)) == 1
    finally:
        code = stop(proc)
    assert code == 0


def test_serve_command_refuses_a_bad_config(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[batching]\nmax_batch = 4\n")
    result = subprocess.run(
        [sys.executable, "-m", "servekit.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "max_batch" in result.stdout + result.stderr


def _tritonservers(repo: Path) -> list[int]:
    """PIDs of tritonserver processes serving ``repo`` (by their command line)."""
    from pathlib import Path

    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            flag = f"--model-repository={Path(repo).resolve()}".encode()
            if argv[0].endswith(b"tritonserver") and flag in argv:
                found.append(int(entry.name))
    return found


def test_sigterm_while_triton_is_still_starting_stops_it_cleanly(tmp_path, model_cache):
    repo = tmp_path / "repo"
    build_repository(repo, reference_repository(), cache_dir=model_cache)
    http = free_port()
    proc = triton_cli(repo, http)
    wait_until(lambda: _tritonservers(repo), "a tritonserver (still loading)", 60,
               alive=lambda: running(proc))  # fmt: skip
    assert stop(proc) == 0
    assert _tritonservers(repo) == []


def test_a_tritonserver_that_crashes_is_restarted_and_reported(tmp_path, tiny_cnn_path):
    """The JSON request that aborts tritonserver 2.51 (SIGABRT) straight on its own port
    (``--no-front``): `servekit triton` starts it again on the same ports and says why."""
    import http.client
    import json

    from servekit.triton.repo import runner_model

    build_repository(tmp_path / "repo", [runner_model("tiny", tiny_cnn_path)])
    port = free_port()
    log = tmp_path / "cli.log"
    with log.open("wb") as out:
        proc = triton_cli(tmp_path / "repo", port, "--no-front", stdout=out)
    url = f"http://127.0.0.1:{port}"
    x = {"input": np.zeros((1, 3, 32, 32), np.float32)}
    try:
        wait_ready(url, "tiny", proc)
        (first,) = _tritonservers(tmp_path / "repo")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            conn.request("POST", "/v2/models/tiny/infer", body=json.dumps(HOSTILE))
            conn.getresponse()
        conn.close()
        wait_until(
            lambda: _tritonservers(tmp_path / "repo") not in ([], [first]),
            "a new tritonserver in place of the crashed one", 60,
        )  # fmt: skip
        wait_ready(url, "tiny", proc)
        with Client(url) as c:
            assert c.infer("tiny", x)["logits"].shape == (1, 10)
    finally:
        code = stop(proc)
    assert code == 0
    assert "tritonserver killed by SIGABRT" in log.read_text()
    assert "restarting (1/5)" in log.read_text()


def test_serve_on_ray_redeploys_on_sighup_and_stops_cleanly_on_sigterm(tmp_path, tiny_cnn_path):
    pytest.importorskip("ray", reason="needs the ray extra")
    http = free_port()
    model = tmp_path / "tiny.onnx"
    shutil.copyfile(tiny_cnn_path, model)
    proc = spawn(
        [sys.executable, "-m", "servekit", "serve", "--runtime", "ray", "--model", str(model),
         "--name", "tiny", "--host", "127.0.0.1", "--http-port", str(http)],
    )  # fmt: skip
    try:
        wait_ready(f"http://127.0.0.1:{http}", "tiny", proc, timeout_s=180)
        reload_on_sighup(proc, f"http://127.0.0.1:{http}", "tiny", model)
    finally:
        code = stop(proc)
    assert code == 0  # not Ray's abort on SIGTERM (-6)
    assert "reload failed, the serving version stays" in proc.stdout_text


def _serve(runtime: str, model: Path, http: int, grpc: int, *flags: str) -> subprocess.Popen:
    return spawn(
        [sys.executable, "-m", "servekit", "serve", "--runtime", runtime, "--model", str(model),
         "--name", "tiny", "--host", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc),
         "--metrics-port", str(free_port()), *flags],
    )  # fmt: skip


def test_serve_names_your_own_model_by_import_path_from_its_folder():
    # `servekit serve --model module:Class` in the model's folder: imported from there, set
    # up with its defaults, served under the class's name.
    http, grpc = free_port(), free_port()
    folder = Path(__file__).parent.parent / "examples" / "sentiment"
    proc = spawn(
        [sys.executable, "-m", "servekit", "serve", "--runtime", "native", "--model",
         "sentiment:Sentiment", "--host", "127.0.0.1", "--http-port", str(http), "--grpc-port",
         str(grpc), "--metrics-port", str(free_port())],
        cwd=folder,
    )  # fmt: skip
    try:
        wait_ready(f"http://127.0.0.1:{http}", "Sentiment", proc)
        with Client(f"grpc://127.0.0.1:{grpc}") as c:
            text = np.array([[b"great and fine"]], dtype=object)
            answer = c.infer("Sentiment", {"TEXT": text})
            assert answer["SCORE"].tolist() == [[2.5]] and answer["KNOWN"].tolist() == [[2]]
    finally:
        assert stop(proc) == 0


def test_a_config_file_serves_from_any_directory(tmp_path):
    # Its relative paths are the file's (the example's `path = "."`), not the shell's.
    http, grpc = free_port(), free_port()
    config = Path(__file__).parent.parent / "examples" / "sentiment" / "serve.toml"
    proc = spawn(
        [sys.executable, "-m", "servekit", "serve", "--config", str(config), "--host",
         "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port",
         str(free_port())],
        cwd=tmp_path,
    )  # fmt: skip
    try:
        wait_ready(f"http://127.0.0.1:{http}", "sentiment", proc)
        with Client(f"http://127.0.0.1:{http}") as c:
            answer = c.infer("sentiment", {"TEXT": np.array([[b"great"]], dtype=object)})
            assert answer["SCORE"].tolist() == [[2.0]]
    finally:
        assert stop(proc) == 0
    # The startup line names what is bound: the address and every port.
    assert f"on 127.0.0.1 (127.0.0.1): HTTP {http}, gRPC {grpc}, metrics " in proc.stdout_text


def test_serve_natively_answers_both_protocols_reloads_on_sighup_and_stops_cleanly(
    tmp_path, tiny_cnn_path
):
    http, grpc = free_port(), free_port()
    model = tmp_path / "tiny.onnx"
    shutil.copyfile(tiny_cnn_path, model)
    proc = _serve("native", model, http, grpc)
    try:
        wait_ready(f"http://127.0.0.1:{http}", "tiny_image", proc)
        with Client(f"grpc://127.0.0.1:{grpc}") as c:
            assert len(c.classify([_jpeg()], model="tiny_image")[0]) == 5
        reload_on_sighup(proc, f"http://127.0.0.1:{http}", "tiny", model)
    finally:
        code = stop(proc)
    assert code == 0
    assert "tiny: reloaded" in proc.stdout_text and "(reload 1)" in proc.stdout_text
    assert "reload failed, the serving version stays" in proc.stdout_text


def test_serve_on_the_triton_backend_renders_the_repository_and_serves_it(tmp_path, tiny_cnn_path):
    http, grpc = free_port(), free_port()
    proc = _serve("triton", tiny_cnn_path, http, grpc, "--max-batch-size", "4", "--top-k", "2")
    try:
        wait_ready(f"http://127.0.0.1:{http}", "tiny_image", proc)
        x = {"input": np.zeros((2, 3, 32, 32), np.float32)}
        want = OnnxRuntimeRunner(tiny_cnn_path).infer(x)["logits"]
        for url in (f"http://127.0.0.1:{http}", f"grpc://127.0.0.1:{grpc}"):
            with Client(url) as c:
                np.testing.assert_allclose(c.infer("tiny", x)["logits"], want, rtol=1e-5)
                assert len(c.classify([_jpeg()], model="tiny_image")[0]) == 2
        # The front is servekit's: the request that aborts tritonserver's own HTTP is a 400.
        status, payload = post_json(http, "/v2/models/tiny/infer", HOSTILE)
        assert status == 400 and "claims" in payload["error"]
    finally:
        code = stop(proc)
    assert code == 0
    assert proc.stdout_text.count("Failed to set config modification time") <= 1


def test_sighup_applies_the_split_the_file_changed_on_the_triton_runtime(tmp_path, add_sub_path):
    """The file's split is re-read on SIGHUP, even where the model files are not (tritonserver
    reloads from its repository, and says so)."""
    http, v2 = free_port(), tmp_path / "v2.onnx"
    shutil.copyfile(add_sub_path, v2)
    config = tmp_path / "serve.toml"
    text = f"""
runtime = "triton"
[server]
host = "127.0.0.1"
http_port = {http}
grpc_port = {free_port()}
metrics_port = {free_port()}
[[models]]
source = "{add_sub_path}"
name = "m"
[[models.versions]]
version = 2
source = "{v2}"
[models.traffic]
split = {{ 1 = 100, 2 = 0 }}
"""
    config.write_text(text)
    proc = spawn([sys.executable, "-m", "servekit", "serve", "--config", str(config)])
    url = f"http://127.0.0.1:{http}"
    x = {"INPUT0": np.ones((1, 16), np.float32), "INPUT1": np.ones((1, 16), np.float32)}

    def split() -> dict:
        with urllib.request.urlopen(f"{url}/v2/models/m/traffic", timeout=10) as r:
            return json.loads(r.read())["split"]

    try:
        wait_ready(url, "m", proc)
        with Client(url) as c:
            assert c.infer("m", x)
        assert split() == {"1": 100, "2": 0}
        config.write_text(text.replace("split = { 1 = 100, 2 = 0 }", "split = { 1 = 0, 2 = 100 }"))
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: split() == {"1": 0, "2": 100}, "the file's new split", 60)
        body = json.dumps({"inputs": [
            {"name": n, "datatype": "FP32", "shape": [1, 16], "data": [1.0] * 16}
            for n in ("INPUT0", "INPUT1")
        ]}).encode()  # fmt: skip
        request = urllib.request.Request(f"{url}/v2/models/m/infer", body, method="POST")
        with urllib.request.urlopen(request, timeout=10) as r:
            assert json.loads(r.read())["model_version"] == "2"
        wait_until(lambda: "reload failed" in proc.output(), "the models' reload reported", 30)
    finally:
        code = stop(proc)
    assert code == 0
    assert "m: traffic split {1: 0, 2: 100} from the file" in proc.stdout_text
    assert "tritonserver reloads models from its repository" in proc.stdout_text
