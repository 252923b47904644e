"""A plain Ray Serve app serving many models by ``@serve.multiplexed``, written as a Ray
user would: the peer of bench/store.py.

One deployment, one replica; ``/v2/models/<name>/infer`` (KServe v2 JSON) loads
``<root>/<name>.onnx`` into ONNX Runtime through ``@serve.multiplexed``, which keeps at most
``--max-models`` per replica and evicts the least recently used by count. No servekit
code on the request path.

    python bench/plain_ray_multiplex.py --root DIR --port 8000 --max-models 10
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response


def build(root: str, max_models: int) -> serve.Application:
    @serve.deployment(max_ongoing_requests=64)
    class Models:
        @serve.multiplexed(max_num_models_per_replica=max_models)
        async def get_model(self, model_id: str) -> ort.InferenceSession:
            return ort.InferenceSession(
                str(Path(root) / f"{model_id}.onnx"), providers=["CPUExecutionProvider"]
            )

        async def __call__(self, request: Request) -> Response:
            parts = request.url.path.strip("/").split("/")
            if request.method == "GET" and parts[:2] == ["v2", "health"]:
                return Response(status_code=200)
            if request.method == "POST" and len(parts) == 4 and parts[3] == "infer":
                session = await self.get_model(parts[2])
                body = await request.json()
                feeds = {
                    t["name"]: np.asarray(t["data"], np.float32).reshape(t["shape"])
                    for t in body["inputs"]
                }
                names = [o.name for o in session.get_outputs()]
                outputs = [
                    {
                        "name": n,
                        "datatype": "FP32",
                        "shape": list(v.shape),
                        "data": v.ravel().tolist(),
                    }
                    for n, v in zip(names, session.run(names, feeds), strict=True)
                ]
                return JSONResponse({"model_name": parts[2], "outputs": outputs})
            return JSONResponse({"error": f"no route {request.url.path}"}, status_code=404)

    return Models.bind()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-models", type=int, default=10)
    args = ap.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build(args.root, args.max_models), name="multiplex", route_prefix="/")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
