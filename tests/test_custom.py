"""Your own model's API: a ``Model`` subclass or an ``@infer_function`` becomes a Runner
with the signature it declares; import paths in the config load it (with ``path`` and
``[models.args]``); every way it can be wrong is refused naming what was wrong."""

from __future__ import annotations

import asyncio
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import servekit
from servekit import Batcher, ModelConfig, ServeConfig
from servekit.custom import UserRunner, import_model, is_import_path
from servekit.errors import InvalidInput, RunnerError
from servekit.runtime.base import load_models

X = {"X": np.arange(6, dtype=np.float32).reshape(3, 2)}


class Doubler(servekit.Model):
    inputs = [("X", "FP32", [2])]
    outputs = [("Y", "FP32", [2])]
    max_batch_size = 4

    def setup(self, factor: float = 2.0) -> None:
        self.factor = factor

    def infer(self, batch):
        return {"Y": batch["X"] * np.float32(self.factor)}


class AsyncDoubler(Doubler):
    async def infer(self, batch):
        await asyncio.sleep(0)
        return {"Y": batch["X"] * 2}


@servekit.infer_function(
    inputs=[("X", "FP32", [2])], outputs=[("Y", "FP32", [2])], max_batch_size=4
)
def keywords(X):  # noqa: N803 - PyTriton's @batch convention: one keyword per input
    return {"Y": X + 1}


@servekit.infer_function(
    inputs=[("X", "FP32", [2])], outputs=[("Y", "FP32", [2])], max_batch_size=4
)
def one_dict(batch):
    return {"Y": batch["X"] + 1}


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A module ``mine`` in a folder of its own (``path``), removed from sys.modules after."""
    (tmp_path / "mine.py").write_text(
        textwrap.dedent(
            """
            import numpy as np
            import servekit
            from servekit import BaseRunner, ModelSpec, TensorSpec

            class Scaled(servekit.Model):
                inputs = [("X", "FP32", [2])]
                outputs = [("Y", "FP32", [2])]
                max_batch_size = 8

                def setup(self, weights, bias=0.0):
                    self.w = np.loadtxt(weights, dtype=np.float32)
                    self.bias = np.float32(bias)

                def infer(self, batch):
                    return {"Y": batch["X"] * self.w + self.bias}

            class Failing(servekit.Model):
                inputs = [("X", "FP32", [2])]
                outputs = [("Y", "FP32", [2])]

                def setup(self):
                    raise OSError("no such weights")

            class Unsigned(servekit.Model):
                def infer(self, batch):
                    return batch

            class AsRunner(BaseRunner):
                def __init__(self, offset):
                    self._spec = ModelSpec((TensorSpec("X", "FP32", [2]),),
                                           (TensorSpec("Y", "FP32", [2]),), 8)
                    self.offset = offset

                def _run(self, inputs):
                    return {"Y": inputs["X"] + self.offset}

            def bare(batch):
                return batch

            NOT_CALLABLE = 3
            """
        )
    )
    (tmp_path / "weights.txt").write_text("3 4\n")
    monkeypatch.delitem(__import__("sys").modules, "mine", raising=False)
    yield tmp_path
    __import__("sys").modules.pop("mine", None)


def test_a_model_class_is_a_runner_with_its_declared_signature():
    model = Doubler()
    model.setup(factor=3.0)
    runner = UserRunner(model, "doubler")
    assert runner.spec.max_batch_size == 4
    assert [t.describe() for t in runner.spec.inputs] == ["X FP32 [2]"]
    assert np.array_equal(runner.infer(X)["Y"], X["X"] * 3)


@pytest.mark.parametrize("fn", [keywords, one_dict], ids=["keywords", "one dict"])
def test_a_function_takes_its_batch_as_keywords_or_as_one_dict(fn):
    assert np.array_equal(UserRunner(fn).infer(X)["Y"], X["X"] + 1)


def test_an_async_infer_runs_on_each_batcher_worker_s_own_loop():
    runner = UserRunner(AsyncDoubler(), "async")

    async def run() -> list[np.ndarray]:
        b = Batcher(runner, servekit.BatchingPolicy(max_batch_size=4), instance_count=2)
        rows = [{"X": np.full((1, 2), i, np.float32)} for i in range(16)]
        answers = await asyncio.gather(*(b.infer(r) for r in rows))
        await b.aclose()
        return [a["Y"] for a in answers]

    answers = asyncio.run(run())
    assert [a.tolist() for a in answers] == [[[2.0 * i] * 2] for i in range(16)]
    runner.close()


def test_what_the_model_returns_is_checked_naming_the_output():
    class Wrong(Doubler):
        def infer(self, batch):
            return self.answer

    model = Wrong()
    runner = UserRunner(model, "wrong")
    for answer, message in [
        ({"Z": np.zeros((3, 2), np.float32)}, r"no output 'Y'; got \['Z'\]"),
        ({"Y": np.zeros((3, 2), np.float64)}, "output 'Y': expected dtype FP32, got float64"),
        ({"Y": np.zeros((2, 2), np.float32)}, "output 'Y': expected 3 rows for 3 input rows"),
        ({"Y": np.zeros((3, 5), np.float32)}, r"output 'Y': expected shape \[-1,2\]"),
        ([1, 2], "infer must return a dict of output arrays, got list"),
    ]:
        model.answer = answer
        with pytest.raises(RunnerError, match=message):
            runner.infer(X)


def test_the_model_s_own_errors_keep_their_kind():
    class Raising(Doubler):
        def infer(self, batch):
            if batch["X"][0, 0] < 0:
                raise InvalidInput("input 'X': negative")
            raise KeyError("vocab")

    runner = UserRunner(Raising(), "raising")
    with pytest.raises(InvalidInput, match="input 'X': negative"):
        runner.infer({"X": -np.ones((1, 2), np.float32)})
    with pytest.raises(RunnerError, match=r"model raising: KeyError: 'vocab'"):
        runner.infer(X)


def test_an_import_path_loads_the_model_with_its_args(package):
    weights = str(package / "weights.txt")
    runner = import_model("mine:Scaled", path=str(package), args={"weights": weights, "bias": 1})
    assert runner.infer({"X": np.ones((1, 2), np.float32)})["Y"].tolist() == [[4.0, 5.0]]
    plain = import_model("mine:AsRunner", path=str(package), args={"offset": 5})
    assert plain.infer({"X": np.ones((1, 2), np.float32)})["Y"].tolist() == [[6.0, 6.0]]


@pytest.mark.parametrize(
    ("source", "args", "message"),
    [
        ("nowhere:Model", {}, r"cannot import 'nowhere:Model' .*ModuleNotFoundError"),
        ("mine:Missing", {}, r"cannot import 'mine:Missing' .*AttributeError"),
        ("mine:NOT_CALLABLE", {}, "is not a class or a function"),
        ("mine:Failing", {}, r"mine:Failing failed to set up: OSError: no such weights"),
        ("mine:Scaled", {}, r"failed to set up: TypeError: .*weights"),
        ("mine:Unsigned", {}, "declares no inputs or no outputs"),
        ("mine:bare", {}, r"needs its signature: decorate it with @servekit.infer_function"),
        ("mine:bare", {"a": 1}, r"is a function: it takes no \[models.args\]"),
        ("mine:AsRunner", {}, r"failed to set up: TypeError"),
    ],
)
def test_a_model_that_cannot_be_served_is_refused_naming_why(package, source, args, message):
    with pytest.raises(ValueError, match=rf"model m: .*{message}"):
        import_model(source, name="m", path=str(package), args=args)


def test_the_config_names_code_by_import_path(package, tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            runtime = "native"
            [[models]]
            source = "mine:Scaled"
            path = "{package}"
            [models.args]
            weights = "{package / "weights.txt"}"
            bias = 0.5
            [[models.versions]]
            version = 2
            source = "mine:AsRunner"
            """
        ).replace('source = "mine:AsRunner"', 'source = "mine:AsRunner"\n')
    )
    loaded = ServeConfig.load(config)
    (model,) = loaded.models
    assert model.name == "Scaled" and model.is_code and model.args["bias"] == 0.5
    assert ServeConfig.from_dict(loaded.to_dict()) == loaded
    assert is_import_path("pkg.sub:Model.inner") and not is_import_path("resnet50")
    assert not is_import_path("models/cnn.onnx")


def test_versions_of_your_model_are_other_import_paths(package):
    model = ModelConfig(
        "mine:Scaled", "m", path=str(package), args={"weights": str(package / "weights.txt")},
        versions=({"version": 2, "source": "mine:Scaled"},),
    )  # fmt: skip
    served = load_models(model)
    assert [m.version for m in served] == [1, 2]
    for m in served:
        assert m.runner.infer({"X": np.ones((1, 2), np.float32)})["Y"].tolist() == [[3.0, 4.0]]
        m.runner.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"source": "resnet50", "args": {"a": 1}}, "args is for your own model"),
        ({"source": "resnet50", "path": "models/"}, "path is for your own model"),
        ({"source": "mine:Scaled", "engine": "torch"}, "is your own code: engine and precision"),
        ({"source": "mine:Scaled", "args": [1]}, r"\[models.args\] must be a table"),
    ],
)
def test_knobs_that_do_not_apply_to_code_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


DTYPE = st.sampled_from(["FP32", "FP16", "INT32", "INT64", "UINT8", "BOOL", "BYTES"])
DIMS = st.lists(st.one_of(st.just(-1), st.integers(1, 8)), min_size=1, max_size=3)


@settings(max_examples=40, deadline=None)
@given(
    inputs=st.lists(st.tuples(DTYPE, DIMS), min_size=1, max_size=3),
    outputs=st.lists(st.tuples(DTYPE, DIMS), min_size=1, max_size=3),
    max_batch_size=st.sampled_from([0, 1, 8]),
)
def test_any_declared_signature_renders_to_triton_and_pytriton_and_back(
    inputs, outputs, max_batch_size
):
    from servekit.protocol.pbtxt import model_config, render
    from servekit.spec import spec_from_config

    declared = servekit.infer_function(
        inputs=[(f"IN{i}", d, s) for i, (d, s) in enumerate(inputs)],
        outputs=[(f"OUT{i}", d, s) for i, (d, s) in enumerate(outputs)],
        max_batch_size=max_batch_size,
    )(lambda batch: batch)
    spec = UserRunner(declared).spec
    config = model_config("m", spec, servekit.BatchingPolicy())
    from google.protobuf import json_format

    back = spec_from_config(json_format.MessageToDict(config, preserving_proto_field_name=True))
    assert back == spec, render(config)
    pytriton = pytest.importorskip("servekit.pytriton.binding")
    tensors = pytriton.pytriton_tensors(spec.inputs)
    assert [(t.name, tuple(t.shape)) for t in tensors] == [(s.name, s.shape) for s in spec.inputs]


def test_the_docs_example_is_the_example_file_and_runs(monkeypatch):
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "models.md").read_text()
    section = doc[doc.index("## Your own model") : doc.index("## Many models")]
    (cls, function) = re.findall(r"```python\n(.*?)```", section, re.S)
    toml, pipeline = re.findall(r"```toml\n(.*?)```", section, re.S)
    assert cls in (root / "examples" / "sentiment" / "sentiment.py").read_text()
    from servekit.config.serve import anchored

    monkeypatch.chdir(root / "docs")  # anywhere: paths are relative to the config file
    (model,) = ServeConfig.from_dict(
        anchored(__import__("tomllib").loads(toml), root / "examples" / "sentiment")
    ).models
    (served,) = load_models(model)
    answer = served.runner.infer({"TEXT": np.array([[b"I love it"], [b"bad"]], dtype=object)})
    assert answer["SCORE"].tolist() == [[2.5], [-1.0]]
    served.runner.close()
    (means,) = ServeConfig.from_dict(__import__("tomllib").loads(pipeline)).models
    assert [step.source for step in means.steps] == [
        "servekit.stages:Preprocess",
        "means:ChannelMeans",
    ]
    space: dict = {}
    exec(compile(function, "docs/models.md", "exec"), space)
    runner = UserRunner(space["add"])
    x = np.ones((2, 16), np.float32)
    assert runner.infer({"INPUT0": x, "INPUT1": x})["OUTPUT0"].tolist() == (2 * x).tolist()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "JSONDecodeError"),
        ('{"name": "m"}', r'no "source" \(module:attribute\)'),
        ('{"source": "mine:Scaled", "args": [1]}', r'"args" must be an object, got list'),
    ],
)
def test_the_triton_backend_names_what_is_wrong_in_a_code_json(tmp_path, text, message):
    from servekit.triton.backend import CODE_FILE, build_runner

    (tmp_path / CODE_FILE).write_text(text)
    with pytest.raises(ValueError, match=message):
        build_runner({"kind": "code"}, tmp_path, 8)
