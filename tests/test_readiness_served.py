"""Readiness tells the truth, served: a model with no instance able to serve reads not
ready, with its reason in the repository index, on native, PyTriton, the Triton backend
and Ray; a sticky CUDA error (stood in for by a model raising CUDA's words) breaks the
model's instance, never bisected (docs/operations.md, "A model that cannot serve")."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from conftest import each_client, needs_runtime, on, supervised, wait_until
from servekit import BatchingPolicy, ModelConfig

pytest.importorskip("tritonclient", reason="needs the triton extra")
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

BROKEN = '''
import servekit


class Broken(servekit.Model):
    """Declares its signature; its set-up raises every time, as missing weights do."""

    inputs = [("X", "FP32", [4])]
    outputs = [("Y", "FP32", [4])]
    max_batch_size = 8

    def setup(self):
        raise OSError("no weights at /models/broken")

    def infer(self, batch):
        return {"Y": batch["X"]}
'''

POISONED = '''
import servekit

CALLS = []


class Poisoned(servekit.Model):
    """Stands in for a device: a value of -7 makes it raise CUDA's sticky words."""

    inputs = [("X", "FP32", [4])]
    outputs = [("Y", "FP32", [4])]
    max_batch_size = 16

    def infer(self, batch):
        CALLS.append(len(batch["X"]))
        if (batch["X"] == -7).any():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {"Y": batch["X"] * 2}
'''

REASON = "model broken: setup_fails:Broken failed to set up: OSError: no weights at /models/broken"


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def index(base: str) -> list[dict]:
    request = urllib.request.Request(f"{base}/v2/repository/index", b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def unready_with(base: str, model: str, words: str) -> bool:
    """Whether ``model`` reads not ready and the index gives ``words`` as its reason."""
    (row,) = [e for e in index(base) if e["name"] == model]
    return (
        get(f"{base}/v2/models/{model}/ready") != 200
        and row["state"] == "UNAVAILABLE"
        and words in row.get("reason", "")
    )


@pytest.mark.parametrize("runtime", ["native", "pytriton", "triton", "ray"])
def test_a_model_whose_every_start_fails_reads_not_ready_with_its_reason(runtime, tmp_path):
    """Its set-up raises in every process that starts it (the driver's probe, each replica,
    each stub): the server starts, the model reads not ready within 30 s, the repository
    index gives the set-up's words, and a request is refused with them (503)."""
    needs_runtime(runtime)
    (tmp_path / "setup_fails.py").write_text(BROKEN)  # a name no other test imports
    model = ModelConfig("setup_fails:Broken", "broken", path=str(tmp_path))
    with served_on(runtime, model) as base:
        # tritonserver words it its own way, around the stub's: the set-up's words stay.
        wait_until(lambda: unready_with(base, "broken", REASON.split(": ", 1)[1]),
                   "broken not ready with its reason", 30)  # fmt: skip
        assert get(f"{base}/v2/health/live") == 200  # the server itself is fine
        c = httpclient.InferenceServerClient(base.removeprefix("http://"))
        try:
            x = httpclient.InferInput("X", [1, 4], "FP32")
            x.set_data_from_numpy(np.ones((1, 4), np.float32))
            # tritonserver refuses a model it could not load as unknown (its 404).
            words = "no available versions" if runtime == "triton" else "no weights at /models"
            with pytest.raises(InferenceServerException, match=words):
                c.infer("broken", [x])
        finally:
            c.close()
        wait_until(lambda: unready_with(base, "broken", "no weights"), "still not ready", 5)


def served_on(runtime: str, model: ModelConfig, *, watched: bool = False):
    """``model`` served on ``runtime``; yields its base URL (Ray: no wait for readiness).
    ``watched``: started and restarted by a Supervisor, as ``servekit serve`` does."""
    import contextlib

    @contextlib.contextmanager
    def serve():
        if watched and runtime != "ray":
            from servekit import ServeConfig, ServerConfig
            from servekit.serving import create_runtime

            config = ServeConfig(
                (model,), ServerConfig(exit_timeout_s=2), runtime=runtime
            ).on_loopback()
            with supervised(create_runtime(config)):
                yield config.server.http_url
            return
        if runtime != "ray":
            with on(runtime)(model) as served:
                yield f"http://127.0.0.1:{served.http_port}"
            return
        from ray import serve as ray_serve

        from conftest import ray_serve as serve_start
        from servekit import RayOptions, ServeConfig, ServerConfig
        from servekit.ray import build_app

        config = ServeConfig(
            (model,), ServerConfig(), runtime="ray", ray=RayOptions(model_cpus=0.5)
        )
        with serve_start() as url:
            ray_serve.run(build_app(config), name="servekit", route_prefix="/")
            try:
                yield url
            finally:
                ray_serve.delete("servekit")

    return serve()


def test_on_native_a_sticky_cuda_error_fails_its_batch_once_and_the_server_is_not_live(tmp_path):
    """Eight clients, one sending the value that makes the stand-in device raise CUDA's
    sticky words: the batch holding it runs once (never bisected), its requests get 503
    naming CUDA's words, the model reads not ready with ``device lost: ...``, every later
    request is refused without a call, and ``/v2/health/live`` fails so an orchestrator
    restarts the process (nobody re-sends on native: docs/operations.md)."""
    import sys

    (tmp_path / "sticky_device.py").write_text(POISONED)
    model = ModelConfig(
        "sticky_device:Poisoned", "poisoned", path=str(tmp_path),
        batching=BatchingPolicy(max_batch_size=16, max_queue_delay_us=200_000),
    )  # fmt: skip
    with on("native")(model) as served:
        calls = sys.modules["sticky_device"].CALLS
        base = f"http://127.0.0.1:{served.http_port}"
        errors: list[str] = []
        del calls[:]  # warm-up's

        def client(k: int) -> None:
            c = httpclient.InferenceServerClient(base.removeprefix("http://"))
            try:
                x = httpclient.InferInput("X", [1, 4], "FP32")
                x.set_data_from_numpy(np.full((1, 4), -7.0 if k == 0 else float(k), np.float32))
                try:
                    c.infer("poisoned", [x])
                except InferenceServerException as exc:
                    errors.append(f"{exc.status()} {exc.message()}")
            finally:
                c.close()

        each_client(client)
        assert len(calls) == 1, calls  # one run: halving cannot help
        said = "device lost: CUDA error: an illegal memory access was encountered"
        assert len(errors) == 8 and all(said in e for e in errors), errors
        assert all(e.startswith("503") for e in errors), errors
        assert unready_with(base, "poisoned", said)
        assert get(f"{base}/v2/health/live") == 503
        client(1)  # a good request now: refused, and the device is not called
        assert len(calls) == 1 and said in errors[-1]


ONCE = '''
import os
from pathlib import Path

import servekit

FAULT = Path(__file__).with_name("fault")


class Once(servekit.Model):
    """Stands in for a device that hits a sticky error once: the first batch run while
    the file ``fault`` exists (in whichever worker process) takes it away and raises."""

    inputs = [("X", "FP32", [4])]
    outputs = [("Y", "FP32", [4])]
    max_batch_size = 16

    def infer(self, batch):
        try:
            FAULT.unlink()
        except FileNotFoundError:
            return {"Y": batch["X"] * 2}
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
'''


@pytest.mark.parametrize("runtime", ["pytriton", "triton", "ray"])
def test_a_sticky_cuda_error_restarts_the_worker_or_takes_the_process_out(runtime, tmp_path):
    """GPU defect 8 on the runtimes with a worker of their own: a sticky CUDA error in a
    Triton stub or a Ray replica ends that worker with the batch unanswered; the worker is
    started again (tritonserver by the Supervisor, the replica by Ray) and the batch's
    requests are sent again to it: eight clients, all answered. On PyTriton the model runs
    in servekit's own process, as on native: the batch gets 503 naming CUDA's words, the
    model reads not ready and the server not live, so the orchestrator restarts it."""
    needs_runtime(runtime)
    (tmp_path / "strikes_once.py").write_text(ONCE)
    model = ModelConfig(
        "strikes_once:Once", "once", path=str(tmp_path),
        batching=BatchingPolicy(max_batch_size=16, max_queue_delay_us=100_000),
    )  # fmt: skip
    with served_on(runtime, model, watched=True) as base:
        wait_until(lambda: get(f"{base}/v2/models/once/ready") == 200, "once ready", 60)
        (tmp_path / "fault").write_text("")
        answers: dict[int, object] = {}

        def client(k: int) -> None:
            c = httpclient.InferenceServerClient(base.removeprefix("http://"), network_timeout=120)
            try:
                x = httpclient.InferInput("X", [1, 4], "FP32")
                x.set_data_from_numpy(np.full((1, 4), float(k), np.float32))
                try:
                    answers[k] = c.infer("once", [x]).as_numpy("Y")
                except InferenceServerException as exc:
                    answers[k] = f"{exc.status()} {exc.message()}"
            finally:
                c.close()

        each_client(client)
        assert not (tmp_path / "fault").exists()  # the fault was hit
        said = "device lost: CUDA error: an illegal memory access was encountered"
        if runtime == "pytriton":
            failed = [a for a in answers.values() if isinstance(a, str)]
            assert failed and all(said in a for a in failed), answers
            assert unready_with(base, "once", said)
            assert get(f"{base}/v2/health/live") == 503
            return
        for k, answer in answers.items():
            assert not isinstance(answer, str), answers
            np.testing.assert_array_equal(answer, np.full((1, 4), 2.0 * k, np.float32))
        wait_until(lambda: get(f"{base}/v2/models/once/ready") == 200, "ready again", 30)
        assert get(f"{base}/v2/health/live") == 200
