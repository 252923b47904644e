"""ResNet-50 raw throughput at FP32 and INT8 in one run, and INT8's accuracy on a trained model.

    python bench/precision.py [--seconds 6] [--out bench/results/precision.json]

INT8 twice: servekit's default (the few layers most sensitive to INT8 weights kept in
FP32) and every layer quantised. Same process, same ONNX Runtime threads (2), batch 1, 8
and 16. Accuracy: EfficientNet-Lite0 (ImageNet-trained) INT8 against its FP32 self on
the photo set (needs servekit[trained]).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import numpy as np
import onnxruntime

from servekit import OnnxRuntimeRunner, zoo
from servekit.bench import rows_per_s
from servekit.optimize import optimize


def images_per_s(path: Path, batch: int, seconds: float) -> float:
    runner = OnnxRuntimeRunner(path, intra_op_threads=2)
    x = np.random.default_rng(0).standard_normal((batch, 3, 224, 224)).astype(np.float32)
    try:
        return rows_per_s(lambda: runner.infer({"input": x}), batch, seconds)
    finally:
        runner.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/precision.json"))
    args = ap.parse_args()
    fp32 = zoo.build("resnet50")
    work = Path("bench/results/.models")
    work.mkdir(parents=True, exist_ok=True)
    models = {
        "fp32": fp32,
        "int8": optimize(fp32, "int8", output=work / "resnet50.int8.onnx"),
        "int8 (all layers)": optimize(
            fp32, "int8", output=work / "resnet50.int8-all.onnx", sensitivity=None
        ),
    }
    rows = {
        name: {b: round(images_per_s(path, b, args.seconds), 1) for b in (1, 8, 16)}
        for name, path in models.items()
    }
    result: dict[str, object] = {
        "machine": f"{platform.machine()}, ORT {onnxruntime.__version__}",
        "resnet50_images_per_s": rows,
        "speedup_at_best_batch": {
            name: round(max(r.values()) / max(rows["fp32"].values()), 2) for name, r in rows.items()
        },
    }
    try:
        from servekit.accuracy import compare_models, photo_set

        photos = photo_set()
        lite0 = zoo.build("efficientnet_lite0")
        int8 = optimize(lite0, "int8", output=work / "lite0.int8.onnx", images=photos[1::2])
        result["efficientnet_lite0_int8_vs_fp32"] = compare_models(lite0, int8, photos).as_dict()
    except ImportError as exc:
        result["efficientnet_lite0_int8_vs_fp32"] = f"skipped: {exc}"
    print(json.dumps(result, indent=2))
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
