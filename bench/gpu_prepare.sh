#!/usr/bin/env bash
# Everything bench/gpu.sh needs on the device that its image lacks, into DIR (ignored by
# git; carry it in the device call, 59 MB, which with the tree stays under the 64 MiB a
# call carries): servekit's HTTP/gRPC wheels (../shared/device/wheels.sh); pytest,
# hypothesis and onnxruntime for the CUDA tests (sympy, which onnxruntime needs, comes
# with the image's PyTorch); cuda-python 12 for CUDA shared memory (tritonclient's client
# side and the native server's), all for Python 3.12; and the sample photos as 500x375
# JPEGs (DIR/photos) for the JPEG-over-HTTP run.
#   bash bench/gpu_prepare.sh .whl
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: gpu_prepare.sh DIR}
bash ../shared/device/wheels.sh "$dir" > /dev/null
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "pytest<9" pluggy iniconfig packaging hypothesis sortedcontainers attrs onnxruntime \
    coloredlogs humanfriendly flatbuffers "cuda-python>=12.6,<13" "cuda-bindings>=12.6,<13" \
    "cuda-pathfinder<2"
mkdir -p "$dir/photos"
.venv/bin/python - "$dir/photos" <<'PY'
import sys
from pathlib import Path

from servekit.samples import SAMPLES, skimage_photo, to_jpeg

for name, photo in SAMPLES.items():
    image = skimage_photo(photo)
    if image is not None:
        Path(sys.argv[1], f"{name}.jpg").write_bytes(to_jpeg(image.resize((500, 375))))
PY
du -sh "$dir"
ls "$dir/photos"
