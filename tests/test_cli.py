"""The command line, run through typer's runner in-process."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from servekit.cli import app
from servekit.stages import synthetic_image

cli = CliRunner()


def test_models_build_and_list(tmp_path):
    result = cli.invoke(
        app, ["models", "build", "tiny_cnn", "add_sub", "--cache-dir", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "tiny_cnn.onnx").exists() and (tmp_path / "add_sub.onnx").exists()
    listing = cli.invoke(app, ["models", "list", "--cache-dir", str(tmp_path)])
    assert listing.exit_code == 0
    rows = {line.split()[1]: line for line in listing.output.splitlines() if line.startswith("│ ")}
    assert "yes" in rows["tiny_cnn"] and "no" in rows["resnet50"]


def test_models_build_rejects_unknown_names(tmp_path):
    result = cli.invoke(app, ["models", "build", "vgg", "--cache-dir", str(tmp_path)])
    assert result.exit_code != 0
    assert "vgg" in result.output


def test_infer_prints_top_k_as_json(tmp_path, model_cache):
    image = tmp_path / "a.jpg"
    image.write_bytes(synthetic_image(0))
    result = cli.invoke(
        app,
        [
            "infer",
            str(image),
            "--model",
            "tiny_cnn",
            "--top-k",
            "3",
            "--json",
            "--cache-dir",
            str(model_cache),
        ],
    )
    assert result.exit_code == 0, result.output
    preds = json.loads(result.output)[str(image)]
    assert len(preds) == 3 and preds[0]["score"] >= preds[1]["score"] >= preds[2]["score"]


def test_infer_reports_an_undecodable_file_clearly(tmp_path, model_cache):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8 truncated")
    result = cli.invoke(
        app, ["infer", str(bad), "--model", "tiny_cnn", "--cache-dir", str(model_cache)]
    )
    assert result.exit_code == 2
    assert "cannot decode image" in result.output


def test_demo_classifies_a_generated_image(model_cache):
    result = cli.invoke(app, ["demo", "--model", "tiny_cnn", "--cache-dir", str(model_cache)])
    assert result.exit_code == 0, result.output
    assert "class_" in result.output


def test_commands_name_a_model_that_is_neither_in_the_zoo_nor_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a short relative path, so the error box does not wrap it
    for argv in (
        ["optimize", "missing.onnx"],
        ["accuracy", "missing.onnx", "--reference", "x.onnx"],
    ):
        result = cli.invoke(app, argv)
        assert result.exit_code == 2, result.output
        text = " ".join(result.output.split())
        assert "no zoo model or model file" in text and ".onnx'" in text


def test_bench_against_a_server_that_is_not_up_says_it_cannot_reach_it():
    from conftest import free_port

    port = free_port()
    for url in (f"http://127.0.0.1:{port}", f"grpc://127.0.0.1:{port}"):
        result = cli.invoke(app, ["bench", "--url", url, "--model", "m", "--concurrency", "1"])
        assert result.exit_code == 2, result.output
        assert "ServerUnreachable: cannot reach" in result.output, result.output
        assert "ModelNotReady" not in result.output


def test_serve_address_is_rays_and_is_refused_on_another_runtime():
    result = cli.invoke(
        app, ["serve", "--runtime", "native", "--model", "add_sub", "--address", "10.0.0.1:6379"]
    )
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "--address" in text and "needs --runtime ray, not native" in text, text
