"""Your own Python model served on every runtime: the example ``Sentiment`` (a lexicon
read in ``setup`` from ``[models.args]``) answers the same through tritonclient over
HTTP and gRPC on native, PyTriton, the Triton backend and Ray, with eight clients at once;
its errors (a request's fault, the code's failure, a wrong output) come back as 400s and
500s that name what was wrong, and the server goes on serving."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import serve_on_runtime
from servekit import BatchingPolicy, ModelConfig

pytest.importorskip("tritonclient", reason="needs the triton extra")
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

EXAMPLE = Path(__file__).parent.parent / "examples" / "sentiment"
TEXTS = [b"I love it", b"awful and slow", b"good good great", b"nothing here", b"fine"]
EXPECTED = {b"I love it": (2.5, 1), b"awful and slow": (-3.0, 2), b"good good great": (4.0, 3),
            b"nothing here": (0.0, 0), b"fine": (0.5, 1)}  # fmt: skip

BROKEN = '''
import numpy as np
import servekit


class Broken(servekit.Model):
    """Fails as its input asks: a ValueError, or an output with the wrong name, dtype or rows."""

    inputs = [("MODE", "INT32", [1])]
    outputs = [("Y", "FP32", [1])]
    max_batch_size = 8

    def infer(self, batch):
        mode = int(batch["MODE"][0, 0])
        n = len(batch["MODE"])
        if mode == 1:
            raise ValueError("the model's own bug")
        if mode == 2:
            return {"Z": np.zeros((n, 1), np.float32)}
        if mode == 3:
            return {"Y": np.zeros((n, 1), np.float64)}
        if mode == 4:
            return {"Y": np.zeros((n + 1, 1), np.float32)}
        if mode == 5:
            raise servekit.InvalidInput("input 'MODE': 5 is not a mode")
        return {"Y": np.full((n, 1), 7.0, np.float32)}
'''


def sentiment(**kwargs) -> ModelConfig:
    return ModelConfig(
        "sentiment:Sentiment", "sentiment", path=str(EXAMPLE), args={"lexicon": "lexicon.txt"},
        batching=BatchingPolicy(max_batch_size=32, max_queue_delay_us=500), **kwargs,
    )  # fmt: skip


@pytest.fixture(params=["native", "pytriton", "triton", "ray"])
def serving(request):
    return serve_on_runtime(request, request.param)


def ask(client, module, texts: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    text = module.InferInput("TEXT", [len(texts), 1], "BYTES")
    text.set_data_from_numpy(np.array(texts, dtype=object).reshape(-1, 1))
    result = client.infer("sentiment", [text])
    return result.as_numpy("SCORE"), result.as_numpy("KNOWN")


def connect(served) -> list:
    """A tritonclient of each protocol the runtime serves (Ray: HTTP), as (module, client)."""
    clients = [(httpclient, httpclient.InferenceServerClient(f"127.0.0.1:{served.http_port}"))]
    if served.grpc_port is not None:
        clients.append(
            (grpcclient, grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}"))
        )
    return clients


def test_your_own_model_answers_the_same_on_every_runtime_and_protocol(serving):
    with serving(sentiment()) as served:
        clients = connect(served)
        wrong: list[str] = []

        def client(k: int) -> None:
            own = connect(served)  # clients of its own: tritonclient's are one per thread
            try:
                asks(*own[k % len(own)], k)
            finally:
                for _, c in own:
                    c.close()

        def asks(module, c, k: int) -> None:
            for i in range(20):
                texts = [TEXTS[(k + i + j) % len(TEXTS)] for j in range(1 + (k + i) % 3)]
                try:
                    score, known = ask(c, module, texts)
                except InferenceServerException as exc:
                    wrong.append(f"{module.__name__}: {exc.message()}")
                    continue
                want = np.array([EXPECTED[t] for t in texts])
                if not (np.allclose(score[:, 0], want[:, 0]) and (known[:, 0] == want[:, 1]).all()):
                    wrong.append(f"{texts}: {score.tolist()} {known.tolist()}")

        try:
            meta = clients[0][1].get_model_metadata("sentiment")
            assert [(t["name"], t["datatype"]) for t in meta["inputs"]] == [("TEXT", "BYTES")]
            assert [t["name"] for t in meta["outputs"]] == ["SCORE", "KNOWN"]
            threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not wrong, wrong[:5]
            # Idle again once they stop: nothing left queued for the model.
            assert served.pending("sentiment") == 0
            # A request's fault, raised by the model as InvalidInput: a 400 naming it.
            for module, c in clients:
                with pytest.raises(InferenceServerException, match="not UTF-8") as caught:
                    ask(c, module, [b"\xff\xfe"])
                assert caught.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
                assert ask(c, module, [b"great"])[0].tolist() == [[2.0]]
        finally:
            for _, c in clients:
                c.close()


def test_a_failing_model_names_what_went_wrong_and_the_server_goes_on(serving, tmp_path):
    (tmp_path / "broken.py").write_text(BROKEN)
    model = ModelConfig("broken:Broken", "broken", path=str(tmp_path))
    with serving(model) as served:
        clients = connect(served)

        def call(module, c, mode: int) -> np.ndarray:
            x = module.InferInput("MODE", [1, 1], "INT32")
            x.set_data_from_numpy(np.array([[mode]], np.int32))
            return c.infer("broken", [x]).as_numpy("Y")

        try:
            for module, c in clients:
                for mode, message in [
                    (1, r"broken.*ValueError: the model's own bug"),
                    (2, r"no output 'Y'"),
                    (3, r"output 'Y': expected dtype FP32, got float64"),
                    (4, r"output 'Y': expected 1 rows for 1 input rows, got 2"),
                    (5, r"input 'MODE': 5 is not a mode"),
                ]:
                    with pytest.raises(InferenceServerException, match=message):
                        call(module, c, mode)
                    assert call(module, c, 0).tolist() == [[7.0]]  # still serving
        finally:
            for _, c in clients:
                c.close()


@pytest.fixture(params=["native", "ray"])
def with_store(request, tmp_path_factory):
    """Serve beside a [store] of ten add_sub models under a budget that holds a few, on
    the runtimes that have a store."""
    import onnx

    from conftest import on, on_ray
    from servekit.config import StoreConfig
    from servekit.zoo.tiny import build_add_sub

    root = tmp_path_factory.mktemp("store")
    for i in range(10):
        onnx.save(build_add_sub(weights_mb=2), root / f"add_{i}.onnx")
    store = StoreConfig(root=str(root), memory_budget_mb=80, load="on_demand")
    if request.param == "ray":
        url = request.getfixturevalue("ray_url")
        return lambda model: on_ray(url, model, store=store)
    return lambda model: on(request.param, store)(model)


def test_your_model_in_a_store_with_a_canary_version_answers_every_request(with_store):
    from servekit.rollout import ModelVersion, TrafficPolicy

    model = sentiment(
        versions=(ModelVersion(2, "sentiment:Sentiment"),),
        traffic=TrafficPolicy(split={1: 50, 2: 50}),
    )
    with with_store(model) as served:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{served.http_port}")
        try:
            answered: set[str] = set()
            for i in range(40):
                texts = [TEXTS[i % len(TEXTS)]]
                text = httpclient.InferInput("TEXT", [1, 1], "BYTES")
                text.set_data_from_numpy(np.array(texts, dtype=object).reshape(-1, 1))
                result = c.infer("sentiment", [text])
                assert result.as_numpy("SCORE")[0, 0] == EXPECTED[texts[0]][0]
                answered.add(result.get_response()["model_version"])
                a = np.ones((1, 16), np.float32)  # the store's other models, in turn
                tensors = [httpclient.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
                for t in tensors:
                    t.set_data_from_numpy(a)
                assert c.infer(f"add_{i % 10}", tensors).as_numpy("OUTPUT0").tolist() == [
                    [2.0] * 16
                ]
            assert answered == {"1", "2"}
            index = {(e["name"], e["version"]): e for e in c.get_model_repository_index()}
            assert ("sentiment", "1") in index and ("sentiment", "2") in index
        finally:
            c.close()


MEANS = '''
import numpy as np
import servekit


class ChannelMeans(servekit.Model):
    """What a user's step after a built-in stage looks like: a tensor in, a summary out."""

    inputs = [("input", "FP32", [3, 32, 32])]
    outputs = [("means", "FP32", [3])]
    max_batch_size = 8

    def infer(self, batch):
        return {"means": batch["input"].mean(axis=(2, 3)).astype(np.float32)}
'''


def means_pipeline(folder: Path, name: str, crop: int) -> ModelConfig:
    """Preprocess (image bytes to a ``crop`` x ``crop`` tensor), then ``ChannelMeans``."""
    (folder / "means.py").write_text(MEANS)
    return ModelConfig(
        name=name,
        steps=(
            {"source": "servekit.stages:Preprocess", "args": {"resize": crop, "crop": crop}},
            {"source": "means:ChannelMeans", "path": str(folder)},
        ),
        batching=BatchingPolicy(max_batch_size=8),
    )


def test_a_pipeline_of_a_built_in_stage_and_your_model_serves_as_one_model(serving, tmp_path):
    import io

    from PIL import Image

    from servekit.runtime.base import load_model_runner

    model = means_pipeline(tmp_path, "means", crop=32)
    rng = np.random.default_rng(0)
    images = []
    for _ in range(3):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), np.uint8)).save(buffer, "PNG")
        images.append(buffer.getvalue())
    blobs = np.array(images, dtype=object).reshape(-1, 1)
    local = load_model_runner(model)
    want = local.infer({"image": blobs})["means"]
    local.close()
    with serving(model) as served:
        for module, c in connect(served):
            try:
                as_json = {"as_json": True} if module is grpcclient else {}
                meta = c.get_model_metadata("means", **as_json)
                assert [t["name"] for t in meta["inputs"]] == ["image"]
                x = module.InferInput("image", [3, 1], "BYTES")
                x.set_data_from_numpy(blobs)
                got = c.infer("means", [x]).as_numpy("means")
                assert np.allclose(got, want, atol=1e-6), (got, want)
            finally:
                c.close()


def test_a_pipeline_whose_steps_do_not_fit_is_refused_naming_them(tmp_path):
    from servekit.runtime.base import load_model_runner

    model = means_pipeline(tmp_path, "bad", crop=64)  # ChannelMeans takes 32x32
    with pytest.raises(ValueError, match=r"pipeline bad: step 1 \(UserRunner\) input 'input'"):
        load_model_runner(model)


def test_code_that_fails_to_set_up_is_refused_naming_why_and_others_serve(tmp_path):
    import onnx

    from conftest import on
    from servekit import ServeConfig, ServerConfig
    from servekit.config import StoreConfig
    from servekit.serving import create_runtime
    from servekit.zoo.tiny import build_add_sub

    (tmp_path / "failing.py").write_text(
        "import servekit\n\n\nclass Failing(servekit.Model):\n"
        "    inputs = [('X', 'FP32', [1])]\n    outputs = [('Y', 'FP32', [1])]\n\n"
        "    def setup(self):\n        raise OSError('weights missing')\n"
    )
    failing = ModelConfig("failing:Failing", "failing", path=str(tmp_path))
    # Alone, the server refuses to start, saying why.
    config = ServeConfig((failing,), ServerConfig(exit_timeout_s=2), runtime="native")
    with pytest.raises(ValueError, match="failing:Failing failed to set up: OSError: weights"):
        create_runtime(config.on_loopback()).start()
    # In a store, the load of that model fails so (each time it is asked for), the rest serve.
    onnx.save(build_add_sub(), tmp_path / "add.onnx")
    store = StoreConfig(root=str(tmp_path), load="on_demand")
    with on("native", store)(failing) as served:
        c = httpclient.InferenceServerClient(f"127.0.0.1:{served.http_port}")
        try:
            x = httpclient.InferInput("X", [1, 1], "FP32")
            x.set_data_from_numpy(np.ones((1, 1), np.float32))
            for _ in range(2):
                with pytest.raises(InferenceServerException, match="OSError: weights missing"):
                    c.infer("failing", [x])
            tensors = [httpclient.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
            for t in tensors:
                t.set_data_from_numpy(np.ones((1, 16), np.float32))
            assert c.infer("add", tensors).as_numpy("OUTPUT0").tolist() == [[2.0] * 16]
            (row,) = [e for e in c.get_model_repository_index() if e["name"] == "failing"]
            assert row["state"] == "UNAVAILABLE" and "weights missing" in row["reason"]
        finally:
            c.close()
