"""Locust user for any KServe v2 endpoint (Triton, PyTriton, servekit): cluster load tests.

    locust -f bench/locustfile.py --host http://triton:8000 --headless -u 32 -r 8 -t 5m
    SERVEKIT_MODEL=resnet50 locust -f bench/locustfile.py --host http://localhost:8000

The request is built once from the model's metadata (generated JPEGs for BYTES inputs,
random tensors otherwise) in KServe v2's binary tensor format, as tritonclient sends it.
"""

from __future__ import annotations

import os

from locust import HttpUser, constant, events, task

MODEL = os.environ.get("SERVEKIT_MODEL", "resnet50_image")
BATCH = int(os.environ.get("SERVEKIT_BATCH", "1"))
_request: tuple[bytes, dict[str, str]] | None = None


def build_request(host: str) -> tuple[bytes, dict[str, str]]:
    """Body and headers for one inference request against ``host``."""
    import requests
    import tritonclient.http as th

    from servekit.bench.payload import payload_from_metadata
    from servekit.spec import as_dtype

    metadata = requests.get(f"{host}/v2/models/{MODEL}", timeout=30).json()
    if "inputs" not in metadata:
        raise RuntimeError(f"{host} has no model {MODEL!r}: {metadata}")
    inputs = []
    for name, array in payload_from_metadata(metadata["inputs"], BATCH).items():
        i = th.InferInput(name, list(array.shape), as_dtype(array.dtype).datatype)
        i.set_data_from_numpy(array, binary_data=True)
        inputs.append(i)
    body, json_size = th.InferenceServerClient.generate_request_body(inputs)
    headers = {"Content-Type": "application/octet-stream"}
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    return body, headers


@events.test_start.add_listener
def _prepare(environment, **_kwargs) -> None:  # type: ignore[no-untyped-def]
    global _request
    if environment.host:
        _request = build_request(environment.host)


class KServeUser(HttpUser):
    """Sends the same inference request back to back (closed loop, like perf_analyzer)."""

    wait_time = constant(0)

    @task
    def infer(self) -> None:
        global _request
        if _request is None:
            _request = build_request(self.host)
        body, headers = _request
        with self.client.post(
            f"/v2/models/{MODEL}/infer", data=body, headers=headers, name=MODEL, catch_response=True
        ) as response:
            if response.status_code != 200:
                response.failure(f"{response.status_code}: {response.text[:200]}")
