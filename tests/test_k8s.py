"""Every k8s overlay renders, validates against the Kubernetes schemas, hangs together, and
names only metrics that servekit's runtimes export; so does the Grafana dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

kv = pytest.importorskip("kubernetes_validate")

from conftest import parse_metrics
from kustomize import KustomizeError, render
from servekit import Batcher, FunctionRunner, ModelSpec, TensorSpec
from servekit.metrics import BUDGET_GAUGES, FAILURE_METRIC, GPU_GAUGES, ROLLOUT, Metrics
from servekit.ray.app import ray_config
from servekit.storage.cache import COUNTERS as STORAGE
from servekit.store import ModelStore

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir())
K8S_VERSION = "1.31"  # GKE's regular channel


def exported_metric_names() -> set[str]:
    """Families servekit exports (live, from a rendered exposition) plus those that need a
    GPU, a Triton stub, a rollout, a model store or a fetch from object storage to appear."""
    spec = ModelSpec((TensorSpec("x", np.float32, [1]),), (TensorSpec("y", np.float32, [1]),), 4)
    metrics = Metrics(gpu=False)
    metrics.watch(Batcher(FunctionRunner(lambda d: {"y": d["x"]}, spec)), "m")
    names = {
        re.sub(r"(_summary_us)_(count|sum)$", r"\1", n) for n, _ in parse_metrics(metrics.render())
    }
    store = {family for family, *_ in ModelStore({}).figures()}
    budget = set(BUDGET_GAUGES)  # a model with a latency budget
    return names | set(GPU_GAUGES) | {FAILURE_METRIC} | set(ROLLOUT) | store | set(STORAGE) | budget


def pod_specs(doc: dict) -> list[tuple[dict, dict]]:
    """(pod labels, pod spec) for every pod template in a resource."""
    if doc["kind"] == "Deployment":
        t = doc["spec"]["template"]
        return [(t["metadata"].get("labels", {}), t["spec"])]
    if doc["kind"] == "RayService":
        cluster = doc["spec"]["rayClusterConfig"]
        groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
        return [
            (g["template"]["metadata"].get("labels", {}), g["template"]["spec"]) for g in groups
        ]
    return []


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / "overlays" / request.param)


def test_there_is_an_overlay_per_runtime():
    assert OVERLAYS == ["bucket", "pytriton", "ray", "triton"]


def test_the_bucket_overlay_reads_its_model_from_the_bucket_through_a_node_local_cache():
    docs = render(K8S / "overlays" / "bucket")
    (deployment,) = [
        d for d in docs if d["metadata"]["name"] == "servekit" and d["kind"] == "Deployment"
    ]
    spec = deployment["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert any(a.startswith("gs://") for a in c["args"])
    cache = {e["name"]: e["value"] for e in c["env"]}["SERVEKIT_OBJECT_CACHE"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == cache]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["hostPath"]["path"] == cache  # node-local: outlives the pod
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    assert (
        "iam.gke.io/gcp-service-account"
        in accounts[spec["serviceAccountName"]]["metadata"]["annotations"]
    )


def test_every_resource_validates_against_the_kubernetes_schemas(overlay):
    _, docs = overlay
    for doc in docs:
        if doc["apiVersion"].split("/")[0] in ("ray.io", "monitoring.googleapis.com"):
            continue  # custom resources: their pod templates are checked below
        kv.validate(doc, K8S_VERSION, strict=True)
    for doc in docs:
        for labels, spec in pod_specs(doc):
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "t", "labels": labels}}
            kv.validate({**pod, "spec": spec}, K8S_VERSION, strict=True)


def test_the_validator_does_catch_a_broken_resource():
    (doc,) = [d for d in render(K8S / "overlays" / "pytriton") if d["kind"] == "Deployment"][:1]
    doc["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight"
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, K8S_VERSION, strict=True)


def test_serving_pods_take_one_t4_each_with_a_memory_backed_shm(overlay):
    _, docs = overlay
    gpu_pods = [spec for doc in docs for _, spec in pod_specs(doc) if "nodeSelector" in spec]
    assert gpu_pods
    for spec in gpu_pods:
        assert spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-tesla-t4"}
        (c,) = spec["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        term = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term[0]["topologyKey"] == "kubernetes.io/hostname"
    for doc in docs:
        for labels, spec in pod_specs(doc):
            if labels.get("app.kubernetes.io/name") != "servekit":
                continue  # Locust
            shm = [v for v in spec.get("volumes", []) if v["name"] == "dshm"]
            assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
            assert any(
                m["mountPath"] == "/dev/shm" for c in spec["containers"] for m in c["volumeMounts"]
            )


def test_references_between_resources_resolve(overlay):
    name, docs = overlay
    by_kind: dict[str, dict[str, dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    pods = [(labels, spec) for d in docs for labels, spec in pod_specs(d)]
    for svc in by_kind.get("Service", {}).values():
        matched = [spec for labels, spec in pods if selects(svc["spec"]["selector"], labels)]
        assert matched, f"Service {svc['metadata']['name']} selects no pod"
        ports = {p["name"] for spec in matched for c in spec["containers"] for p in c["ports"]}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports
    for pm in by_kind.get("PodMonitoring", {}).values():
        matched = [
            spec for labels, spec in pods if selects(pm["spec"]["selector"]["matchLabels"], labels)
        ]
        assert matched, f"PodMonitoring {pm['metadata']['name']} selects no pod"
        ports = {
            p["name"] for spec in matched for c in spec["containers"] for p in c.get("ports", [])
        }
        assert {e["port"] for e in pm["spec"]["endpoints"]} <= ports
    for hpa in by_kind.get("HorizontalPodAutoscaler", {}).values():
        assert hpa["spec"]["scaleTargetRef"]["name"] in by_kind["Deployment"]
    for pdb in by_kind.get("PodDisruptionBudget", {}).values():
        assert any(selects(pdb["spec"]["selector"]["matchLabels"], labels) for labels, _ in pods)
    # Locust's target is this overlay's serving Service.
    host = by_kind["ConfigMap"]["locust"]["data"]["LOCUST_HOST"]
    services = set(by_kind.get("Service", {}))
    for rs in by_kind.get("RayService", {}).values():
        services.add(rs["spec"]["serveService"]["metadata"]["name"])
    assert re.match(r"http://([^:/]+):8000$", host)[1] in services - {"locust-master"}
    # KubeRay's GCS fault tolerance reaches its Redis through a Service of the overlay.
    for rs in by_kind.get("RayService", {}).values():
        redis = rs["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]["redisAddress"]
        host, port = redis.split(":")
        assert int(port) in {p["port"] for p in by_kind["Service"][host]["spec"]["ports"]}
    images = {c["image"] for _, spec in pods for c in spec["containers"]}
    assert images - {"redis:7.4"} == {"us-docker.pkg.dev/PROJECT_ID/servekit/servekit:0.1.0"}, name


def test_the_ray_service_runs_an_app_servekit_can_build():
    (rs,) = [d for d in render(K8S / "overlays" / "ray") if d["kind"] == "RayService"]
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    local = yaml.safe_load((ROOT / "ray_app" / "config.yaml").read_text())
    for app in (*config["applications"], *local["applications"]):
        assert app["import_path"] == "servekit.ray.app:build_app"
        ray_config(app["args"])  # raises naming any unknown key or bad value


def unknown_keys(model: Any, data: Any, at: str = "") -> list[str]:
    """Keys of ``data`` that pydantic ``model`` (Ray Serve's schema, which ignores extra
    keys) has no field for, at any depth of nested models and lists of them."""
    import typing

    if not isinstance(data, dict):
        return []
    out = []
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            out.append(f"{at}{key}")
            continue
        kinds = [field.annotation, *typing.get_args(field.annotation)]
        for kind in [k for t in kinds for k in (t, *typing.get_args(t))]:
            if isinstance(kind, type) and hasattr(kind, "model_fields"):
                for i, item in enumerate(value if isinstance(value, list) else [value]):
                    out += unknown_keys(kind, item, f"{at}{key}[{i}].")
                break
    return out


def test_the_ray_service_s_serve_config_is_one_ray_serve_accepts():
    """``serveConfigV2`` against Ray Serve's own schema (what ``serve deploy`` and KubeRay's
    submissions are checked with), from the installed Ray, every key included: a misspelt,
    misplaced or mistyped setting is refused here, not on the cluster."""
    pytest.importorskip("ray", reason="needs the ray extra")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Ray Serve's own import warns (pydantic)
        from ray.serve.schema import ServeDeploySchema
    (rs,) = [d for d in render(K8S / "overlays" / "ray") if d["kind"] == "RayService"]
    local = yaml.safe_load((ROOT / "ray_app" / "config.yaml").read_text())
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    for serve_config in (config, local):
        ServeDeploySchema.model_validate(serve_config)
        assert unknown_keys(ServeDeploySchema, serve_config) == []
    assert ServeDeploySchema.model_validate(config).proxy_location == "EveryNode"
    with pytest.raises(Exception, match="proxy_location"):
        ServeDeploySchema.model_validate({**config, "proxy_location": "Everywhere"})
    app = {**config["applications"][0], "route_prefx": "/"}
    assert unknown_keys(ServeDeploySchema, {**config, "applications": [app]}) == [
        "applications[0].route_prefx"
    ]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((K8S / "grafana" / "servekit.json").read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def unexported(exprs: list[str], exported: set[str]) -> set[str]:
    """The metric names ``exprs`` query that servekit does not export."""
    named = {n for e in exprs for n in re.findall(r"\b((?:nv|servekit)_[a-z_]+)", e)}
    assert named, "no servekit metric queried"
    return named - exported


def test_the_dashboard_and_the_autoscaler_use_only_exported_metrics():
    exported = exported_metric_names()
    dashboard = json.loads((K8S / "grafana" / "servekit.json").read_text())
    assert not unexported(dashboard_exprs(), exported)
    for title in (
        "Throughput",
        "p99",
        "Queue vs compute",
        "batch size",
        "GPU utilisation",
        "GPU memory",
    ):
        assert any(title in p["title"] for p in dashboard["panels"]), title
    for overlay in ("pytriton", "triton"):
        (hpa,) = [
            d for d in render(K8S / "overlays" / overlay) if d["kind"] == "HorizontalPodAutoscaler"
        ]
        for m in hpa["spec"]["metrics"]:
            name = m["pods"]["metric"]["name"]
            plain = (
                name.split("|")[1] if "|" in name else name
            )  # GMP adapter: prometheus.googleapis.com|NAME|KIND
            assert plain in exported


def test_a_panel_querying_a_name_nobody_exports_fails_the_metric_check():
    # The check above, against the real dashboard with one panel planted: a typo in a
    # metric name (the exporter's summary, a store counter) is what it must catch.
    exported = exported_metric_names()
    planted = [
        "rate(nv_inference_request_success[1m])",  # exported
        "sum(servekit_store_evictions_total)",  # exported
        "rate(nv_inference_request_sucess[1m])",  # a typo
    ]
    assert unexported(dashboard_exprs() + planted, exported) == {"nv_inference_request_sucess"}


def test_the_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnameSuffix: -x\n")
    with pytest.raises(KustomizeError, match="unsupported fields"):
        render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "resources: []\npatches:\n  - target: {kind: Deployment}\n    patch: '- {op: remove, path: /x}'\n"
    )
    with pytest.raises(KustomizeError, match="matches no resource"):
        render(tmp_path)


def test_the_image_recipe_copies_what_exists_and_installs_real_extras():
    import tomllib

    dockerfile = (K8S / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (\S+)", dockerfile, re.M):
        assert (ROOT / src).exists(), src
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    (wanted,) = re.findall(r'pip install "\.\[([a-z,]+)\]"', dockerfile)
    assert set(wanted.split(",")) <= extras
