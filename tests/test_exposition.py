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


def test_error_responses_are_counted_as_failures_not_successes():
    """tritonserver counts a stub's error response as a success (the stub counts it in
    servekit_request_failure); a request the front refused it never sees. Merged, each is
    in nv_inference_request_failure, as on servekit's own runtimes, and in no other family."""
    from servekit.front.exposition import failures_counted

    triton = TRITON + (
        "# HELP nv_inference_request_failure Number of failed inference requests\n"
        "# TYPE nv_inference_request_failure counter\n"
        'nv_inference_request_failure{model="m",version="1"} 1\n'
        'nv_inference_request_success{model="m",version="1"} 10\n'
    )
    merged = merge_expositions(
        triton,
        FRONT,
        failures_counted(triton, counted_as_success=True),
        failures_counted(FRONT, counted_as_success=False),
    )
    samples = parse_metrics(merged)
    key = lambda name, **labels: (name, frozenset(labels.items()))  # noqa: E731
    assert samples[key("nv_inference_request_failure", model="m", version="1")] == 1 + 2 + 5
    assert samples[key("nv_inference_request_success", model="m", version="1")] == 10 - 2
    # Moved, not copied: a dashboard adding the two families counts each failure once.
    assert samples[key("servekit_request_failure", model="m", version="1", code="INVALID_ARG")] == 0
    assert samples[key("nv_inference_request_success", model="add_sub", version="1")] == 16
    assert failures_counted(FRONT.replace("} 5", "} 0"), counted_as_success=False) == ""
    # tritonserver 2.51 labels each failure series with a reason: the model's is BACKEND.
    reasons = "".join(
        f'nv_inference_request_failure{{model="m",reason="{r}",version="1"}} 0\n'
        for r in ("OTHER", "BACKEND", "REJECTED")
    )
    moved = failures_counted(TRITON + reasons, counted_as_success=True)
    assert 'nv_inference_request_failure{model="m",reason="BACKEND",version="1"} 2' in moved
