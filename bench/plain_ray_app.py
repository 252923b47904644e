"""A plain Ray Serve app, written as a Ray user would: the peer row of bench/serving_cost.py.

One deployment, ``@serve.batch`` over ONNX Runtime, KServe v2 JSON parsed with
``request.json()`` and answered as JSON; no servekit code on the request path. A model
that declares a simulated device (``sim_t4``; bench/timeline.py) runs on that device,
servekit's ``SimulatedDevice``, as a Ray user's model would run on a GPU.

    python bench/plain_ray_app.py --model PATH.onnx --name add_sub --port 8000
    python bench/plain_ray_app.py --model numpy --name add_sub --port 8000   # numpy add_sub
"""

from __future__ import annotations

import argparse
import signal
import threading

import numpy as np
import onnxruntime as ort
import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from servekit.runners import load_runner
from servekit.runners.simulated import DeviceProfile

DTYPES = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32}


def build(model_path: str, name: str, max_batch_size: int) -> serve.Application:
    @serve.deployment(max_ongoing_requests=4 * max_batch_size)
    class Model:
        def __init__(self) -> None:
            if model_path == "numpy":  # the user-code row (bench/user_code.py): add_sub in numpy
                self.outputs, self.session = ["OUTPUT0", "OUTPUT1"], None
                return
            self.session = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
            self.outputs = [o.name for o in self.session.get_outputs()]
            self.device = None
            profile = DeviceProfile.from_metadata(self.session.get_modelmeta().custom_metadata_map)
            if profile is not None:  # the batch runs on the device; the graph is a stand-in
                self.device = load_runner(model_path)  # a SimulatedDevice

        def _run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
            if self.session is not None and self.device is not None:
                results = self.device.run(feeds)
                return [results[k] for k in self.outputs]
            if self.session is None:
                return [feeds["INPUT0"] + feeds["INPUT1"], feeds["INPUT0"] - feeds["INPUT1"]]
            return self.session.run(self.outputs, feeds)

        @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=0.0)
        async def run(self, requests: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
            sizes = [len(next(iter(r.values()))) for r in requests]
            feeds = {k: np.concatenate([r[k] for r in requests]) for k in requests[0]}
            results = dict(zip(self.outputs, self._run(feeds), strict=True))
            out, start = [], 0
            for n in sizes:
                out.append({k: v[start : start + n] for k, v in results.items()})
                start += n
            return out

        async def __call__(self, request: Request) -> Response:
            path = request.url.path.rstrip("/")
            if request.method == "GET" and path in ("/v2/health/ready", "/v2/health/live"):
                return Response(status_code=200)
            if request.method == "GET" and path == f"/v2/models/{name}/ready":
                return Response(status_code=200)
            if request.method == "POST" and path == f"/v2/models/{name}/infer":
                body = await request.json()
                inputs = {
                    t["name"]: np.asarray(t["data"], dtype=DTYPES[t["datatype"]]).reshape(
                        t["shape"]
                    )
                    for t in body["inputs"]
                }
                result = await self.run(inputs)
                outputs = [
                    {
                        "name": k,
                        "datatype": "FP32",
                        "shape": list(v.shape),
                        "data": v.ravel().tolist(),
                    }
                    for k, v in result.items()
                ]
                return JSONResponse({"model_name": name, "outputs": outputs})
            return JSONResponse({"error": f"no route {path}"}, status_code=404)

    return Model.bind()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-batch-size", type=int, default=8)
    args = ap.parse_args()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build(args.model, args.name, args.max_batch_size), name="plain", route_prefix="/")
        for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which takes SIGTERM
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
