"""One ServeConfig file, every runtime: each serves it and reports back the same knobs.

The file sets every batching knob (``BatchingPolicy`` and ``QueuePolicy``, priority queues
too), instances and threads to values other than their defaults. Each runtime is started
from that file, and what it actually runs with is read back from the runtime itself:
Triton's model configuration (PyTriton, and the Triton backend via ``repo build`` +
``servekit triton``), the Ray replica's Batcher and the deployment's replica count, the
native server's Batchers. A knob added to the config but not carried to a runtime fails
here: the read-back policy is compared whole, and ``test_the_file_sets_every_knob`` fails
until the file sets the new knob.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import urllib.request
import warnings

import numpy as np
import pytest

from conftest import free_port
from servekit import BatchingPolicy, Client, QueuePolicy, ServeConfig
from servekit.config import ModelConfig, RayOptions

pytest.importorskip("tritonclient.grpc")
try:  # Ray warns about its own dependencies' deprecations on first import
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from ray import serve
except ImportError:
    serve = None
else:

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Neighbour:
        """A plain Ray Serve application, no servekit in it."""

        def __call__(self, request: object) -> str:
            return "still here"


def config_text(classifier: str, adder: str, runtime: str) -> str:
    """Every knob off its default, in one model or the other (Triton allows neither DELAY
    nor several priority levels with preserve_ordering)."""
    return f"""
runtime = "{runtime}"

[server]
host = "127.0.0.1"

[[models]]
source = "{classifier}"
name = "tiny"
instances = 2
threads = 1
top_k = 3

[models.autoscale]
latency_budget_ms = 250.0
target_batch_fill = 0.7
target_queue_share = 0.2
window_s = 20.0

[models.batching]
max_batch_size = 6
preferred_batch_sizes = [2, 4]
max_queue_delay_us = 700
preserve_ordering = true
priority_levels = 1
default_priority_level = 1

[models.batching.queue]
max_queue_size = 50
default_timeout_us = 900000
allow_timeout_override = true

[models.batching.priority_queues.1]
max_queue_size = 7
default_timeout_us = 800000

[[models]]
source = "{adder}"
name = "adder"
overlap = false

[models.batching]
max_batch_size = 8
priority_levels = 2
default_priority_level = 2

[models.batching.queue]
timeout_action = "DELAY"
default_timeout_us = 700000

[models.batching.priority_queues.1]
max_queue_size = 9
"""


@pytest.fixture
def config_file(tmp_path, tiny_cnn_path, add_sub_path):
    def write(runtime: str):
        path = tmp_path / f"{runtime}.toml"
        path.write_text(config_text(str(tiny_cnn_path), str(add_sub_path), runtime))
        return path

    return write


def loaded(path, **server):
    config = ServeConfig.load(path).on_loopback()
    return config.replace(server=dataclasses.replace(config.server, **server))


def test_the_file_sets_every_knob(tmp_path, tiny_cnn_path, add_sub_path):
    path = tmp_path / "all.toml"
    path.write_text(config_text(str(tiny_cnn_path), str(add_sub_path), "native"))
    models = ServeConfig.load(path).models
    fixed = {"source", "name", "engine", "precision", "device", "labels", "image"}
    # Rollout's tables have their own end-to-end tests (test_rollout_served); the Triton
    # runtimes, which this file also configures, refuse them.
    fixed |= {"versions", "traffic", "canary"}
    # A store's Triton layout numbers a model's folder; [[models]] refuses it (test_config).
    fixed |= {"version", "version_policy"}
    # A latency budget replaces the queue delay and preferred sizes this file sets; it has
    # its own tests on native, Ray and the Triton runtimes' rendering (test_batching_budget).
    fixed |= {"latency_budget_ms", "latency_percentile"}
    # Your own code and pipelines have their own served tests on every runtime
    # (test_custom_served): this file's models are ONNX files.
    fixed |= {"path", "args", "steps"}
    # Sequences are served on native only so far, with their own served test
    # (test_sequence_served); the other runtimes refuse the table (checked there too).
    fixed |= {"sequence_batching"}
    # The response cache has its own served tests on native and Ray (test_cache_served);
    # the Triton runtimes, which this file also configures, refuse it by name.
    fixed |= {"response_cache"}
    # Where images decode has its own served tests on native and PyTriton
    # (test_device_decode); the Triton runtime refuses a device by name.
    fixed |= {"image_decode"}
    # Shedding is servekit's own (the batcher's, or the Triton fronts' window), not in
    # Triton's model configuration: its own served tests on every runtime (test_shedding).
    fixed |= {"shed_late"}
    for kind, default, of in (
        (BatchingPolicy, BatchingPolicy(), lambda m: m.batching),
        (QueuePolicy, QueuePolicy(), lambda m: m.batching.default_queue_policy),
        (ModelConfig, ModelConfig(), lambda m: m),
    ):
        left = [
            f.name
            for f in dataclasses.fields(kind)
            if f.name not in fixed
            and all(getattr(of(m), f.name) == getattr(default, f.name) for m in models)
        ]
        assert not left, f"the test config leaves {left} of {kind.__name__} at the default"


def expected(path) -> dict[str, ModelConfig]:
    return {m.name: m for m in ServeConfig.load(path).models}


def triton_model_config(grpc_url: str, name: str, headers: dict[str, str]):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(grpc_url.removeprefix("grpc://"))
    try:
        return client.get_model_config(name, headers=headers).config
    finally:
        client.close()


def answers(url: str) -> None:
    with Client(url) as c:
        c.wait_ready("tiny_image", timeout_s=120)
        out = c.infer("tiny", {"input": np.zeros((2, 3, 32, 32), np.float32)})
        assert out["logits"].shape == (2, 10)
        from servekit.stages import synthetic_image

        assert len(c.classify([synthetic_image(0)], model="tiny_image")[0]) == 3
        c.wait_ready("adder", timeout_s=60)
        x = np.ones((1, 16), np.float32)
        assert c.infer("adder", {"INPUT0": x, "INPUT1": x})["OUTPUT0"][0, 0] == 2


SERVED = {"tiny": "tiny", "tiny_image": "tiny", "adder": "adder"}
"""Served model -> the configured model whose knobs it runs with."""
STAGES = {"tiny": "tiny", "tiny_preprocess": "tiny", "tiny_postprocess": "tiny", "adder": "adder"}
"""The same for runtimes that run an image model as three deployments or models."""


def test_native_runs_the_files_policy_instances_and_threads(config_file):
    from servekit.native import NativeServer

    path = config_file("native")
    want = expected(path)
    with NativeServer(loaded(path)) as server:
        answers(server.config.server.http_url)
        assert set(server.models.batchers) == set(SERVED)
        for name, model in SERVED.items():
            batcher = server.models.batchers[name]
            assert batcher.policy == want[model].batching, name
            assert batcher.instance_count == want[model].instances, name
        runners = {m.name: m.runner for m in server.models}
        assert runners["tiny"].runner.threads == want["tiny"].threads
        assert server.app.metrics.autoscale["tiny"] == want["tiny"].autoscale


def test_pytriton_runs_the_files_policy_instances_and_threads(config_file):
    pytest.importorskip("pytriton")
    from servekit.front.demand import TritonDemand
    from servekit.pytriton import TritonServer

    path = config_file("pytriton")
    want = expected(path)
    with TritonServer.from_config(loaded(path)) as server:
        answers(server.server.http_url)
        token = {"triton-access-token": server.access_token}
        for name, model in SERVED.items():
            config = triton_model_config(server.server.grpc_url, name, token)
            assert BatchingPolicy.from_triton(config) == want[model].batching, name
            assert config.instance_group[0].count == want[model].instances, name
        runners = {m.name: m.runner for m in server.models}
        assert runners["tiny"].runner.threads == want["tiny"].threads
        (demand,) = [s for s in server._front.app.metrics._sources if isinstance(s, TritonDemand)]
        assert demand.policies["tiny"] == want["tiny"].autoscale


def test_the_triton_backend_runs_the_files_policy_instances_and_threads(
    config_file, tmp_path, model_cache
):
    pytest.importorskip("pytriton")
    from servekit.protocol.pbtxt import parse

    path = config_file("triton")
    want = expected(path)
    repo = tmp_path / "repo"
    built = subprocess.run(
        [sys.executable, "-m", "servekit", "repo", "build", str(repo), "--config", str(path),
         "--cache-dir", str(model_cache)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    assert sorted(p.name for p in repo.iterdir()) == sorted([*STAGES, "tiny_image"])
    for name, model in STAGES.items():
        written = parse((repo / name / "config.pbtxt").read_text())
        assert BatchingPolicy.from_triton(written) == want[model].batching, name

    http, grpc = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "servekit", "triton", "--model-repository", str(repo),
         "--config", str(path), "--http-port", str(http), "--grpc-port", str(grpc),
         "--metrics-port", str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        answers(f"http://127.0.0.1:{http}")
        configs = {
            name: triton_model_config(f"grpc://127.0.0.1:{grpc}", name, {}) for name in STAGES
        }
        for name, model in STAGES.items():
            assert BatchingPolicy.from_triton(configs[name]) == want[model].batching, name
            assert configs[name].instance_group[0].count == want[model].instances, name
        assert configs["tiny_postprocess"].parameters["top_k"].string_value == "3"
        assert configs["tiny"].parameters["threads"].string_value == str(want["tiny"].threads)
        assert configs["tiny"].parameters["overlap"].string_value == "auto"
        assert configs["adder"].parameters["overlap"].string_value == "false"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]


@pytest.mark.timeout(300)
def test_ray_runs_the_files_policy_replicas_and_threads(config_file):
    if serve is None:
        pytest.skip("needs the ray extra")
    from servekit.ray.runtime import RayRuntime

    path = config_file("ray")
    want = expected(path)
    config = loaded(path).replace(ray=RayOptions(model_cpus=0.25, stage_cpus=0.1))
    try:
        with RayRuntime(config, num_cpus=2) as runtime:
            answers(config.server.http_url)
            # A neighbour on the same Serve (a peer deployed for comparison): stopping
            # servekit deletes servekit's application and leaves it serving.
            serve.run(Neighbour.bind(), name="neighbour", route_prefix="/neighbour")
            replicas = runtime.deployments()
            for name, model in STAGES.items():
                handle = serve.get_deployment_handle(name, app_name="servekit")
                settings = handle.settings.remote().result(timeout_s=60)
                assert settings["policy"] == want[model].batching, name
            assert replicas["tiny"] == want["tiny"].instances
            assert replicas["adder"] == want["adder"].instances
            tiny = serve.get_deployment_handle("tiny", app_name="servekit")
            assert tiny.settings.remote().result(timeout_s=60)["threads"] == want["tiny"].threads
        assert list(serve.status().applications) == ["neighbour"]
        with urllib.request.urlopen(f"{config.server.http_url}/neighbour", timeout=30) as r:
            assert r.read() == b"still here"
    finally:
        serve.shutdown()
