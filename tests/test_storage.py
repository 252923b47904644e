"""Models from object storage, against real stores on loopback (moto's S3 server, a GCS
emulator), never a patched client: a fetch downloads once per object version, per node;
every failure names the object and leaves nothing half-written; a served model is updated
from its store on SIGHUP without a failed request, and only when the object changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import Load, free_port, wait_until
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


def test_other_processes_on_the_node_share_the_cache_and_one_of_them_downloads(
    s3_url, tmp_path
):
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


def test_a_missing_key_and_a_refused_credential_are_named(s3_url, tmp_path):
    with pytest.raises(ModelNotFound, match=r"s3://models/absent.onnx: no such object "
                       r"\(bucket 'models', key 'absent.onnx'\)"):  # fmt: skip
        fetch(f"s3://{BUCKET}/absent.onnx", settings(s3_url, tmp_path))
    with moto_server(auth=True) as strict:
        with pytest.raises(FetchFailed, match=r"s3://models/a.onnx: cannot read \(bucket "
                           r"'models', key 'a.onnx'\): PermissionError: Forbidden "
                           r"\(the store refused these credentials"):  # fmt: skip
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
