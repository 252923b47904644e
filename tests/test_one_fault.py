"""One fault, one consequence, served: on native, PyTriton, the Triton backend and Ray, a
client whose inputs make the user's model raise gets that error alone while seven others,
batched with it, are all answered right; a model that raises on warm-up's random samples
(its own ``InvalidInput``, a plain ``ValueError``) still starts and serves."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import each_client, sample, scrape, serve_on_runtime
from servekit import BatchingPolicy, ModelConfig

pytest.importorskip("tritonclient", reason="needs the triton extra")
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

PICKY = '''
import numpy as np
import servekit


class Picky(servekit.Model):
    """Doubles x; a plain ValueError for values below -1000, as a user's code raises it."""

    inputs = [("X", "FP32", [4])]
    outputs = [("Y", "FP32", [4])]
    max_batch_size = 16

    def infer(self, batch):
        x = batch["X"]
        if (x < -1000).any():
            raise ValueError("x below -1000 is not supported")
        return {"Y": x * 2}
'''

POSITIVE = '''
import numpy as np

from servekit import InvalidInput, ModelSpec, TensorSpec
from servekit.runners import BaseRunner


class PositiveOnly(BaseRunner):
    """A Runner of its own, named by import path, that refuses negative inputs."""

    def __init__(self):
        self._spec = ModelSpec(
            (TensorSpec("X", np.float32, [4]),), (TensorSpec("Y", np.float32, [4]),), 8
        )

    def _run(self, inputs):
        if (inputs["X"] < 0).any():
            raise InvalidInput("X: negative values are not allowed")
        return {"Y": np.sqrt(inputs["X"])}
'''

SCORER = '''
import numpy as np
import servekit


class Scorer(servekit.Model):
    """Refuses any negative value with a plain ValueError and has no warmup(): warm-up's
    random normals make it raise."""

    inputs = [("X", "FP32", [4])]
    outputs = [("Y", "FP32", [4])]
    max_batch_size = 8

    def infer(self, batch):
        x = batch["X"]
        if (x < 0).any():
            raise ValueError("negative values are not allowed")
        return {"Y": np.sqrt(x)}
'''


@pytest.fixture(params=["native", "pytriton", "triton", "ray"])
def serving(request):
    return serve_on_runtime(request, request.param)


def clients_of(served) -> list:
    made = [(httpclient, httpclient.InferenceServerClient(f"127.0.0.1:{served.http_port}"))]
    if served.grpc_port is not None:
        made.append((grpcclient, grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")))
    return made


def call(module, client, model: str, x: np.ndarray) -> np.ndarray:
    t = module.InferInput("X", list(x.shape), "FP32")
    t.set_data_from_numpy(x)
    return client.infer(model, [t]).as_numpy("Y")


def failures(served) -> tuple[float, float]:
    """picky's ``nv_inference_request_failure`` (all reasons: tritonserver labels each
    series with one) and ``servekit_request_isolated`` now."""
    samples = scrape(served.metrics_url)
    failed = sum(
        v for (name, labels), v in samples.items()
        if name == "nv_inference_request_failure"
        and {("model", "picky"), ("version", "1")} <= labels
    )  # fmt: skip
    return failed, sample(samples, "servekit_request_isolated", model="picky", version="1")


@pytest.mark.parametrize("bad", [1, 2, 4])
def test_bad_clients_sending_the_same_row_fail_alone_and_the_good_ones_are_answered(
    serving, tmp_path, bad
):
    """``bad`` of eight clients send the very same bad row (a retry, one bad record sent
    twice), so the model's words are the same for each: every good request batched with
    them is answered, and each failure is counted on every runtime."""
    (tmp_path / "picky.py").write_text(PICKY)
    model = ModelConfig(
        "picky:Picky", "picky", path=str(tmp_path),
        batching=BatchingPolicy(max_batch_size=16, max_queue_delay_us=3000),
    )  # fmt: skip
    rounds = 25
    with serving(model) as served:
        failed_before, isolated_before = failures(served)  # Ray's server serves the module
        wrong: list[str] = []
        bad_errors: list[str] = []
        answered = [0]

        def client(k: int) -> None:
            own = clients_of(served)
            module, c = own[k % len(own)]
            try:
                for i in range(rounds):
                    if k < bad:
                        x = np.full((1, 4), 7.0, np.float32)
                        x[0, 0] = -5000.0  # the same row from every bad client
                        try:
                            call(module, c, "picky", x)
                            wrong.append("a bad client was answered")
                        except InferenceServerException as exc:
                            bad_errors.append(exc.message())
                        continue
                    rows = 1 + (k + i) % 2
                    x = np.full((rows, 4), float(k * 100 + i), np.float32)
                    try:
                        y = call(module, c, "picky", x)
                    except InferenceServerException as exc:
                        wrong.append(f"client {k} request {i}: {exc.message()}")
                        continue
                    if not np.array_equal(y, x * 2):
                        wrong.append(f"client {k} request {i}: wrong answer")
                    answered[0] += 1
            finally:
                for _, each in own:
                    each.close()

        each_client(client, timeout_s=180)
        assert not wrong, (len(wrong), wrong[:5])
        assert answered[0] == (8 - bad) * rounds
        assert len(bad_errors) == bad * rounds
        # Worded the same on every runtime: the model named once, the exception, its words.
        said = "model picky: ValueError: x below -1000 is not supported"
        assert all(m == said for m in bad_errors), bad_errors[:2]
        # Each failure counted where docs/batching.md says, and those that failed alone
        # beside answers counted so.
        failed_after, isolated_after = failures(served)
        assert failed_after - failed_before == bad * rounds, (failed_before, failed_after)
        isolated = isolated_after - isolated_before
        assert 0 < isolated <= bad * rounds, isolated
        assert served.pending("picky") == 0  # idle again once the clients stop


@pytest.mark.parametrize(
    "source", ["positive:PositiveOnly", "scorer:Scorer"], ids=["invalid-input", "value-error"]
)
def test_a_model_that_raises_on_warm_up_samples_starts_and_serves(serving, tmp_path, source):
    """Whatever the model raises on warm-up's random samples (a Runner's own
    ``InvalidInput``, a ``servekit.Model``'s plain ``ValueError``), it starts and serves."""
    (tmp_path / "positive.py").write_text(POSITIVE)
    (tmp_path / "scorer.py").write_text(SCORER)
    model = ModelConfig(source, "positive", path=str(tmp_path))
    with serving(model) as served:
        for module, c in clients_of(served):
            try:
                x = np.full((2, 4), 9.0, np.float32)
                assert call(module, c, "positive", x).tolist() == [[3.0] * 4] * 2
                with pytest.raises(InferenceServerException, match="negative values"):
                    call(module, c, "positive", -x)
            finally:
                c.close()


@pytest.mark.parametrize("runtime", ["native", "pytriton", "triton"])
def test_the_log_holds_the_models_traceback_once(runtime, tmp_path, caplog, capfd):
    """Once per error and place, wherever the model runs (in tritonserver's stub the line
    reaches servekit's console through tritonserver's log). Ray's replicas log to Ray's
    own files."""
    import logging
    import time

    from conftest import on

    module = f"picky_{runtime}"  # its own: this process imports each module once
    (tmp_path / f"{module}.py").write_text(PICKY)
    model = ModelConfig(f"{module}:Picky", "picky", path=str(tmp_path))
    with caplog.at_level(logging.INFO), on(runtime)(model) as served:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{served.http_port}")
        try:
            for _ in range(4):
                with pytest.raises(InferenceServerException, match="below -1000"):
                    call(httpclient, c, "picky", np.full((1, 4), -5000.0, np.float32))
        finally:
            c.close()
        time.sleep(1.0)  # tritonserver's log is followed, not pushed
    out = capfd.readouterr()
    text = caplog.text + out.out + out.err
    assert text.count("model picky failed: ValueError: x below -1000 is not supported") == 1
    assert text.count(f'{module}.py", line 16, in infer') == 1  # the user's line, once


def test_on_ray_the_models_traceback_reaches_the_servers_console_once(tmp_path):
    """``servekit serve --runtime ray``: the replica logs it, Ray forwards it to the driver."""
    pytest.importorskip("ray", reason="needs the ray extra")
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from conftest import free_port, wait_until

    (tmp_path / "picky_ray.py").write_text(PICKY)
    (tmp_path / "serve.toml").write_text(
        'runtime = "ray"\n[[models]]\nname = "picky"\nsource = "picky_ray:Picky"\npath = "."\n'
    )
    http = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("servekit")), "serve", "--config",
             str(tmp_path / "serve.toml"), "--host", "127.0.0.1", "--http-port", str(http)],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
        wait_until(lambda: _ready(c), "picky ready on Ray", 180)
        for _ in range(3):
            with pytest.raises(InferenceServerException, match="below -1000"):
                call(httpclient, c, "picky", np.full((1, 4), -5000.0, np.float32))
        c.close()
        wait_until(
            lambda: 'picky_ray.py", line 16, in infer' in log.read_text(), "the traceback", 30
        )
        time.sleep(2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    text = log.read_text()
    assert text.count("model picky failed: ValueError: x below -1000 is not supported") == 1
    assert text.count('picky_ray.py", line 16, in infer') == 1


def _ready(client) -> bool:
    try:
        return bool(client.is_model_ready("picky"))
    except Exception:
        return False
