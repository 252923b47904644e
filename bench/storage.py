"""Models from object storage (issue: s3:// and gs:// sources): ResNet-50 (~98 MB) in
moto's S3 server on loopback, the same client library (s3fs) on both sides.

Measured:
- download: servekit's fetch into an empty cache (the store's HEAD, one streamed GET,
  MD5 and SHA-256 of the file, fsync, rename) against a plain ``get_file`` to a file, as
  ``aws s3 cp`` does it with s3fs, and (where installed) obstore's streamed GET, the
  other client library the issue names; alternated, each ``--rounds`` times, MB/s;
- start-up: ``servekit serve`` (native) from the s3:// source until the model answers
  ready, with an empty cache (download, then load and warm-up) and with a warm one (a
  restart on the same node: the store's HEAD only).

    python bench/storage.py --out bench/results/storage
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from servekit import ModelConfig, ServeConfig, ServerConfig, zoo
from servekit.bench.compare import ServerProcess, spawned
from servekit.bench.report import machine
from servekit.client import Client
from servekit.endpoints import free_port
from servekit.storage import StorageConfig, fetch

BUCKET = "models"
KEY = "resnet50/1/model.onnx"
os.environ.update(
    AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def download(url: str, rounds: int, size: int) -> dict[str, list[float]]:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=url)
    out: dict[str, list[float]] = {"servekit fetch": [], "s3fs get_file (aws s3 cp)": []}
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            fetch(f"s3://{BUCKET}/{KEY}", StorageConfig(cache=tmp, s3_endpoint_url=url))
            out["servekit fetch"].append(size / 1e6 / (time.perf_counter() - start))
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            fs.get_file(f"{BUCKET}/{KEY}", f"{tmp}/model.onnx")
            out["s3fs get_file (aws s3 cp)"].append(size / 1e6 / (time.perf_counter() - start))
        if obstore_get is not None:
            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                obstore_get(url, f"{tmp}/model.onnx")
                out.setdefault("obstore get, streamed to a file", []).append(
                    size / 1e6 / (time.perf_counter() - start)
                )
    return out


def _obstore() -> Callable[[str, str], None] | None:
    """obstore (Rust's object_store) as the alternative client, where it is installed."""
    try:
        import obstore
        from obstore.store import S3Store
    except ImportError:
        return None

    def get(url: str, path: str) -> None:
        store = S3Store(
            BUCKET, endpoint=url, region="us-east-1", access_key_id="bench",
            secret_access_key="bench", client_options={"allow_http": True},
        )  # fmt: skip
        with open(path, "wb") as f:
            for chunk in obstore.get(store, KEY).stream(min_chunk_size=8 << 20):
                f.write(chunk)

    return get


obstore_get = _obstore()


def start_up(url: str, cache: str) -> float:
    """Seconds from ``servekit serve`` to the model answering ready."""
    config = ServeConfig(
        (ModelConfig(f"s3://{BUCKET}/{KEY}", "resnet50", image=False),),
        ServerConfig(
            host="127.0.0.1", http_port=free_port(), grpc_port=free_port(), metrics_port=free_port()
        ),  # fmt: skip
        runtime="native",
        storage=StorageConfig(cache=cache, s3_endpoint_url=url),
    )
    start = time.perf_counter()
    with ServerProcess(config) as server, Client(config.server.http_url) as client:
        while True:
            try:
                if client.is_ready("resnet50"):
                    return time.perf_counter() - start
            except Exception:
                pass
            if server.proc is not None and server.proc.poll() is not None:
                raise RuntimeError(server.log.read_text()[-2000:])
            time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/storage"))
    args = parser.parse_args()
    import s3fs

    model = zoo.build("resnet50").read_bytes()
    port = free_port()
    moto = str(Path(sys.executable).with_name("moto_server"))
    argv = [moto, "-H", "127.0.0.1", "-p", str(port)]
    with spawned(argv, lambda: listening(port), "moto_server"):
        url = f"http://127.0.0.1:{port}"
        fs = s3fs.S3FileSystem(endpoint_url=url)
        fs.mkdir(BUCKET)
        fs.pipe(f"{BUCKET}/{KEY}", model)
        rates = download(url, args.rounds, len(model))
        cold, warm = [], []
        for _ in range(args.starts):
            with tempfile.TemporaryDirectory() as cache:
                cold.append(start_up(url, cache))
                warm.append(start_up(url, cache))
    result = {
        "machine": machine(),
        "model_mb": len(model) / 1e6,
        "download_mb_per_s": {k: statistics.median(v) for k, v in rates.items()},
        "download_samples": rates,
        "start_up_s": {
            "cold cache": statistics.median(cold),
            "warm cache": statistics.median(warm),
        },
        "start_up_samples": {"cold cache": cold, "warm cache": warm},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if "samples" not in k}, indent=2))


if __name__ == "__main__":
    main()
