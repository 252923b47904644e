"""What a new user trips over, each where it can fail: tritonserver's private ports behind
servekit's front are the configured ones, where a firewall or a port range needs them."""

from __future__ import annotations

import urllib.request

import pytest

from conftest import free_port, on
from servekit import ModelConfig


@pytest.mark.parametrize("runtime", ["pytriton", "triton"])
def test_tritonservers_own_ports_behind_the_front_are_the_configured_ones(runtime, add_sub_path):
    pytest.importorskip("pytriton", reason="needs the triton extra")
    http, grpc, metrics = free_port(), free_port(), free_port()
    model = ModelConfig(str(add_sub_path), "add_sub")
    ports = {"triton_http_port": http, "triton_grpc_port": grpc, "triton_metrics_port": metrics}
    with on(runtime)(model, **ports) as served:
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/live", timeout=5) as r:
            assert r.status == 200  # tritonserver itself, on the port asked for
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
            assert b"nv_inference_request_success" in r.read()  # tritonserver's own
        assert served.http_port != http
        import tritonclient.grpc as grpcclient

        c = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
        try:
            assert c.is_server_live()
        finally:
            c.close()
