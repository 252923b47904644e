"""The servekit Python-based backend on the real tritonserver: ensemble, stages, versions, faults."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="needs the triton extra (its bundled tritonserver)")

from conftest import wait_until
from servekit import (
    BatchingPolicy,
    InvalidInput,
    ModelSpec,
    OnnxRuntimeRunner,
    ServerConfig,
    TensorSpec,
    image_classifier,
)
from servekit.client import Client
from servekit.protocol.pbtxt import model_config, parse, render
from servekit.stages import Postprocess, Preprocess, synthetic_image
from servekit.triton.launcher import _ABORTED_AT_LOAD, TritonOptions, TritonProcess
from servekit.triton.repo import build_repository, reference_repository
from servekit.zoo._onnx import FLOAT, GraphBuilder

REPO_ROOT = Path(__file__).resolve().parents[1]
ENSEMBLE_MODELS = ["preprocess", "resnet50", "postprocess", "resnet50_ensemble"]
ADDER_SPEC = ModelSpec(
    (TensorSpec("a", np.float32, [4]), TensorSpec("b", np.float32, [4])),
    (TensorSpec("sum", np.float32, [4]),),
    8,
)


def adder_onnx(offset: float) -> bytes:
    """sum = a + b + offset: versions that give different answers to the same request."""
    g = GraphBuilder()
    g.const("offset", np.array([offset], np.float32))
    g.node("Add", ["a", "b"], "ab")
    g.node("Add", ["ab", "offset"], "sum")
    io = ["batch", 4]
    return g.model(
        "adder", [("a", FLOAT, io), ("b", FLOAT, io)], [("sum", FLOAT, io)]
    ).SerializeToString()


def write_adder(repo: Path, name: str = "adder", versions=(1,), policy: str | None = None) -> None:
    folder = repo / name
    folder.mkdir(parents=True, exist_ok=True)
    config = model_config(
        name,
        ADDER_SPEC,
        BatchingPolicy(max_batch_size=8),
        parameters={"kind": "runner"},
        versions=policy,
    )
    (folder / "config.pbtxt").write_text(render(config))
    for v in versions:
        add_version(repo, name, v)


def add_version(repo: Path, name: str, version: int) -> None:
    vdir = repo / name / str(version)
    tmp = repo / f".{name}-{version}.tmp"
    tmp.mkdir()
    (tmp / "model.onnx").write_bytes(adder_onnx(float(version * 100)))
    tmp.rename(vdir)  # appears whole, never half-written


def options(repo: Path, mode: str = "none", **kw) -> TritonOptions:
    server = ServerConfig.on_loopback(exit_timeout_s=2, front=False)
    return TritonOptions(repo, server, model_control_mode=mode, **kw)


_READY = re.compile(r'backend\.py:\d+\] "servekit: (\S+) v\d+ ready')
"""servekit's backend's last line as a model's ``initialize`` returns."""


def hung_after_ready(log: str) -> bool:
    """Triton's other intermittent fault at a load (triton-inference-server/server#3475,
    under repeated loads and unloads on a starved host): the model's stub said it is ready
    and tritonserver never marked the model loaded."""
    ready = list(_READY.finditer(log))
    return bool(ready) and f"successfully loaded '{ready[-1][1]}'" not in log[ready[-1].end() :]


def test_a_load_that_hung_after_its_model_was_ready_is_told_from_one_that_loaded():
    """The lines of a hang seen in a full run (a ready line, then nothing but the stop) and
    of a load that went through."""
    started = (
        'I1 model_lifecycle.cc:472] "loading: tiny:1"\n'
        'I1 backend.py:272] "servekit: tiny v1 ready (runner, max_batch_size 64)"\n'
    )
    loaded = started + "I1 model_lifecycle.cc:839] \"successfully loaded 'tiny'\"\n"
    hung = loaded + started + "Signal (15) received.\n"
    assert not hung_after_ready(loaded) and not hung_after_ready("")
    assert hung_after_ready(hung)


def started_over_once(options: TritonOptions, body: Callable[[TritonProcess], None]) -> None:
    """``body`` against tritonserver run with ``options``; started over once if a load met
    one of Triton's own intermittent faults: the abort (``_ABORTED_AT_LOAD``: a Python
    backend stub starting under CPU starvation, triton-inference-server/server#8882), as
    ``TritonProcess.start`` does at start, or the hang after a ready model
    (``hung_after_ready``). Any other failure names tritonserver's state and its log's
    end."""
    for attempt in (1, 2):
        with TritonProcess(options) as process:
            try:
                body(process)
                return
            except Exception as exc:
                failure, state = exc, process.problem() or "tritonserver running"
        # Read once stopped: a load that hung can end in the abort only as Triton stops.
        log = process.log_text()
        if _ABORTED_AT_LOAD in log or hung_after_ready(log):
            assert attempt == 1, f"Triton failed a load twice:\n{process.log_tail(30)}"
            continue
        raise AssertionError(f"{failure!r}; {state}; its log ended:\n"
                             f"{process.log_tail(30)}") from failure  # fmt: skip


@pytest.fixture(scope="module")
def repo(tmp_path_factory, model_cache) -> Path:
    path = tmp_path_factory.mktemp("repo")
    build_repository(path, cache_dir=model_cache)
    write_adder(path)
    return path


@pytest.fixture(scope="module")
def module_triton(repo):
    process = TritonProcess(options(repo, "poll", repository_poll_secs=1))
    process.start()
    try:
        process.wait_ready([*ENSEMBLE_MODELS, "adder"])
        yield process
    finally:
        process.stop()


@pytest.fixture
def triton(module_triton: TritonProcess) -> TritonProcess:
    """The module's tritonserver (poll mode: it loads as the tests change the repository),
    started over if Triton's own abort at a load (``_ABORTED_AT_LOAD``) ended it since the
    last test; any other problem fails the test, naming it (not a refused connection)."""
    problem = module_triton.problem()
    if problem is not None:
        assert _ABORTED_AT_LOAD in module_triton.log_text(), f"the module's {problem}"
        module_triton.restart()
        module_triton.wait_ready([*ENSEMBLE_MODELS, "adder"])
    return module_triton


@pytest.fixture(scope="module")
def local(resnet50_path):
    runner = OnnxRuntimeRunner(resnet50_path)
    return runner, image_classifier(runner)


@pytest.fixture(params=["http", "grpc"])
def client(request, triton):
    url = (
        triton.options.server.http_url
        if request.param == "http"
        else triton.options.server.grpc_url
    )
    with Client(url) as c:
        yield c


def images(n: int, start: int = 0) -> list[bytes]:
    return [synthetic_image(start + i, size=(240 + 13 * i, 200)) for i in range(n)]


def test_committed_repository_configs_are_what_repo_build_renders():
    for m in reference_repository():
        committed = (REPO_ROOT / "model_repository" / m.name / "config.pbtxt").read_text()
        assert committed == render(m.config), (
            f"model_repository/{m.name} is stale: run servekit repo build"
        )
        assert parse(committed) == m.config  # and it parses back to the same message


def test_ensemble_equals_the_in_process_pipeline(client, local):
    blobs = images(4)
    remote = client.classify(blobs, model="resnet50_ensemble")
    expected = local[1].classify(blobs)
    for r, e in zip(remote, expected, strict=True):
        assert [p.class_id for p in r] == [p.class_id for p in e]
        assert [p.label for p in r] == [p.label for p in e]
        np.testing.assert_allclose([p.score for p in r], [p.score for p in e], rtol=1e-4, atol=1e-5)


def test_each_stage_can_be_called_on_its_own(client, local):
    blob = images(1, start=9)
    arr = np.array([[blob[0]]], dtype=object)
    tensor = client.infer("preprocess", {"image": arr})["input"]
    np.testing.assert_allclose(
        tensor, Preprocess(workers=1).infer({"image": arr})["input"], atol=1e-6
    )
    logits = client.infer("resnet50", {"input": tensor})["logits"]
    np.testing.assert_allclose(
        logits, local[0].infer({"input": tensor})["logits"], rtol=1e-4, atol=1e-4
    )
    top = client.infer("postprocess", {"logits": logits})
    expected = Postprocess().infer({"logits": logits})
    np.testing.assert_array_equal(top["classes"], expected["classes"])


def test_bad_requests_get_clear_errors_and_others_keep_working(client):
    with pytest.raises(InvalidInput, match=r"preprocess: input 'image' row 0: cannot decode image"):
        client.classify([b"\xff\xd8 not really"], model="resnet50_ensemble")
    with pytest.raises(InvalidInput, match=r"'input'.*FP64.*FP32|FP32.*FP64"):
        client.infer("resnet50", {"input": np.zeros((1, 3, 224, 224))})
    assert len(client.classify(images(1), model="resnet50_ensemble")[0]) == 5


def test_one_bad_image_in_a_batch_fails_alone(triton):
    with Client(triton.options.server.http_url) as c:
        arr = np.array([[images(1)[0]], [b"junk"]], dtype=object)
        with pytest.raises(InvalidInput, match="row 1"):
            c.infer("preprocess", {"image": arr})  # one request: it is the request that is bad
    results: dict[int, object] = {}

    def one(i: int, blob: bytes) -> None:
        with Client(triton.options.server.grpc_url) as c:
            try:
                results[i] = c.classify([blob], model="resnet50_ensemble")[0][0].class_id
            except InvalidInput as exc:
                results[i] = exc

    work = [*enumerate(images(5, start=30)), (99, b"junk")]
    threads = [threading.Thread(target=one, args=w) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(isinstance(results[i], int) for i in range(5))
    assert isinstance(results[99], InvalidInput)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def counter(text: str, name: str, model: str) -> float:
    m = re.search(rf'^{name}{{model="{model}",version="1"}} ([0-9.e+]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_dynamic_batching_is_configured_and_visible_in_metrics(triton):
    before = scrape(triton.options.server.metrics_url)
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)

    def one() -> None:
        with Client(triton.options.server.grpc_url) as c:
            c.infer("resnet50", {"input": x})

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.monotonic() + 10
    while True:
        after = scrape(triton.options.server.metrics_url)
        done = counter(after, "nv_inference_request_success", "resnet50") - counter(
            before, "nv_inference_request_success", "resnet50"
        )
        if done >= 12 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    execs = counter(after, "nv_inference_exec_count", "resnet50") - counter(
        before, "nv_inference_exec_count", "resnet50"
    )
    assert done == 12 and execs < done


def repository_index(url: str) -> dict[str, dict]:
    req = urllib.request.Request(f"{url}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return {(m["name"], m.get("version", "")): m for m in json.loads(r.read())}


def test_a_new_version_a_broken_one_and_a_rollback_under_load_fail_no_request(triton, repo):
    a = np.ones((1, 4), np.float32)
    seen: list[float] = []
    per_worker: list[list[float]] = [[] for _ in range(3)]
    failures: list[BaseException] = []
    stop = threading.Event()

    def load(mine: list[float]) -> None:
        with Client(triton.options.server.http_url) as c:
            while not stop.is_set():
                try:
                    got = float(c.infer("adder", {"a": a, "b": a})["sum"][0, 0])
                except BaseException as exc:
                    failures.append(exc)
                else:
                    mine.append(got)
                    seen.append(got)

    def served_after(mark: int, value: float) -> None:
        """Wait until 20 more answers than `mark` came, the last one from `value`."""
        wait_until(
            lambda: len(seen) >= mark + 20 and seen[-1] == value,
            f"a run of answers from {value} after {mark}", 30,
        )  # fmt: skip

    workers = [threading.Thread(target=load, args=(mine,)) for mine in per_worker]
    for w in workers:
        w.start()
    try:
        served_after(0, 102.0)
        add_version(repo, "adder", 2)
        served_after(len(seen), 202.0)
        # Version 3 does not load: version 2 keeps serving.
        broken = repo / ".adder-3.tmp"
        broken.mkdir()
        (broken / "model.onnx").write_bytes(b"not an onnx file")
        broken.rename(repo / "adder" / "3")
        index = triton.options.server.http_url
        wait_until(
            lambda: repository_index(index).get(("adder", "3"), {}).get("state") == "UNAVAILABLE",
            "version 3 tried and refused", 30,
        )  # fmt: skip
        time.sleep(2)  # the poller's rounds go on (one a second): nothing may change meanwhile
        after_broken = len(seen)
        served_after(after_broken, 202.0)
        assert set(seen[after_broken:]) == {202.0}
        # Rollback: remove versions 3 and 2, and version 1 serves again.
        for v in (3, 2):
            shutil.rmtree(repo / "adder" / str(v))
        served_after(len(seen), 102.0)
        rolled = len(seen)
        wait_until(lambda: len(seen) >= rolled + 20, "20 more answers from version 1", 30)
    finally:
        stop.set()
        for w in workers:
            w.join()
        forget_broken(triton, repo / "adder" / "3", ("adder", "3"))
    assert not failures, failures[:3]
    assert set(seen) <= {102.0, 202.0}  # version 1 or 2, never anything else
    # A request already running on the old version may finish after another worker's
    # first answer from the new one, so the order is checked worker by worker: each
    # went 1 -> 2 -> 1 once (latest-1 policy), never back and forth.
    for mine in per_worker:
        runs = [v for i, v in enumerate(mine) if i == 0 or v != mine[i - 1]]
        assert runs == [102.0, 202.0, 102.0], runs


def test_a_tritonserver_that_dies_while_loading_leaves_nothing_behind(repo):
    """Killed (as the OOM killer would) while its stubs load the models: the start fails
    naming the exit, and no process, shared memory region or folder of it is left (a
    Supervisor that tries again would otherwise pile them up)."""
    import os
    import signal

    from servekit.errors import TritonSetupError
    from servekit.runtime.processes import processes

    process = TritonProcess(options(repo, "none"))
    failed: list[Exception] = []

    def start() -> None:
        try:
            process.start()
        except TritonSetupError as exc:
            failed.append(exc)

    thread = threading.Thread(target=start)
    thread.start()
    try:
        wait_until(lambda: process._workdir is not None and process._workdir.stubs(),
                   "a stub started", 120)  # fmt: skip
        workdir = process._workdir.path  # type: ignore[union-attr]
        stubs = process._workdir.stubs().values()  # type: ignore[union-attr]
        regions = [Path("/dev/shm") / a[2] for a in stubs if len(a) > 2]  # argv read mid-exec
        assert process.is_alive()  # still loading: not live yet
        os.kill(process._proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        thread.join(60)
    finally:
        if thread.is_alive() or not failed:
            thread.join(60)
            process.stop()
    assert failed and "exited with code -9" in str(failed[0]), failed
    assert processes(str(workdir)) == {}
    assert [r for r in regions if r.exists()] == []
    assert not workdir.exists()


def test_a_stub_region_made_after_the_last_look_is_freed_when_tritonserver_is_killed(tmp_path):
    """tritonserver frees its stubs' shared memory only when it exits cleanly. A stub
    started after servekit last looked (an explicit load here; in life a replacement for a
    dead stub), then tritonserver killed with it: the stop frees that region too, as every
    region of a start is named after it (``Workdir.region_prefix``)."""
    import os
    import signal

    import tritonclient.http as th

    write_adder(tmp_path / "repo")
    regions: list[Path] = []

    def killed_with_a_stub(process: TritonProcess) -> None:
        prefix = process._workdir.region_prefix  # type: ignore[union-attr]
        admin = th.InferenceServerClient(f"127.0.0.1:{process.options.server.http_port}")
        try:
            admin.load_model("adder")
        finally:
            admin.close()
        regions[:] = Path("/dev/shm").glob(f"{prefix}*")
        assert regions, "the stub's region is named after the start"
        os.killpg(process._proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        process._proc.wait()  # type: ignore[union-attr]
        assert all(r.exists() for r in regions)  # what the kill left

    started_over_once(options(tmp_path / "repo", "explicit"), killed_with_a_stub)
    assert [r for r in regions if r.exists()] == []  # freed by the stop


def test_a_start_that_triton_aborts_with_its_lock_exception_is_tried_once_more(
    tmp_path, monkeypatch
):
    """Triton's Python backend now and then aborts tritonserver at model load (its
    ``boost::interprocess::lock_exception``, seen here under CPU starvation): the start is
    tried once more, from a clean slate. Here the first tritonserver says so and aborts
    as Triton's does; any other death is not retried (the test above)."""
    write_adder(tmp_path / "repo")
    first = tmp_path / "aborted-once"
    command = TritonProcess.command

    def aborting_once(self, backends, env):  # type: ignore[no-untyped-def]
        workdirs.append(backends.parent)
        script = (
            f'if [ ! -e {first} ]; then touch {first}; echo "terminate called after throwing '
            "an instance of 'boost::interprocess::lock_exception'\"; kill -ABRT $$; fi; "
            'exec "$@"'
        )
        return ["sh", "-c", script, "sh", *command(self, backends, env)]

    monkeypatch.setattr(TritonProcess, "command", aborting_once)
    workdirs: list[Path] = []
    with TritonProcess(options(tmp_path / "repo", "none")) as process:
        process.wait_ready(["adder"])
        a = np.ones((1, 4), np.float32)
        with Client(process.options.server.http_url) as c:
            assert c.infer("adder", {"a": a, "b": a})["sum"][0, 0] == 102.0
    assert first.exists() and len(workdirs) == 2
    assert [w for w in workdirs if w.exists()] == []
    assert "Started HTTPService" in process.log_text()  # the log outlives its folder


def test_a_corrupt_model_fails_to_load_with_a_clear_message_while_others_serve(triton, repo):
    write_adder(repo, "broken", versions=())
    vdir = repo / "broken" / "1"
    vdir.mkdir()
    (vdir / "model.onnx").write_bytes(b"this is not an onnx file")

    def state() -> dict:
        return repository_index(triton.options.server.http_url).get(("broken", "1"), {})

    try:
        wait_until(lambda: state().get("state") == "UNAVAILABLE" and state().get("reason"),
                   "the broken model reported UNAVAILABLE with a reason", 30)  # fmt: skip
        assert "cannot load model.onnx" in state()["reason"]
        with Client(triton.options.server.http_url) as c:
            assert len(c.classify(images(1), model="resnet50_ensemble")[0]) == 5
    finally:
        forget_broken(triton, repo / "broken", ("broken", "1"))


def forget_broken(triton: TritonProcess, folder: Path, key: tuple[str, str]) -> None:
    """Take a model that does not load out of the polled repository, and wait until Triton
    has let it go: in poll mode tritonserver tries a model that failed again every round
    (a Python stub started, importing servekit and failing: 2.3 s of every 3.3 s here), and
    the module's later tests would run on what that leaves of the host's two cores (one
    of them failed on Triton's 1 s stub health check: "Stub process ... is not healthy")."""
    shutil.rmtree(folder, ignore_errors=True)
    tried = f"loading: {key[0]}:{key[1]}"

    def let_go() -> bool:  # no new try over two poll rounds and more than one load's time
        before = triton.log_text().count(tried)
        time.sleep(4)
        return triton.log_text().count(tried) == before

    wait_until(let_go, f"tritonserver to stop trying {key[0]} version {key[1]}", 30)


def test_explicit_load_unload_and_a_specific_version_policy(tmp_path):
    import tritonclient.http as th

    write_adder(tmp_path, "adder", versions=(1, 2), policy="specific:1")
    write_adder(tmp_path, "missing_file", versions=())
    (tmp_path / "missing_file" / "1").mkdir()

    def body(process: TritonProcess) -> None:
        admin = th.InferenceServerClient(f"127.0.0.1:{process.options.server.http_port}")
        try:
            admin.load_model("adder")
            a = np.ones((1, 4), np.float32)
            with Client(process.options.server.http_url) as c:
                assert (
                    c.infer("adder", {"a": a, "b": a})["sum"][0, 0] == 102.0
                )  # version 1, not the newer 2
                assert admin.is_model_ready("adder", "1") and not admin.is_model_ready("adder", "2")
                admin.unload_model("adder")
                with pytest.raises(Exception, match="adder"):
                    c.infer("adder", {"a": a, "b": a})
            with pytest.raises(Exception, match=r"model file .*model.onnx does not exist"):
                admin.load_model("missing_file")
        finally:
            admin.close()

    started_over_once(options(tmp_path, "explicit"), body)


def test_the_front_passes_model_control_to_tritonserver_with_the_client_s_token(
    tmp_path, monkeypatch
):
    """servekit triton --model-control-mode explicit: tritonclient's load, unload and index
    through servekit's front reach tritonserver, which checks the client's control token.
    A load is waited for as long as tritonserver takes: here the front's wait for other
    calls is cut to 0.5 s during the load, shorter than any load of a Python backend
    model (its stub imports numpy and servekit), and the load still succeeds."""
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    import servekit.front.private

    write_adder(tmp_path, "adder", versions=(1,))
    server = ServerConfig.on_loopback(exit_timeout_s=2, control_token="ctl")

    def body(process: TritonProcess) -> None:
        client = th.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        try:
            assert client.get_server_metadata()["name"] == "servekit"  # the front answers
            with pytest.raises(
                InferenceServerException, match="restricted.*servekit-control-token"
            ):
                client.load_model("adder")
            token = {"servekit-control-token": "ctl"}
            with monkeypatch.context() as m:  # the other calls keep the usual wait
                m.setattr(servekit.front.private, "FETCH_WAIT_S", 0.5)
                client.load_model("adder", headers=token)
            a = np.ones((1, 4), np.float32)
            with Client(server.http_url) as c:
                assert c.infer("adder", {"a": a, "b": a})["sum"][0, 0] == 102.0
            index = {
                e["name"]: e["state"] for e in client.get_model_repository_index(headers=token)
            }
            assert index == {"adder": "READY"}
            client.unload_model("adder", headers=token)
            wait_until(lambda: not client.is_model_ready("adder"), "adder unloaded", 30)
            with pytest.raises(InferenceServerException, match="adder"):
                client.infer("adder", [])
        finally:
            client.close()

    started_over_once(TritonOptions(tmp_path, server, model_control_mode="explicit"), body)


def test_a_load_tritonserver_cannot_take_is_the_client_s_error_not_a_retry(tmp_path):
    """In poll mode tritonserver answers a load UNAVAILABLE (503: retry); through the front
    it is the client's request that cannot work here: 400 / FAILED_PRECONDITION, naming
    the flag, and the model goes on serving."""
    import tritonclient.grpc as tg
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    write_adder(tmp_path, "adder", versions=(1,))
    server = ServerConfig.on_loopback(exit_timeout_s=2)
    with TritonProcess(TritonOptions(tmp_path, server, model_control_mode="poll")):
        http = th.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        grpc = tg.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        try:
            for call in (http.load_model, http.unload_model):
                with pytest.raises(InferenceServerException) as e:
                    call("adder")
                assert e.value.status() == "400"
                assert "--model-control-mode poll" in str(e.value)
            with pytest.raises(InferenceServerException) as e:
                grpc.load_model("adder")
            assert e.value.status() == "StatusCode.FAILED_PRECONDITION"
            assert "needs explicit mode" in str(e.value)
            a = np.ones((1, 4), np.float32)
            with Client(server.http_url) as c:
                assert c.infer("adder", {"a": a, "b": a})["sum"][0, 0] == 102.0
        finally:
            http.close()
            grpc.close()


def test_repo_build_and_triton_commands(tmp_path, model_cache):
    from typer.testing import CliRunner

    from servekit.cli import app

    result = CliRunner().invoke(
        app, ["repo", "build", str(tmp_path / "r"), "--cache-dir", str(model_cache)]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r" / "resnet50" / "1" / "model.onnx").exists()
    bad = CliRunner().invoke(
        app, ["triton", "--model-repository", str(tmp_path / "r"), "--model-control-mode", "lazy"]
    )
    assert bad.exit_code != 0 and "model_control_mode" in bad.output


def test_metrics_count_known_traffic_exactly(triton):
    """Triton's counters for the servekit backend and the ensemble after known traffic:
    sequential requests are one execution each, latency summaries are on, and the bad
    image's error response is counted in servekit_request_failure."""
    from conftest import sample
    from conftest import scrape as scrape_metrics

    def counts() -> dict[tuple[str, str], float]:
        got = scrape_metrics(triton.options.server.metrics_url)
        return {
            (model, name): sample(got, name, model=model, version="1")
            for model in ("preprocess", "resnet50", "resnet50_ensemble")
            for name in (
                "nv_inference_request_success",
                "nv_inference_request_failure",
                "nv_inference_exec_count",
                "nv_inference_request_summary_us_count",
            )
        } | {
            (model, "servekit_request_failure"): sample(
                got, "servekit_request_failure", model=model, version="1", code="INVALID_ARG"
            )
            for model in ("preprocess", "resnet50")
        }

    # Triton counts the bad image's request as a success (execute returned normally) and
    # never lets the FP64 request reach the model; servekit counts the error it answered.
    want = {
        ("preprocess", "nv_inference_request_success"): 4,
        ("preprocess", "nv_inference_request_failure"): 0,
        ("preprocess", "servekit_request_failure"): 1,
        ("preprocess", "nv_inference_exec_count"): 4,
        ("resnet50", "nv_inference_request_success"): 3,
        ("resnet50", "nv_inference_request_failure"): 0,
        ("resnet50", "servekit_request_failure"): 0,
        ("resnet50", "nv_inference_exec_count"): 3,
        ("resnet50_ensemble", "nv_inference_request_success"): 3,
    }
    before = counts()
    with Client(triton.options.server.http_url) as c:
        for i in range(3):
            c.classify(images(1, 60 + i), model="resnet50_ensemble")
        with pytest.raises(InvalidInput):
            c.classify([b"not an image"], model="resnet50_ensemble")
        with pytest.raises(InvalidInput):
            c.infer("resnet50", {"input": np.zeros((1, 3, 224, 224))})
    deadline = time.monotonic() + 10
    while True:  # Triton counts a request just after answering it
        after = counts()
        delta = {k: after[k] - before[k] for k in after}
        if all(delta[k] >= v for k, v in want.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert {k: delta[k] for k in want} == want
    assert delta[("resnet50", "nv_inference_request_summary_us_count")] == 3


def test_twenty_load_unload_cycles_leave_memory_flat_and_names_cannot_escape_the_repository(
    tmp_path, tiny_cnn_path
):
    """Triton users report memory lost on every reload: here the server's whole process
    tree (tritonserver and its Python backend stubs) ends 20 cycles of the servekit backend
    where it was after the first 5. And a model name cannot reach outside the repository."""
    import psutil
    import tritonclient.http as th

    from servekit.triton.repo import runner_model

    tiny = runner_model("tiny", tiny_cnn_path)
    build_repository(tmp_path / "repo", [tiny])
    (tmp_path / "outside").mkdir()  # a model-shaped folder next to the repository
    (tmp_path / "outside" / "config.pbtxt").write_text(render(tiny.config))
    x = {"input": np.zeros((1, 3, 32, 32), np.float32)}

    def tree_rss(pid: int) -> int:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])

    def body(process: TritonProcess) -> None:
        pid, rss = process._proc.pid, []  # type: ignore[union-attr]
        admin = th.InferenceServerClient(f"127.0.0.1:{process.options.server.http_port}")
        try:
            with Client(process.options.server.http_url) as c:
                for cycle in range(20):
                    try:
                        admin.load_model("tiny")
                        assert c.infer("tiny", x)["logits"].shape == (1, 10)
                        admin.unload_model("tiny")
                        wait_until(lambda: not admin.is_model_ready("tiny"), "tiny unloaded", 10)
                    except Exception as exc:
                        raise RuntimeError(f"cycle {cycle + 1}: {exc!r}") from exc
                    rss.append(tree_rss(pid))
            growth = rss[-1] - rss[4]
            print(f"tree RSS MB after cycles 1, 5, 20: "
                  f"{[round(rss[i] / 2**20, 1) for i in (0, 4, 19)]}")  # fmt: skip
            assert growth < 15 * 2**20, f"grew {growth / 2**20:.1f} MB over 15 cycles: {rss}"
            for name in ("../outside", "..%2Foutside", "tiny/../../outside"):
                with pytest.raises(Exception):  # noqa: B017 (Triton's own error types vary)
                    admin.load_model(name)
            assert not admin.is_model_ready("outside")
        finally:
            admin.close()

    started_over_once(options(tmp_path / "repo", "explicit"), body)
