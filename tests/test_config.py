"""ServeConfig: one description of what to serve, from files and flags, checked per runtime."""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servekit import (
    BatchingPolicy,
    ModelConfig,
    QueuePolicy,
    ServeConfig,
    ServerConfig,
    TimeoutAction,
)
from servekit.autoscale import AutoscalePolicy
from servekit.batching.sequence import SequencePolicy
from servekit.config import RUNTIMES, RayOptions
from servekit.config.server import StoreConfig, TracingConfig
from servekit.rollout import ModelVersion
from servekit.rollout.policy import CanaryPolicy, TrafficPolicy
from servekit.storage.objects import StorageConfig

FULL = """
runtime = "native"
cache_dir = "/tmp/models"

[server]
host = "127.0.0.1"
http_port = 9000
inference_token = "secret"

[[models]]
source = "resnet50"
name = "net"
instances = 2
threads = 1
top_k = 3

[models.batching]
max_batch_size = 16
preferred_batch_sizes = [4, 8]
max_queue_delay_us = 500
priority_levels = 2
default_priority_level = 1

[models.batching.queue]
max_queue_size = 64
timeout_action = "DELAY"
default_timeout_us = 1000

[models.batching.priority_queues.2]
max_queue_size = 8

[[models]]
source = "add_sub"
image = false
"""


def test_a_toml_file_describes_every_section(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(FULL)
    config = ServeConfig.load(path)
    assert config.runtime == "native" and config.cache_dir == "/tmp/models"
    assert config.server == ServerConfig(host="127.0.0.1", http_port=9000, inference_token="secret")
    net, add_sub = config.models
    assert (net.name, net.instances, net.threads, net.top_k) == ("net", 2, 1, 3)
    assert net.batching == BatchingPolicy(
        max_batch_size=16,
        preferred_batch_sizes=(4, 8),
        max_queue_delay_us=500,
        priority_levels=2,
        default_priority_level=1,
        default_queue_policy=QueuePolicy(
            max_queue_size=64, default_timeout_us=1000, timeout_action=TimeoutAction.DELAY
        ),
        priority_queue_policies={2: QueuePolicy(max_queue_size=8)},
    )
    assert add_sub == ModelConfig("add_sub", image=False)


def test_the_one_model_shorthand_of_earlier_files_still_reads(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text('model = "tiny_cnn"\ninstances = 2\n[batching]\nmax_batch_size = 4\n')
    (model,) = ServeConfig.load(path).models
    assert model == ModelConfig("tiny_cnn", instances=2, batching=BatchingPolicy(max_batch_size=4))


def test_yaml_reads_like_toml(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "serve.yaml"
    path.write_text("models:\n  - source: tiny_cnn\n    batching:\n      max_batch_size: 4\n")
    assert ServeConfig.load(path).models[0].batching.max_batch_size == 4


def test_to_toml_reads_back_equal(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(FULL)
    config = ServeConfig.load(path)
    again = tmp_path / "again.toml"
    again.write_text(config.to_toml())
    assert ServeConfig.load(again) == config


@given(token=st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=20))
def test_any_string_a_config_holds_is_written_as_valid_toml(token):
    """Newlines, quotes, backslashes and control characters too."""
    config = ServeConfig(server=ServerConfig(control_token=token))
    assert ServeConfig.from_dict(tomllib.loads(config.to_toml())) == config


@given(
    max_batch=st.integers(0, 64),
    delay=st.integers(0, 10_000),
    queue=st.integers(0, 100),
    instances=st.integers(1, 4),
    runtime=st.sampled_from(RUNTIMES),
    front=st.booleans(),
)
def test_any_config_round_trips_through_its_dict(
    max_batch, delay, queue, instances, runtime, front
):
    model = ModelConfig(
        "m.onnx",
        batching=BatchingPolicy(
            max_batch_size=max_batch,
            max_queue_delay_us=delay,
            default_queue_policy=QueuePolicy(max_queue_size=queue),
        ),
        instances=instances,
    )
    config = ServeConfig((model,), ServerConfig(front=front), runtime=runtime)
    assert ServeConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("modle = 'x'", r"unknown key\(s\) \['modle'\] in \[top level\]"),
        ("[server]\nhttp = 1", r"unknown key\(s\) \['http'\] in \[server\]"),
        (
            "[batching]\nmax_batch = 1",
            r"unknown key\(s\) \['max_batch'\] in \[top level.batching\]",
        ),
        (
            "[[models]]\n[models.batching.queue]\nsize = 1",
            r"unknown key\(s\) \['size'\] in \[models.0.batching.queue\]",
        ),
        ("[batching]\nmax_queue_delay_us = -1", "max_queue_delay_us must be >= 0, got -1"),
        ("runtime = 'kserve'", r"runtime must be one of \['pytriton', 'triton', 'native', 'ray'\]"),
        ("[server]\nhttp_port = 70000", r"http_port must be in \[1, 65535\], got 70000"),
        ("[[models]]\nengine = 'tvm'", "engine must be one of"),
        ("[[models]]\nname = 'a/b'", "model name must be letters"),
        ("[[models]]\nsource = 'x'\n[[models]]\nsource = 'x'", "served model names must be unique"),
        ("[[models]]\nsource = 'a'\n[[models]]\nsource = 'a_image'", "must be unique"),
    ],
)
def test_bad_config_files_name_the_file_and_the_bad_key(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        ServeConfig.load(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[server]\nfront = 'no'", "[server] front: expected true or false, got 'no'"),
        ("[server]\nhttp_port = 'abc'", "[server] http_port: expected an integer, got 'abc'"),
        ("[[models]]\nimage = 'false'", "[models.0] image: expected true or false, got 'false'"),
        ("[[models]]\nthreads = 1.5", "[models.0] threads: expected an integer or null, got 1.5"),
        (
            "[[models]]\n[models.batching]\npreserve_ordering = 'no'",
            "[models.0.batching] preserve_ordering: expected true or false, got 'no'",
        ),
        (
            "[[models]]\n[models.batching]\npreferred_batch_sizes = [4, true]",
            "[models.0.batching] preferred_batch_sizes: expected a list of integers, got [4, True]",
        ),
        ("runtime = 5", "[top level] runtime: expected a string, got 5"),
        (
            "[[models]]\n[models.batching]\nlatency_budget_ms = nan",
            "[models.0.batching] latency_budget_ms: expected a number, got nan",
        ),
    ],
)
def test_a_value_of_another_kind_than_its_key_takes_is_refused_naming_both(tmp_path, text, message):
    """``front = "no"`` was taken as true (a non-empty string), ``8.5`` as a batch size,
    and ``http_port = "abc"`` failed inside Python's comparison."""
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        ServeConfig.load(path)
    assert str(info.value) == f"{path}: {message}"


TABLES = [
    (ServeConfig.from_dict, ServeConfig, "top level"),
    (ServerConfig.from_dict, ServerConfig, "server"),
    (TracingConfig.from_dict, TracingConfig, "server.tracing"),
    (ModelConfig.from_dict, ModelConfig, "models"),
    (BatchingPolicy.from_dict, BatchingPolicy, "batching"),
    (QueuePolicy.from_dict, QueuePolicy, "batching.queue"),
    (lambda d: SequencePolicy.from_dict(d, "seq"), SequencePolicy, "seq"),
    (AutoscalePolicy.from_dict, AutoscalePolicy, "models.autoscale"),
    (ModelVersion.from_dict, ModelVersion, "models.versions"),
    (TrafficPolicy.from_dict, TrafficPolicy, "models.traffic"),
    (CanaryPolicy.from_dict, CanaryPolicy, "models.canary"),
    (StorageConfig.from_dict, StorageConfig, "storage"),
    (RayOptions.from_dict, RayOptions, "ray"),
    (StoreConfig.from_dict, StoreConfig, "store"),
]


@pytest.mark.parametrize(
    "make",
    [
        lambda: BatchingPolicy(latency_budget_ms=float("nan")),
        lambda: AutoscalePolicy(window_s=float("nan")),
        lambda: ServerConfig(request_timeout_s=float("nan")),
        lambda: StoreConfig(wait_s=float("nan")),
        lambda: CanaryPolicy(max_p99_increase_ms=float("nan")),
        lambda: StorageConfig(progress_s=float("nan")),
    ],
)
def test_nan_is_no_duration_or_budget(make):
    """NaN passed every ``< 0`` check (every comparison with it is false)."""
    with pytest.raises(ValueError, match="nan"):
        make()


@pytest.mark.parametrize(("read", "cls", "section"), TABLES, ids=[t[2] for t in TABLES])
def test_every_table_refuses_a_value_of_the_wrong_kind_for_each_plain_key(read, cls, section):
    """Every flag, number, string or list of them in every table, given a value a careless
    file might hold: a flag as a string, a number as a string, a string as a number."""
    hints = typing.get_type_hints(cls)
    checked = 0
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        if bool in kinds:
            wrong: object = "no"
        elif int in kinds or float in kinds:
            wrong = "1"
        elif str in kinds:
            wrong = 1
        elif any(typing.get_origin(k) is tuple and typing.get_args(k)[0] is int for k in kinds):
            wrong = "4"
        else:
            continue  # a table or a choice of words: checked by its own class
        with pytest.raises(ValueError, match=rf"^\[{section}\] {field.name}: expected "):
            read({field.name: wrong})
        checked += 1
    assert checked


def test_other_file_types_are_refused(tmp_path):
    path = tmp_path / "serve.ini"
    path.write_text("")
    with pytest.raises(ValueError, match=r"\.toml, \.yaml or \.yml"):
        ServeConfig.load(path)


@pytest.mark.parametrize(
    ("runtime", "server", "ray", "message"),
    [
        (
            "ray",
            {"grpc_port": 9001},
            None,
            r"the ray runtime cannot honour: server.grpc_port = 9001",
        ),
        ("ray", {"front": False}, None, "server.front = False"),
        ("native", {}, RayOptions(model_cpus=0.5), r"\[ray\] \(Ray deployment options\)"),
        ("pytriton", {"inference_token": "t"}, None, "server.inference_token"),
        ("triton", {}, RayOptions(model_cpus=0.5), r"\[ray\] \(Ray deployment options\)"),
    ],
)
def test_a_knob_a_runtime_cannot_honour_is_an_error_naming_both(runtime, server, ray, message):
    config = ServeConfig(server=ServerConfig(**server), runtime=runtime, ray=ray or RayOptions())
    with pytest.raises(ValueError, match=message):
        config.check()
    other = "ray" if ray else "pytriton" if runtime != "pytriton" else "native"
    with pytest.raises(ValueError, match=message):  # asked from a config for another runtime
        config.replace(runtime=other).check(runtime)


def test_a_store_on_ray_keeps_one_ingress_replica_and_says_so_if_asked_for_more(tmp_path):
    from servekit.config import StoreConfig

    config = ServeConfig(runtime="ray", store=StoreConfig(root=str(tmp_path)))
    config.check()
    with pytest.raises(ValueError, match=r"\[ray\] ingress_replicas = 3 with a \[store\]"):
        config.replace(ray=RayOptions(ingress_replicas=3)).check()


def test_rollout_round_trips_and_a_bad_table_is_refused_naming_it(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(
        """
[[models]]
source = "add_sub"
[[models.versions]]
version = 2
source = "add_sub_v2.onnx"
[models.traffic]
split = { 1 = 90, 2 = 10 }
sticky = "x-session"
shadow = 2
[models.canary]
min_requests = 200
step = [10, 50, 100]
"""
    )
    config = ServeConfig.load(path)
    (model,) = config.models
    assert model.version_numbers == (1, 2) and model.traffic.split == {1: 90, 2: 10}
    assert model.for_version(2).source == "add_sub_v2.onnx" and not model.for_version(2).versions
    with pytest.raises(ValueError, match=r"model 'add_sub' has no version 3; it has \[1, 2\]"):
        model.for_version(3)
    assert ServeConfig.from_dict(tomllib.loads(config.to_toml())) == config
    base = path.read_text().split("[models.traffic]")[0]
    for text, message in [
        (
            "[models.traffic]\nsplit = { 1 = 50, 3 = 50 }",
            r"names version\(s\) \[3\]; the model has \[1, 2\]",
        ),
        ("[models.traffic]\nsplit = { 1 = 50, 2 = 40 }", r"shares must sum to 100, got 90"),
        (
            "[models.canary]\nmin_requests = 5",
            r"\[models.canary\] needs a \[models.traffic\] split",
        ),
        (
            "[models.traffic]\nsplit = { 1 = 100 }\nweights = 1",
            r"unknown key\(s\) \['weights'\] in \[models.0.traffic\]",
        ),
    ]:
        path.write_text(base + text)
        with pytest.raises(ValueError, match=message):
            ServeConfig.load(path)


def test_the_triton_runtimes_route_versions_only_through_the_front():
    model = ModelConfig("add_sub", versions=(ModelVersion(2, "v2.onnx"),))
    for runtime in RUNTIMES:
        ServeConfig((model,), runtime=runtime).check()
    for runtime in ("pytriton", "triton"):
        no_front = ServeConfig((model,), ServerConfig(front=False), runtime=runtime)
        with pytest.raises(
            ValueError,
            match=rf"the {runtime} runtime cannot honour: models.add_sub: versions and "
            r"\[models.traffic\] with server.front = false",
        ):
            no_front.check()


def test_pytriton_s_name_for_a_version_is_reserved():
    model = ModelConfig("add_sub", "m", versions=(ModelVersion(2, "v2.onnx"),))
    with pytest.raises(ValueError, match=r"served model names must be unique, got .*'m.v2'"):
        ServeConfig((model, ModelConfig("add_sub", "m.v2")))


def test_a_config_is_checked_once_however_many_entry_points_ask(monkeypatch):
    config = ServeConfig(runtime="native")
    seen = []
    monkeypatch.setattr(ServeConfig, "_check", lambda self, runtime: seen.append(runtime))
    assert config.check() is config.check("native") is config.check() is config
    config.check("triton")
    assert seen == ["native", "triton"]
    config.replace(server=ServerConfig(log_verbose=1)).check()  # a new config: checked anew
    assert seen == ["native", "triton", "native"]


def test_every_runtime_takes_the_defaults():
    for runtime in RUNTIMES:
        ServeConfig(runtime=runtime).check()


def test_on_loopback_gives_free_ports_only_to_the_ports_a_runtime_listens_on():
    ray = ServeConfig(runtime="ray").on_loopback()
    assert ray.server.host == "127.0.0.1" and ray.server.http_port != 8000
    assert ray.server.grpc_port == 8001 and ray.check()
    native = ServeConfig(runtime="native").on_loopback()
    assert native.server.metrics_port != 8002


def test_the_cluster_servekit_starts_takes_its_ports_as_a_block_or_a_list_and_says_them():
    """``[ray] ports``: the Ray the ray runtime starts (``compare --ports`` fills them)."""
    from servekit.config.server import ray_port_count
    from servekit.endpoints import free_port

    ray = RayOptions(ports="20000:20041")
    assert ray.ports == tuple(range(20000, 20042))
    config = ServeConfig((ModelConfig("m.onnx"),), runtime="ray", ray=ray).check()
    assert ServeConfig.from_dict(tomllib.loads(config.to_toml())) == config
    line = config.listening()
    assert "the Ray servekit starts: GCS 20000, node manager 20001," in line
    assert "dashboard metrics 20009, worker processes 20010-20041 (and Ray Serve's" in line
    assert "listed once it has started" in ServeConfig(runtime="ray").listening()
    first = free_port()
    within = ServeConfig(runtime="ray").on_loopback((first, first + 99))  # compare --ports
    assert len(within.ray.ports) == ray_port_count() == len(set(within.ray.ports))
    assert all(first <= p <= first + 99 for p in (within.server.http_port, *within.ray.ports))
    assert ServeConfig(runtime="ray").on_loopback().ray.ports == ()  # no range: Ray picks


def test_cluster_ports_that_cannot_hold_are_refused_by_name():
    with pytest.raises(ValueError, match="the cluster at address = 'head:6379' has its own"):
        RayOptions(ports="20000:20041", address="head:6379")
    with pytest.raises(ValueError, match=r"at least 18 \(10 of its own, .*got 3: \[1, 2, 3\]"):
        RayOptions(ports=(1, 2, 3))
    with pytest.raises(ValueError, match=r"got \[20000\] more than once"):
        RayOptions(ports=(20000, *range(20000, 20020)))
    with pytest.raises(ValueError, match=r"got \[65536, 65537\] outside"):
        RayOptions(ports=tuple(range(65520, 65538)))
    with pytest.raises(ValueError, match=r"cannot honour: \[ray\]"):
        ServeConfig(runtime="native", ray=RayOptions(ports="20000:20041")).check()


def test_port_base_gives_each_runtime_the_ports_it_opens_and_its_own_cluster_the_next():
    """``--port-base N``: the ray runtime opens HTTP N and its Ray gets N+6 on."""
    import typer

    from servekit.cli.serve import SERVER_FLAGS, _from_port_base
    from servekit.config.server import ray_port_count

    flags: dict[str, object] = dict.fromkeys(SERVER_FLAGS)
    ray = _from_port_base(ServeConfig(runtime="ray"), 21000, flags)
    assert (ray.server.http_port, ray.server.grpc_port) == (21000, 8001)  # HTTP only
    assert ray.ray.ports == tuple(range(21006, 21006 + ray_port_count()))
    theirs = ServeConfig(runtime="ray", ray=RayOptions(address="head:6379"))
    assert _from_port_base(theirs, 21000, flags).ray.ports == ()  # the cluster's own
    native = ServeConfig(runtime="native", server=ServerConfig(grpc_port=9))
    native = _from_port_base(native, 21000, {**flags, "grpc_port": 9})  # a flag given wins
    assert (native.server.http_port, native.server.grpc_port, native.server.metrics_port) == (
        21000, 9, 21002
    )  # fmt: skip
    pytriton = _from_port_base(ServeConfig(runtime="pytriton"), 21000, flags)
    assert pytriton.private_ports() == {
        "triton_http_port": 21003, "triton_grpc_port": 21004, "triton_metrics_port": 21005
    }  # fmt: skip
    with pytest.raises(typer.BadParameter, match="outside"):
        _from_port_base(ServeConfig(runtime="ray"), 65500, flags)


def test_flags_override_the_file_for_every_model():
    base = ServeConfig(
        (
            ModelConfig("a", batching=BatchingPolicy(max_batch_size=8, max_queue_delay_us=10)),
            ModelConfig("b"),
        )
    )
    config = base.with_overrides(
        model={"threads": 2, "name": None},
        batching={"preferred_batch_sizes": [4], "max_batch_size": None},
        queue={"max_queue_size": 5},
        server={"http_port": 9000},
        runtime="ray",
    )
    a, b = config.models
    assert a.threads == b.threads == 2
    assert a.batching == BatchingPolicy(
        max_batch_size=8,
        preferred_batch_sizes=(4,),
        max_queue_delay_us=10,
        default_queue_policy=QueuePolicy(max_queue_size=5),
    )
    assert config.server.http_port == 9000 and config.runtime == "ray"


def test_model_flags_replace_the_files_models_and_keep_the_first_ones_settings():
    base = ServeConfig((ModelConfig("a", name="first", instances=3),))
    config = base.with_overrides(models=["x.onnx", "y"])
    assert [(m.name, m.instances) for m in config.models] == [("x", 3), ("y", 3)]
    with pytest.raises(ValueError, match="--name applies to one model"):
        base.with_overrides(models=["x", "y"], model={"name": "z"})


def test_a_models_version_number_comes_from_a_store_s_layout_and_is_refused_in_models():
    config = ServeConfig((ModelConfig("m.onnx", "m", version=3),), runtime="native")
    with pytest.raises(ValueError, match=r"models.m: version = 3 \(the number a \[store\] root"):
        config.check("native")
    with pytest.raises(ValueError, match="version must be >= 1"):
        ModelConfig("m.onnx", "m", version=0)
    three = ModelConfig("m.onnx", "m", version=3, versions=(ModelVersion(4, "n.onnx"),))
    assert three.version_numbers == (3, 4) and three.for_version(4).source == "n.onnx"
    assert "version" not in ModelConfig("m.onnx", "m").to_dict()


def test_a_store_s_version_folders_are_served_by_policy_and_by_the_split_that_names_them(
    tmp_path,
):
    from servekit.store.catalog import catalog

    for number in (1, 2, 3):
        (tmp_path / "models" / "m" / str(number)).mkdir(parents=True)
        (tmp_path / "models" / "m" / str(number) / "model.onnx").write_bytes(b"")
    (tmp_path / "models" / "flat.onnx").write_bytes(b"")
    path = tmp_path / "serve.toml"

    def served(models: str) -> dict[str, ModelConfig]:
        path.write_text(f'runtime = "native"\n[store]\nroot = "models"\n{models}')
        return catalog(ServeConfig.load(path))

    def folder(number: int) -> str:
        return str(tmp_path / "models" / "m" / str(number) / "model.onnx")

    latest = served("")["m"]  # Triton's default: the highest version, keeping its number
    assert latest.version_numbers == (3,) and latest.source == folder(3)
    split = served(
        '[[models]]\nname = "m"\ninstances = 2\n[models.traffic]\nsplit = { 1 = 50, 2 = 50 }'
    )
    m = split["m"]
    assert m.instances == 2 and m.version_numbers == (3, 1, 2)  # its own first: the latest
    assert [m.for_version(v).source for v in (1, 2, 3)] == [folder(1), folder(2), folder(3)]
    assert m.traffic.split == {1: 50, 2: 50} and split["flat"].version_numbers == (1,)
    assert served('[[models]]\nname = "m"\nversion_policy = "all"')["m"].version_numbers == (
        3,
        1,
        2,
    )
    assert served('[[models]]\nname = "m"\nversion_policy = [1, 2]')["m"].version_numbers == (2, 1)
    for models, message in [
        (
            '[[models]]\nname = "m"\n[models.traffic]\nsplit = { 1 = 50, 4 = 50 }',
            r"model 'm' has no version folder \[4\] .*; it holds \[1, 2, 3\]",
        ),
        ('[[models]]\nname = "m"\nversion_policy = [5]', r"no version folder \[5\]"),
        ('[[models]]\nname = "gone"', r"\['gone'\] give no source and \[store\] root .* holds no"),
        (
            '[[models]]\nname = "m"\nversion_policy = "newest"',
            r"version_policy: expected \"latest\", \"all\" or a list of version numbers",
        ),
        (
            '[[models]]\nname = "m"\nsource = "models/m/1/model.onnx"\nversion_policy = "all"',
            r"version_policy chooses among a \[store\] root's version folders; leave out source",
        ),
        (
            '[[models]]\nname = "m"\nsource = "models/m/1/model.onnx"\n'
            "[models.traffic]\nsplit = { 1 = 50, 2 = 50 }",
            r"names version\(s\) \[2\]; the model has \[1\] .*leave out source",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            served(models)
    with pytest.raises(ValueError, match=r"model 'm' has no source, and no \[store\] root"):
        ServeConfig((ModelConfig("", "m"),))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"autoscale_signal": "cpu"}, r"autoscale_signal must be 'servekit' or 'ray', got 'cpu'"),
        ({"ingress_replicas": 0}, r"ingress_replicas must be >= 1, got 0"),
        (
            {"autoscaling": {"target_ongoing_requests": 4}},
            r"autoscaling.target_ongoing_requests is Ray's own signal",
        ),
    ],
)
def test_a_bad_ray_option_is_refused_naming_it(options, message):
    with pytest.raises(ValueError, match=message):
        RayOptions.from_dict(options)


def test_rays_own_signal_may_be_asked_for_by_name():
    ray = RayOptions.from_dict(
        {"autoscale_signal": "ray", "autoscaling": {"target_ongoing_requests": 4}}
    )
    assert ray.autoscaling == {"target_ongoing_requests": 4}


def test_relative_paths_in_a_config_file_are_relative_to_the_file(tmp_path, monkeypatch):
    from servekit.zoo.tiny import build_add_sub

    folder = tmp_path / "conf"
    (folder / "store").mkdir(parents=True)
    import onnx

    onnx.save(build_add_sub(), folder / "m.onnx")
    (folder / "serve.toml").write_text(
        'cache_dir = "cache"\n[store]\nroot = "store"\n[storage]\ncache = "objects"\n'
        '[[models]]\nname = "a"\nsource = "m.onnx"\nlabels = "labels.txt"\n'
        '[[models.versions]]\nversion = 2\nsource = "m.onnx"\n'
        '[[models]]\nname = "b"\nsource = "mine:Model"\npath = "."\n'
        '[[models]]\nname = "c"\nsource = "resnet50"\n'
        '[[models]]\nname = "d"\nsource = "s3://bucket/m.onnx"\n'
    )
    monkeypatch.chdir(tmp_path)  # elsewhere than the file
    config = ServeConfig.load("conf/serve.toml")
    a, b, c, d = config.models
    here = folder.resolve()
    assert a.source == str(here / "m.onnx") and a.labels == str(here / "labels.txt")
    assert a.versions[0].source == str(here / "m.onnx")
    assert (b.source, b.path) == ("mine:Model", str(here / "."))
    assert (c.source, d.source) == ("resnet50", "s3://bucket/m.onnx")  # not files there
    assert config.cache_dir == str(here / "cache")
    assert config.store.root == str(here / "store")
    assert config.storage.cache == str(here / "objects")


def test_the_startup_line_names_the_address_bound_and_every_port():
    s = ServerConfig(host="0.0.0.0", http_port=8000, grpc_port=8001, metrics_port=8002)
    assert s.listening() == "0.0.0.0 (every interface): HTTP 8000, gRPC 8001, metrics 8002"
    assert ServerConfig(host="10.0.0.5", http_port=80).listening(
        grpc=False, metrics_port=False
    ) == ("10.0.0.5 (10.0.0.5): HTTP 80, metrics at HTTP's /metrics")
