"""``servekit bench --input-data`` and ``--shape``: perf_analyzer's input formats, read into
the requests the bench sends, and a model that validates its input benched on every
runtime with data it accepts (the bench's default random data, with negatives, fails)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from conftest import serve_on_runtime
from servekit import ModelConfig
from servekit.bench.inputdata import InputDataError, load_input_data, parse_shapes

META = [
    {"name": "X", "datatype": "FP32", "shape": [-1, -1]},
    {"name": "T", "datatype": "BYTES", "shape": [-1, 1]},
]


def test_json_entries_are_rows_stacked_into_requests_in_turn(tmp_path):
    data = tmp_path / "data.json"
    data.write_text(json.dumps({"data": [
        {"X": [1, 2, 3], "T": ["a"]},
        {"X": {"content": [4, 5, 6], "shape": [3]}, "T": {"content": ["b"], "shape": [1]}},
        {"X": {"b64": base64.b64encode(np.array([7, 8, 9], "<f4").tobytes()).decode()},
         "T": ["c"]},
    ]}))  # fmt: skip
    requests = load_input_data(str(data), META, batch_size=2)
    assert len(requests) == 2  # three rows, two a request: every row is sent
    assert requests[0]["X"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert requests[1]["X"].tolist() == [[7, 8, 9], [1, 2, 3]]
    assert requests[0]["X"].dtype == np.float32
    assert requests[1]["T"].tolist() == [[b"c"], [b"a"]]


def test_a_folder_holds_one_raw_file_per_input(tmp_path):
    (tmp_path / "X").write_bytes(np.arange(4, dtype="<f4").tobytes())
    (tmp_path / "T").write_bytes(b"hello\n")
    [request] = load_input_data(str(tmp_path), META, 1, parse_shapes(["X:4"]))
    assert request["X"].tolist() == [[0, 1, 2, 3]] and request["T"].tolist() == [[b"hello"]]


def test_zero_and_random_within_a_range_fill_the_given_shape():
    shapes = parse_shapes(["X:5"])
    [zero] = load_input_data("zero", META, 3, shapes)
    assert zero["X"].shape == (3, 5) and not zero["X"].any() and zero["T"].shape == (3, 1)
    [rand] = load_input_data("random:2:4", META, 8, shapes)
    assert rand["X"].shape == (8, 5) and rand["X"].min() >= 2 and rand["X"].max() <= 4
    ints = [{"name": "N", "datatype": "INT32", "shape": [-1, 3]}]
    [n] = load_input_data("random:-1:1", ints, 50)
    assert set(np.unique(n["N"])) == {-1, 0, 1}


@pytest.mark.parametrize(
    ("source", "shapes", "message"),
    [
        ("nowhere.json", [], "neither zero, random"),
        ("random:5:1", [], "LOW must be <= HIGH"),
        ("random:1", [], "random:LOW:HIGH"),
        ("zero", ["Y:3"], "names no input of the model: Y"),
        ("zero", ["X:3,3"], "does not fit the model's"),
        ("data.json", [], "entry 0 has no input 'T'"),
        ("short.json", ["X:4"], "input 'X': 3 values, but its shape \\[4\\] holds 4"),
        ("bad.json", [], "data\\.json|expected"),
    ],
)
def test_input_data_that_does_not_fit_the_model_is_refused_naming_why(
    tmp_path, monkeypatch, source, shapes, message
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.json").write_text(json.dumps({"data": [{"X": [1, 2]}]}))
    (tmp_path / "short.json").write_text(json.dumps({"data": [{"X": [1, 2, 3], "T": ["a"]}]}))
    (tmp_path / "bad.json").write_text(json.dumps([{"X": [1]}]))
    with pytest.raises(InputDataError, match=message):
        load_input_data(source, META, 1, parse_shapes(shapes))


def test_a_shape_without_a_name_is_refused():
    with pytest.raises(InputDataError, match="NAME:D1,D2"):
        parse_shapes(["3,224"])


VALIDATING = '''
import numpy as np
import servekit


class NonNegative(servekit.Model):
    """Sums each row of X, which must hold values in [0, 10]: anything else is the
    request's fault (a 400), as a model that validates its input answers."""

    inputs = [("X", "FP32", [-1])]
    outputs = [("SUM", "FP32", [1])]
    max_batch_size = 8

    def infer(self, batch):
        x = batch["X"]
        if (x < 0).any() or (x > 10).any():
            raise servekit.InvalidInput(f"input 'X': values must be in [0, 10], got {x.min()}")
        return {"SUM": x.sum(axis=1, keepdims=True)}
'''

FAST = ["--window", "0.3", "--warmup", "0.1", "--max-windows", "3", "--stability", "5"]


@pytest.fixture(params=["native", "pytriton", "triton", "ray"])
def serving(request):
    pytest.importorskip("tritonclient", reason="needs the triton extra")
    return serve_on_runtime(request, request.param)


def test_a_model_that_rejects_negatives_is_benched_with_its_own_data(serving, tmp_path):
    from typer.testing import CliRunner

    from servekit.cli import app

    (tmp_path / "nonneg.py").write_text(VALIDATING)
    data = tmp_path / "rows.json"
    data.write_text(json.dumps({"data": [{"X": [1, 2, 3]}, {"X": {"content": [0, 10]}}]}))
    model = ModelConfig("nonneg:NonNegative", "nonneg", path=str(tmp_path))
    with serving(model) as served:
        urls = [f"http://{served.host}:{served.http_port}"]
        if served.grpc_port is not None:
            urls.append(f"grpc://{served.host}:{served.grpc_port}")
        for url in urls:
            bench = ["bench", "--url", url, "--model", "nonneg", "--concurrency", "2", *FAST]
            # The default data (normal floats) has negatives: the first request is refused.
            refused = CliRunner().invoke(app, [*bench, "--shape", "X:16"])
            assert refused.exit_code == 2 and "values must be in [0, 10]" in refused.output
            for given in (
                ["--input-data", str(data)],
                ["--input-data", "random:0:10", "--shape", "X:16", "--batch-size", "4"],
                ["--input-data", "zero", "--shape", "X:3"],
            ):
                out = tmp_path / "run"
                result = CliRunner().invoke(app, [*bench, *given, "--out", str(out)])
                assert result.exit_code == 0, (url, given, result.output)
                [point] = next(iter(json.loads(out.with_suffix(".json").read_text())["series"]
                                    .values()))  # fmt: skip
                assert point["errors"] == 0 and point["requests"] > 0, (url, given, point)
