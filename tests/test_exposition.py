"""The Triton runtimes' public metrics port serves tritonserver's exposition merged with
the front's: each family once, every sample kept, a series both count summed, and the
result a valid exposition (prometheus_client parses it)."""

from __future__ import annotations

from conftest import parse_metrics
from servekit.front.exposition import merge_expositions

TRITON = """# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="add_sub",version="1"} 16
# HELP nv_inference_request_summary_us Summary of inference request duration
# TYPE nv_inference_request_summary_us summary
nv_inference_request_summary_us_count{model="add_sub",version="1"} 16
nv_inference_request_summary_us_sum{model="add_sub",version="1"} 1234
nv_inference_request_summary_us{model="add_sub",version="1",quantile="0.5"} 70
# HELP servekit_request_failure Requests a servekit model answered with an error response
# TYPE servekit_request_failure counter
servekit_request_failure{model="m",version="1",code="INVALID_ARG"} 2
"""

FRONT = """# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="local",version="1"} 3
# HELP servekit_request_failure Requests a servekit model answered with an error response
# TYPE servekit_request_failure counter
servekit_request_failure{model="m",version="1",code="INVALID_ARG"} 5
# HELP nv_cache_num_hits_per_model Number of cache hits per model
# TYPE nv_cache_num_hits_per_model counter
nv_cache_num_hits_per_model{model="add_sub"} 24
"""


def test_families_are_merged_once_and_a_series_both_count_is_summed():
    merged = merge_expositions(TRITON, FRONT)
    assert merged.count("# TYPE nv_inference_request_success counter") == 1
    assert merged.count("# HELP servekit_request_failure") == 1
    samples = parse_metrics(merged)  # a valid exposition, or this raises
    key = lambda name, **labels: (name, frozenset(labels.items()))  # noqa: E731
    assert samples[key("nv_inference_request_success", model="add_sub", version="1")] == 16
    assert samples[key("nv_inference_request_success", model="local", version="1")] == 3
    assert samples[key("servekit_request_failure", model="m", version="1", code="INVALID_ARG")] == 7
    assert samples[key("nv_cache_num_hits_per_model", model="add_sub")] == 24
    assert samples[key("nv_inference_request_summary_us_count", model="add_sub", version="1")] == 16


def test_tritonserver_silent_leaves_the_fronts_own():
    assert parse_metrics(merge_expositions("", FRONT)) == parse_metrics(FRONT)
