"""Offline batch inference on Ray Data: a folder of images (or .npy tensors) -> Parquet predictions.

The files are read as bytes by Ray Data's read tasks and scored by ``map_batches`` on a
pool of actors, each holding the same servekit Pipeline that serves online (Preprocess ->
model -> Postprocess). Every file yields exactly one row: its top-k prediction, or the
error that belongs to it alone (an undecodable image fails only itself, as on the servers).
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..batching.execute import run_requests
from ..errors import InvalidInput
from ..stages.image import IMAGE_SUFFIXES

__all__ = ["BatchReport", "input_files", "run_batch"]

TENSOR_SUFFIX = ".npy"


@dataclass(frozen=True)
class BatchReport:
    """What a batch job did: files in, rows written, failures, where it ran, how long it took."""

    files: int
    rows: int
    failed: int
    seconds: float
    output: Path
    rows_by_node: dict[str, int] = field(default_factory=dict)

    @property
    def files_per_s(self) -> float:
        return self.files / self.seconds if self.seconds > 0 else 0.0


def input_files(input_dir: str | os.PathLike[str]) -> list[str]:
    """The images and .npy tensors under ``input_dir`` (recursively), sorted; others ignored."""
    root = Path(input_dir)
    if not root.is_dir():
        raise ValueError(f"input: {root} is not a directory")
    suffixes = (*IMAGE_SUFFIXES, TENSOR_SUFFIX)
    return sorted(str(p) for p in root.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)


class Scorer:
    """The ``map_batches`` actor: one servekit Pipeline, loaded once per actor."""

    def __init__(
        self,
        model: str,
        top_k: int = 5,
        threads: int | None = 1,
        labels: Sequence[str] | None = None,
        max_batch_size: int = 16,
    ) -> None:
        import ray

        from .. import zoo
        from ..pipeline import Pipeline, image_classifier
        from ..runners.onnx import OnnxRuntimeRunner

        path = zoo.resolve(model)
        runner = OnnxRuntimeRunner(path, intra_op_threads=threads, max_batch_size=max_batch_size)
        self.images = image_classifier(runner, top_k=top_k, labels=labels)
        # .npy files hold the model's input already preprocessed: model -> Postprocess.
        self.tensors = Pipeline(self.images.steps[1:])
        self.input = runner.spec.inputs[0]
        self.node = ray.get_runtime_context().get_node_id()

    def __call__(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        paths = [str(p) for p in batch["path"]]
        blobs = list(batch["bytes"])
        results: list[Any] = [None] * len(paths)
        is_tensor = [p.lower().endswith(TENSOR_SUFFIX) for p in paths]
        image_rows = [i for i, t in enumerate(is_tensor) if not t]
        tensor_rows = [i for i, t in enumerate(is_tensor) if t]
        requests = [{"image": np.array([[blobs[i]]], dtype=object)} for i in image_rows]
        for i, out in zip(image_rows, run_requests(self.images, requests), strict=True):
            results[i] = out
        loaded: list[dict[str, np.ndarray]] = []
        for i in tensor_rows:
            try:
                loaded.append({self.input.name: _load_tensor(paths[i], blobs[i])})
            except InvalidInput as exc:
                results[i] = exc
                loaded.append({})
        good = [(i, x) for i, x in zip(tensor_rows, loaded, strict=True) if x]
        outs = run_requests(self.tensors, [x for _, x in good])
        for (i, _), out in zip(good, outs, strict=True):
            results[i] = out
        return self._columns(paths, results)

    def _columns(self, paths: list[str], results: list[Any]) -> dict[str, np.ndarray]:
        ok = [r for r in results if isinstance(r, dict)]
        k = ok[0]["classes"].shape[1] if ok else 1
        classes = np.full((len(paths), k), -1, dtype=np.int64)
        scores = np.zeros((len(paths), k), dtype=np.float32)
        labels = np.full(len(paths), "", dtype=object)
        errors = np.full(len(paths), "", dtype=object)
        for i, r in enumerate(results):
            if isinstance(r, dict):
                classes[i], scores[i] = r["classes"][0], r["scores"][0]
                labels[i] = r["labels"][0, 0].decode()
            else:
                errors[i] = str(r)
        return {
            "path": np.array(paths, dtype=object),
            "label": labels,
            "class_id": classes[:, 0],
            "score": scores[:, 0],
            # Lists, not Ray's tensor extension type, so any Parquet reader can use them.
            "top_classes": _lists(classes),
            "top_scores": _lists(scores),
            "error": errors,
            "node": np.full(len(paths), self.node, dtype=object),
        }


def _lists(array: np.ndarray) -> np.ndarray:
    out = np.empty(len(array), dtype=object)
    out[:] = [row.tolist() for row in array]
    return out


def _load_tensor(path: str, blob: bytes) -> np.ndarray:
    """One preprocessed input from .npy bytes, as a batch of one; never unpickles."""
    try:
        array = np.load(io.BytesIO(blob), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise InvalidInput(f"{path}: not a readable .npy tensor ({exc})") from None
    return array[None] if array.ndim >= 1 else array


def run_batch(
    input_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    model: str = "resnet50",
    top_k: int = 5,
    labels: Sequence[str] | None = None,
    batch_size: int = 16,
    actors: int | tuple[int, int] = 2,
    actor_cpus: float = 0.5,
    read_cpus: float = 0.25,
    threads: int | None = 1,
    address: str | None = None,
    num_cpus: int | None = None,
    progress: bool = True,
) -> BatchReport:
    """Score every image / .npy file under ``input_dir`` and write Parquet files to ``output``.

    Runs on the Ray cluster at ``address`` when given (and on one started here, with
    ``num_cpus``, otherwise; an already-initialised Ray is used as it is). Actors take
    fractional CPUs (``actor_cpus``) so Ray Data's read tasks (``read_cpus``) still fit on
    small machines. ``actors`` is a fixed pool size or an autoscaling ``(min, max)``.
    """
    import ray

    files = input_files(input_dir)
    if not files:
        raise ValueError(f"input: no images or .npy files under {input_dir}")
    started_here = not ray.is_initialized()
    if started_here:
        init: dict[str, Any] = {"address": address or "local", "log_to_driver": False}
        if not address:
            init.update(num_cpus=num_cpus, include_dashboard=False)
        ray.init(**init)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = progress
    ctx.print_on_execution_start = progress
    # Spread the files over the whole pool: several blocks per actor, and scoring starts
    # once every actor has loaded its model (not on the first one ready).
    ctx.wait_for_min_actors_s = 600
    most = actors if isinstance(actors, int) else actors[1]
    out = Path(output)
    start = time.perf_counter()
    try:
        ds = ray.data.read_binary_files(
            files,
            include_paths=True,
            num_cpus=read_cpus,
            override_num_blocks=min(len(files), 4 * most),
        )
        ds = ds.map_batches(
            Scorer,
            fn_constructor_kwargs={
                "model": model,
                "top_k": top_k,
                "threads": threads,
                "labels": list(labels) if labels is not None else None,
                "max_batch_size": batch_size,
            },
            batch_size=batch_size,
            batch_format="numpy",
            # One block in flight per actor: a block that comes while one actor is busy goes
            # to another (Ray Data otherwise queues it on the least busy actor, the first on
            # a tie). A job whose blocks trickle in can still run whole on one actor.
            compute=(
                ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1)
                if isinstance(actors, int)
                else ray.data.ActorPoolStrategy(
                    min_size=actors[0], max_size=actors[1], max_tasks_in_flight_per_actor=1
                )
            ),
            num_cpus=actor_cpus,
        )
        ds.write_parquet(str(out))
        seconds = time.perf_counter() - start
        written = ray.data.read_parquet(str(out), num_cpus=read_cpus)
        summary = written.select_columns(["node", "error"]).to_pandas()
    finally:
        if started_here:
            ray.shutdown()
    return BatchReport(
        files=len(files),
        rows=len(summary),
        failed=int((summary["error"] != "").sum()),
        seconds=seconds,
        output=out,
        rows_by_node={str(k): int(v) for k, v in summary["node"].value_counts().items()},
    )
