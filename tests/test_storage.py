"""Models from object storage, against real stores on loopback (moto's S3 server, a GCS
emulator), never a patched client: a fetch downloads once per object version, per node;
every failure names the object and leaves nothing half-written; a served model is updated
from its store on SIGHUP without a failed request, and only when the object changed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import Load, free_port, needs_runtime, wait_until
from servekit import ModelConfig, ServeConfig, ServerConfig
from servekit.config import StoreConfig, model_name
from servekit.errors import FetchFailed, ModelNotFound
from servekit.storage import StorageConfig, fetch, parse, stats
from servekit.zoo.tiny import build_add_sub, build_tiny_cnn

pytest.importorskip("s3fs", reason="needs the cloud extra (servekit[cloud])")
pytest.importorskip("moto", reason="needs moto[server] (the dev extra)")
from objectstore import CREDENTIALS, FaultyProxy, gcs_emulator, moto_server  # noqa: E402

BUCKET = "models"


@pytest.fixture(scope="module", autouse=True)
def credentials() -> Iterator[None]:
    """The SDKs read credentials from the environment, as they would in a pod."""
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def s3_url() -> Iterator[str]:
    with moto_server() as url:
        import s3fs

        s3fs.S3FileSystem(endpoint_url=url).mkdir(BUCKET)
        yield url


def put(url: str, key: str, data: bytes) -> str:
    """Upload ``data`` with the test's own client; returns the object's URI."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=url, skip_instance_cache=True)
    fs.pipe(f"{BUCKET}/{key}", data)
    return f"s3://{BUCKET}/{key}"


def settings(url: str, cache: Path) -> StorageConfig:
    return StorageConfig(cache=str(cache), s3_endpoint_url=url, progress_s=0)


def downloads() -> float:
    return stats.get("servekit_storage_downloads_total", "s3")


def leftovers(cache: Path) -> list[str]:
    """Files in the cache that are not whole entries (staged parts, orphan records)."""
    names = [p for p in cache.rglob("*") if p.is_file() and p.name != ".lock"]
    whole = {p for p in names if p.suffix != ".json" and p.with_name(p.name + ".json") in names}
    return sorted(str(p) for p in names if p not in whole and p.with_suffix("") not in whole
                  and Path(str(p)[: -len(".json")]) not in whole)  # fmt: skip


ADD_SUB = build_add_sub().SerializeToString()


def test_uris_are_checked_and_repository_layouts_name_their_model():
    assert parse("s3://b/k/model.onnx").key == "k/model.onnx"
    for bad, why in [("s3://", "no bucket"), ("s3://b", "no object key"),
                     ("s3://b/dir/", "no object key"), ("ftp://b/k", "scheme 'ftp'")]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            parse(bad)
    assert model_name("s3://b/resnet50/1/model.onnx") == "resnet50"
    assert model_name("gs://b/zoo/add_sub/model.onnx") == "add_sub"
    assert model_name("s3://b/m/tiny.onnx") == "tiny"
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['endpoint'\] in \[storage\]"):
        ServeConfig.from_dict({"models": [{"source": "x.onnx"}], "storage": {"endpoint": "x"}})
    config = ServeConfig(models=(ModelConfig("s3://b/a.onnx"),),
                         storage=StorageConfig(s3_endpoint_url="http://127.0.0.1:9"))  # fmt: skip
    assert ServeConfig.from_dict(config.to_dict()) == config


def test_a_fetch_downloads_once_and_a_new_object_version_is_a_new_entry(s3_url, tmp_path):
    uri = put(s3_url, "once/add_sub.onnx", ADD_SUB)
    before = downloads()
    first = fetch(uri, settings(s3_url, tmp_path))
    assert first.read_bytes() == ADD_SUB and downloads() == before + 1
    record = json.loads(first.with_name(first.name + ".json").read_text())
    assert record["uri"] == uri and record["size"] == len(ADD_SUB) and len(record["sha256"]) == 64
    assert fetch(uri, settings(s3_url, tmp_path)) == first and downloads() == before + 1
    other = build_add_sub(offset=1.0).SerializeToString()
    put(s3_url, "once/add_sub.onnx", other)
    second = fetch(uri, settings(s3_url, tmp_path))
    assert second != first and second.read_bytes() == other and downloads() == before + 2
    assert first.read_bytes() == ADD_SUB  # the old entry stays whole for whoever reads it


FETCH = """
import os, sys
from servekit.storage import StorageConfig, fetch, stats
config = StorageConfig(cache=sys.argv[2], s3_endpoint_url=sys.argv[3], progress_s=0)
path = fetch(sys.argv[1], config)
print(path, int(stats.get("servekit_storage_downloads_total", "s3")))
"""


def test_other_processes_on_the_node_share_the_cache_and_one_of_them_downloads(s3_url, tmp_path):
    uri = put(s3_url, "shared/model.onnx", os.urandom(3_000_000))
    argv = [sys.executable, "-c", FETCH, uri, str(tmp_path), s3_url]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len({path for path, _ in outs}) == 1
    assert sum(int(n) for _, n in outs) == 1  # one download among three processes
    # A restart: a new process finds the entry and downloads nothing.
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == [outs[0][0], "0"]


def test_a_missing_key_a_missing_bucket_and_a_refused_credential_are_named(s3_url, tmp_path):
    with pytest.raises(ModelNotFound, match=r"s3://models/absent.onnx: no such object "
                       r"\(bucket 'models', key 'absent.onnx'\)"):  # fmt: skip
        fetch(f"s3://{BUCKET}/absent.onnx", settings(s3_url, tmp_path))
    with pytest.raises(ModelNotFound, match=r"s3://no-such-bucket/a.onnx: no such bucket "
                       r"'no-such-bucket'"):  # fmt: skip
        fetch("s3://no-such-bucket/a.onnx", settings(s3_url, tmp_path))
    refused = (r"s3://models/a.onnx: cannot read \(bucket 'models', key 'a.onnx'\): "
               r"PermissionError: Forbidden \(the store refused these credentials")  # fmt: skip
    with moto_server(auth=True) as strict, pytest.raises(FetchFailed, match=refused):
        fetch(f"s3://{BUCKET}/a.onnx", settings(strict, tmp_path))
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "mode, why",
    [("short", "truncated download .* got 1500000 bytes, expected 3000000"),
     ("flip", "hash mismatch .* MD5 [0-9a-f]{32}, expected [0-9a-f]{32}"),
     ("die", "download failed")],
)  # fmt: skip
def test_a_bad_download_is_refused_with_nothing_half_written(s3_url, tmp_path, mode, why):
    data = os.urandom(3_000_000)
    uri = put(s3_url, f"faulty/{mode}.onnx", data)
    with FaultyProxy(s3_url) as proxy:
        proxy.mode = mode
        with pytest.raises(FetchFailed, match=f"{uri}: {why}"):
            fetch(uri, settings(proxy.url, tmp_path))
        assert proxy.bodies >= 1
        assert leftovers(tmp_path) == []
        proxy.mode = "pass"  # the store is well again: the same fetch succeeds
        assert fetch(uri, settings(proxy.url, tmp_path)).read_bytes() == data


def test_a_store_that_is_down_serves_the_cached_copy(s3_url, tmp_path):
    uri = put(s3_url, "down/add_sub.onnx", ADD_SUB)
    path = fetch(uri, settings(s3_url, tmp_path))
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert fetch(uri, settings(dead, tmp_path)) == path
    with pytest.raises(FetchFailed, match="cannot read"):
        fetch(uri, settings(dead, tmp_path / "empty"))


def test_gs_objects_are_fetched_and_checked_the_same_way(tmp_path):
    pytest.importorskip("gcsfs", reason="needs the cloud extra (servekit[cloud])")
    from gcsfs.core import GCSFileSystem

    with gcs_emulator() as url:
        fs = GCSFileSystem(endpoint_url=url, token="anon")
        fs.mkdir("gmodels")
        fs.pipe("gmodels/add_sub/model.onnx", ADD_SUB)
        config = StorageConfig(cache=str(tmp_path), gcs_endpoint_url=url, progress_s=0)
        before = stats.get("servekit_storage_downloads_total", "gs")
        path = fetch("gs://gmodels/add_sub/model.onnx", config)
        assert path.read_bytes() == ADD_SUB
        assert fetch("gs://gmodels/add_sub/model.onnx", config) == path
        assert stats.get("servekit_storage_downloads_total", "gs") == before + 1
        with pytest.raises(ModelNotFound, match="bucket 'gmodels', key 'nope.onnx'"):
            fetch("gs://gmodels/nope.onnx", config)


X = {"input": np.random.default_rng(3).random((1, 3, 32, 32), dtype=np.float32)}


def logits(data: bytes) -> np.ndarray:
    from servekit import OnnxRuntimeRunner

    path = Path(f"/tmp/servekit-logits-{os.getpid()}-{threading.get_ident()}.onnx")
    path.write_bytes(data)
    try:
        with OnnxRuntimeRunner(path) as r:
            return r.infer(X)["logits"]
    finally:
        path.unlink()


def test_native_sighup_swaps_a_changed_object_under_load_and_keeps_serving_on_a_bad_one(
    s3_url, tmp_path
):
    from servekit import Client
    from servekit.native import NativeServer

    one, two = (build_tiny_cnn(seed=s).SerializeToString() for s in (0, 1))
    uri = put(s3_url, "live/tiny_cnn.onnx", one)
    with FaultyProxy(s3_url) as proxy:
        config = ServeConfig(
            (ModelConfig(uri, image=False),), ServerConfig(exit_timeout_s=2),
            runtime="native", storage=settings(proxy.url, tmp_path),
        ).on_loopback()  # fmt: skip
        with NativeServer(config) as server:
            url = config.server.http_url

            def session(k: int):
                client = Client(url)
                return _Calls(client, lambda: client.infer("tiny_cnn", X)["logits"])

            with Client(url) as c:
                np.testing.assert_allclose(c.infer("tiny_cnn", X)["logits"], logits(one), rtol=1e-5)
            assert server.reload() == [f"tiny_cnn: unchanged ({uri}), not reloaded"]
            put(s3_url, "live/tiny_cnn.onnx", two)
            with Load(session) as load:
                load.wait_answers(20)
                assert server.reload() == [f"tiny_cnn: reloaded from {uri} (reload 1)"]
                load.wait_answers(20)
            assert load.failures() == []
            seen = [any(np.allclose(r, w, rtol=1e-5) for w in (logits(one), logits(two)))
                    for r in load.results]  # fmt: skip
            assert all(seen)
            np.testing.assert_allclose(load.results[-1], logits(two), rtol=1e-5)
            # A new object whose download is corrupt: the reload fails naming it, v2 serves.
            put(s3_url, "live/tiny_cnn.onnx", build_tiny_cnn(seed=2).SerializeToString())
            proxy.mode = "flip"
            with pytest.raises(FetchFailed, match="bucket 'models', key 'live/tiny_cnn.onnx'"):
                server.reload()
            with Client(url) as c:
                np.testing.assert_allclose(c.infer("tiny_cnn", X)["logits"], logits(two), rtol=1e-5)
            assert leftovers(tmp_path) == []
            text = _metrics(config.server.metrics_url)
            assert 'servekit_storage_downloads_total{scheme="s3"}' in text


class _Calls:
    """A Load session: the client closed after the calls."""

    def __init__(self, client, call) -> None:
        self.client, self.call = client, call

    def __enter__(self):
        return self.call

    def __exit__(self, *exc: object) -> None:
        self.client.close()


def _metrics(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_a_store_root_in_a_bucket_is_listed_loaded_on_demand_and_reloaded_when_changed(
    s3_url, tmp_path
):
    from servekit import Client
    from servekit.native import NativeServer

    put(s3_url, "zoo/adder.onnx", ADD_SUB)
    put(s3_url, "zoo/shifted/model.onnx", build_add_sub(offset=1.0).SerializeToString())
    put(s3_url, "zoo/cnn/1/model.onnx", build_tiny_cnn(seed=0).SerializeToString())
    put(s3_url, "zoo/cnn/2/model.onnx", build_tiny_cnn(seed=1).SerializeToString())
    config = ServeConfig(
        (), runtime="native", store=StoreConfig(root=f"s3://{BUCKET}/zoo", load="on_demand"),
        storage=settings(s3_url, tmp_path),
    ).on_loopback()  # fmt: skip
    with NativeServer(config), Client(config.server.http_url) as c:
        a = {"INPUT0": np.ones((1, 16), np.float32), "INPUT1": np.ones((1, 16), np.float32)}
        assert (c.infer("adder", a)["OUTPUT0"] == 2).all()
        assert (c.infer("shifted", a)["OUTPUT0"] == 3).all()
        np.testing.assert_allclose(
            c.infer("cnn", X)["logits"],
            logits(build_tiny_cnn(seed=1).SerializeToString()),
            rtol=1e-5,
        )  # the highest version
        # The repository load API re-checks a resident model's object: unchanged, nothing
        # is downloaded; changed, the new one serves.
        import tritonclient.http as httpclient

        control = httpclient.InferenceServerClient(config.server.http_url.removeprefix("http://"))
        before = downloads()
        control.load_model("adder")
        assert downloads() == before
        put(s3_url, "zoo/adder.onnx", build_add_sub(offset=5.0).SerializeToString())
        control.load_model("adder")
        assert downloads() == before + 1
        assert (c.infer("adder", a)["OUTPUT0"] == 7).all()
        control.close()


# Ray's workers take the credentials from the environment Ray started in: its own Ray.
@pytest.mark.parametrize(
    "runtime", ["pytriton", "triton", pytest.param("ray", marks=pytest.mark.own_ray)]
)
def test_every_runtime_serves_a_model_from_the_store(s3_url, tmp_path, runtime):
    pytest.importorskip("tritonclient.http")
    needs_runtime(runtime)
    from servekit import Client
    from servekit.serving import create_runtime

    data = build_tiny_cnn(seed=2).SerializeToString()
    uri = put(s3_url, f"runtimes/{runtime}/model.onnx", data)
    config = ServeConfig(
        (ModelConfig(uri, image=False),), ServerConfig(exit_timeout_s=2), runtime=runtime,
        storage=settings(s3_url, tmp_path),
    ).on_loopback()  # fmt: skip
    server = create_runtime(config)
    if runtime == "ray":
        server.num_cpus = 2
    try:
        server.start()
        with Client(config.server.http_url) as c:
            wait_until(lambda: c.is_ready(runtime), f"{runtime} ready", 120)
            np.testing.assert_allclose(c.infer(runtime, X)["logits"], logits(data), rtol=1e-5)
        if runtime == "ray":  # the object is re-checked: unchanged, so nothing redeploys
            assert server.reload() == [f"servekit: unchanged ({uri})"]
    finally:
        server.stop()


def test_serve_downloads_once_a_restart_downloads_nothing_and_sighup_rechecks(s3_url, tmp_path):
    from test_commands import running, spawn, stop, wait_ready

    uri = put(s3_url, "cli/tiny_cnn.onnx", build_tiny_cnn(seed=4).SerializeToString())
    config = tmp_path / "serve.toml"
    http = free_port()
    config.write_text(f"""
runtime = "native"
[server]
host = "127.0.0.1"
http_port = {http}
grpc_port = {free_port()}
metrics_port = {free_port()}
[[models]]
source = "{uri}"
image = false
[storage]
cache = "{tmp_path / "objects"}"
s3_endpoint_url = "{s3_url}"
""")
    argv = [sys.executable, "-m", "servekit", "serve", "--config", str(config)]
    logs = []
    for run in range(2):
        proc = spawn(argv)
        try:
            wait_ready(f"http://127.0.0.1:{http}", "tiny_cnn", proc)
            if run == 1:
                proc.send_signal(signal.SIGHUP)
                wait_until(lambda p=proc: "unchanged" in p.output(), "the SIGHUP re-check",
                           60, alive=lambda p=proc: running(p))  # fmt: skip
        finally:
            assert stop(proc) == 0
        logs.append(proc.stdout_text)
    assert f"{uri}: downloading" in logs[0] and f"{uri}: fetched" in logs[0]
    assert "downloading" not in logs[1]
    assert f"tiny_cnn: unchanged ({uri}), not reloaded" in logs[1]


def test_a_triton_repository_takes_its_files_from_the_cache_and_long_downloads_say_progress(
    s3_url, tmp_path, caplog
):
    import logging

    from servekit.triton.repo import build_repository, model_repository

    data = build_tiny_cnn(seed=5).SerializeToString()
    uri = put(s3_url, "repo/tiny_cnn/1/model.onnx", data)
    storage = StorageConfig(cache=str(tmp_path / "cache"), s3_endpoint_url=s3_url,
                            progress_s=1e-9)  # a line per chunk  # fmt: skip
    config = ServeConfig((ModelConfig(uri, image=False),), runtime="triton", storage=storage)
    with caplog.at_level(logging.INFO, logger="servekit.storage"):
        build_repository(tmp_path / "repo", model_repository(config))
    assert (tmp_path / "repo" / "tiny_cnn" / "1" / "model.onnx").read_bytes() == data
    assert any(r.getMessage().startswith(f"{uri}: ") and "MB/s" in r.getMessage()
               and "of" in r.getMessage() for r in caplog.records)  # fmt: skip
