"""Operations against a real Prometheus (Debian's ``prometheus`` package): it scrapes each
runtime serving known traffic, and every PromQL expression of the Grafana dashboard, the
HPA's metric and every recording and alerting rule under k8s/ is evaluated through its
HTTP API: each returns a series, and the counts are the traffic's. ``promtool`` checks
every Prometheus config and rules file under k8s/ and the scrape config the test writes.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import free_port, needs_runtime, scrape, terminate, wait_until
from servekit import BatchingPolicy, Client, InvalidInput, ModelConfig, ServeConfig, ServerConfig

INSTALL = "apt-get install -y prometheus"
pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason=f"needs a real Prometheus and promtool: {INSTALL}",
)

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
DASHBOARD = json.loads((K8S / "grafana" / "servekit.json").read_text())
GPU_PANELS = ("GPU utilisation", "GPU memory used")  # no GPU here: NVML exports nothing
REQUESTS, BAD = 120, 3


FEATURES = (
    "servekit_version_", "servekit_traffic_", "servekit_store_", "servekit_storage_",
    "servekit_latency_budget_", "servekit_batch_target_", "servekit_batch_delay_",
    "servekit_batch_rows",
)  # fmt: skip
"""Series a server exports only with a rollout, a model store, an object-storage source or
a latency budget: their panels are checked by the test that configures them."""


def dashboard_exprs(features: bool = False) -> list[tuple[str, str]]:
    """(panel title, query) of every target: the features' panels, or the others."""
    return [(p["title"], t["expr"]) for p in DASHBOARD["panels"] for t in p["targets"]
            if any(f in t["expr"] for f in FEATURES) == features]  # fmt: skip


def grafana(expr: str, model: str) -> str:
    """A panel's query as Grafana sends it, for the models ``model`` (a regex) matches and
    a one-minute rate window."""
    return expr.replace("$model", model).replace("$__rate_interval", "1m")


def rule_files() -> list[Path]:
    """Every Prometheus rules file under k8s/ (a document with top-level ``groups``)."""

    def rules(path: Path) -> bool:
        docs = list(yaml.safe_load_all(path.read_text()))
        return any(isinstance(d, dict) and "groups" in d for d in docs)

    return sorted(p for p in K8S.rglob("*.yaml") if rules(p))


def hpa_queries() -> list[str]:
    """The HPA's metric as a PromQL selector (the Stackdriver adapter's name unwrapped)."""
    hpa = yaml.safe_load((K8S / "base" / "hpa.yaml").read_text())
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    return [n.split("|")[1] if "|" in n else n for n in names]


def autoscaler_queries(model: str) -> list[tuple[str, str]]:
    """KEDA's query and prometheus-adapter's metrics query, for ``model``."""
    keda = yaml.safe_load((K8S / "extras" / "keda-scaledobject.yaml").read_text())
    adapter = yaml.safe_load((K8S / "extras" / "prometheus-adapter.yaml").read_text())
    (rule,) = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    out = [(f"KEDA trigger {i}", re.sub(r'model="[^"]*"', f'model="{model}"', t["metadata"]["query"]))
           for i, t in enumerate(keda["spec"]["triggers"]) if t["type"] == "prometheus"]  # fmt: skip
    metrics = rule["metricsQuery"].replace("<<.LabelMatchers>>", f'model="{model}"')
    out.append(("prometheus-adapter", metrics.replace("<<.GroupBy>>", "model")))
    return out


@contextlib.contextmanager
def prometheus(tmp: Path, targets: dict[str, tuple[str, str]]) -> Iterator[str]:
    """A Prometheus scraping ``targets`` (job -> (host:port, path)) every second, with every
    rules file under k8s/ loaded; yields its URL and always stops it."""
    fast = []  # the rules as shipped, evaluated every second instead of every 15 s
    for i, rules in enumerate(rule_files()):
        doc = yaml.safe_load(rules.read_text())
        for group in doc["groups"]:
            group["interval"] = "1s"
        fast.append(tmp / f"rules-{i}.yaml")
        fast[-1].write_text(yaml.safe_dump(doc))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in fast],
        "scrape_configs": [
            {"job_name": job, "metrics_path": path, "static_configs": [{"targets": [address]}]}
            for job, (address, path) in targets.items()
        ],
    }
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    check = subprocess.run(
        ["promtool", "check", "config", str(path)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={path}", f"--storage.tsdb.path={tmp / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200,
                   "Prometheus ready", 60, alive=lambda: proc.poll() is None)  # fmt: skip
        yield url
    finally:
        terminate(proc)


def query(url: str, expr: str) -> list[tuple[dict, float]]:
    """An instant query through Prometheus's HTTP API: (labels, value) per series."""
    q = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", (expr, body)
    data = body["data"]
    if data["resultType"] == "scalar":
        return [({}, float(data["result"][1]))]
    return [(s["metric"], float(s["value"][1])) for s in data["result"]]


def total(url: str, expr: str) -> float:
    return sum(v for _, v in query(url, expr))


def drive(http_url: str, model: str, good: int, bad: int = 0) -> None:
    """``good`` requests and ``bad`` ones with a wrong shape (each a 400)."""
    a = np.ones((1, 16), np.float32)
    with Client(http_url) as c:
        for _ in range(good):
            out = c.infer(model, {"INPUT0": a, "INPUT1": a})
            assert (out["OUTPUT0"] == 2).all()
        for _ in range(bad):
            with pytest.raises(InvalidInput):
                c.infer(model, {"INPUT0": np.ones((1, 3), np.float32), "INPUT1": a})


def test_promtool_checks_every_rules_file_and_the_rules_name_exported_metrics():
    files = rule_files()
    assert files, "no rules file under k8s/"
    check = subprocess.run(["promtool", "check", "rules", *map(str, files)],
                           capture_output=True, text=True)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    alerts = {r["alert"] for f in files for g in yaml.safe_load(f.read_text())["groups"]
              for r in g["rules"] if "alert" in r}  # fmt: skip
    for wanted in (
        "ServekitDown",
        "ServekitModelNotReady",
        "ServekitErrorRate",
        "ServekitP99OverBudget",
        "ServekitQueueBacklog",
        "ServekitWorkerDeaths",
        "ServekitPoisonInputs",
        "ServekitEvictionsThrashing",
    ):
        assert wanted in alerts, wanted  # fmt: skip


def check_panels(prom: str, exprs: list[tuple[str, str]], model: str, where: str) -> None:
    """Every query returns a series of finite, non-negative values (GPU panels: none here)."""
    empty = []
    for title, expr in exprs:
        series = query(prom, grafana(expr, model))
        if title in GPU_PANELS:
            assert series == [], (title, "a GPU series on a machine without one")
        elif not series:
            empty.append((title, expr))
        else:
            assert all(np.isfinite(v) and v >= 0 for _, v in series), (title, series)
    assert empty == [], f"panels with no series on {where}: {empty}"


RUNTIMES = ["native", "pytriton", "triton", "ray"]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_real_prometheus_evaluates_every_dashboard_query_and_rule_on_each_runtime(
    runtime, add_sub_path, tmp_path
):
    needs_runtime(runtime)
    if runtime != "native":
        pytest.importorskip("tritonclient.http")
    from servekit.serving import create_runtime

    config = ServeConfig(
        (ModelConfig(str(add_sub_path), "add_sub"),), ServerConfig(exit_timeout_s=2),
        runtime=runtime,
    ).on_loopback()  # fmt: skip
    s = config.server
    http = s.http_url.removeprefix("http://")
    metrics = s.metrics_url.removeprefix("http://").removesuffix("/metrics")
    # Where each runtime's series are: the metrics port (on the Triton runtimes the front
    # serves it, tritonserver's families and its own together); Ray's on its HTTP port.
    targets = {
        "native": {"servekit": (metrics, "/metrics")},
        "pytriton": {"servekit": (metrics, "/metrics")},
        "triton": {"servekit": (metrics, "/metrics")},
        "ray": {"servekit": (http, "/metrics")},
    }[runtime]
    server = create_runtime(config)
    if runtime == "ray":
        server.num_cpus = 2
    try:
        server.start()
        with prometheus(tmp_path, targets) as prom:
            model = '{model="add_sub"}'
            # One request scraped first, so the burst is an increase Prometheus can see
            # (a counter first scraped after all of it would show no rate).
            drive(s.http_url, "add_sub", 1)
            wait_until(lambda: total(prom, f"sum(nv_inference_request_success{model})") == 1,
                       "the first request scraped", 60)  # fmt: skip
            # ... and the signal's source scraped once (on the Triton runtimes the front
            # adds it to the metrics port), so the burst is inside the window it reports on.
            wait_until(lambda: query(prom, f"servekit_replicas_needed{model}"),
                       "the signal scraped", 60)  # fmt: skip
            drive(s.http_url, "add_sub", REQUESTS - 1, BAD)
            wait_until(lambda: total(prom, f"sum(nv_inference_request_success{model})")
                       == REQUESTS, "the successes scraped", 60)  # fmt: skip
            failures = (f"sum(nv_inference_request_failure{model}) + "
                        f"(sum(servekit_request_failure{model}) or vector(0))")  # fmt: skip
            wait_until(lambda: total(prom, failures) == BAD, "the failures scraped", 60)
            # Counts exact: what was sent.
            assert total(prom, f"sum(nv_inference_count{model})") == REQUESTS
            assert total(prom, f"sum(nv_inference_exec_count{model})") <= REQUESTS
            time.sleep(2)  # two more scrapes, so a one-minute rate has its points
            check_panels(prom, dashboard_exprs(), "add_sub", runtime)
            # Rates within tolerance: the throughput panel over the minute holds the burst.
            (throughput,) = [e for t, e in dashboard_exprs() if t.startswith("Throughput")]
            per_s = total(prom, grafana(throughput, "add_sub"))
            assert 0.3 * REQUESTS / 60 <= per_s <= 3 * REQUESTS / 60, per_s
            for name in hpa_queries():
                assert query(prom, f"{name}{model}"), f"the HPA's {name} has no series"
            for what, expr in autoscaler_queries("add_sub"):
                assert query(prom, expr), f"{what}: {expr} has no series"
            # The signal: add_sub's lone requests fill 1/8 of its batches, no queue to
            # speak of: far below one replica, and above none.
            # (Waited for: a scrape of the front, which reads tritonserver, can miss the
            # one-second scrape timeout while the machine is busy; the 30 s window holds.)
            signal = f"sum(servekit_replicas_needed{model})"
            wait_until(lambda: 0 < total(prom, signal) < 1, "the signal of the burst", 25)
            assert query(prom, f"min(servekit_model_ready{model})") == [({}, 1.0)]
            rules = json.loads(urllib.request.urlopen(f"{prom}/api/v1/rules", timeout=10).read())
            groups = rules["data"]["groups"]
            assert groups and all(r["health"] == "ok" for g in groups for r in g["rules"]), groups
            for r in (r for g in groups for r in g["rules"] if r["type"] == "recording"):
                wait_until(lambda r=r: query(prom, r["name"]),
                           f"a series of the recording rule {r['name']}", 20)  # fmt: skip
    finally:
        server.stop()


def test_the_rollout_store_and_object_storage_panels_on_servers_that_use_them(tmp_path):
    """One native server splitting add_sub between two versions fetched from a loopback S3
    server under a latency budget, one serving a store of three models under a budget that holds about one: every
    feature panel has a series, and the counts are the traffic's."""
    pytest.importorskip("s3fs", reason="needs the cloud extra (servekit[cloud])")
    pytest.importorskip("moto", reason="needs moto[server] (the dev extra)")
    import os

    import s3fs

    from objectstore import CREDENTIALS, moto_server
    from servekit import storage
    from servekit.config import StoreConfig
    from servekit.native import NativeServer
    from servekit.rollout.policy import ModelVersion, TrafficPolicy
    from servekit.storage import StorageConfig
    from servekit.zoo.tiny import build_add_sub

    downloads_total = "servekit_storage_downloads_total"

    os.environ.update(CREDENTIALS)
    # Fetch counts are the process's, and tests before this one in the worker may have
    # fetched: only the downloads from here on are this test's.
    before = sum(v for name, _, _, s in storage.figures() if name == downloads_total for _, v in s)
    folder = tmp_path / "store"
    folder.mkdir()
    for i in range(3):
        (folder / f"m{i}.onnx").write_bytes(build_add_sub(weights_mb=6).SerializeToString())
    with moto_server() as s3:
        fs = s3fs.S3FileSystem(endpoint_url=s3)
        fs.mkdir("models")
        for v in (1, 2):
            fs.pipe(f"models/adder/{v}/model.onnx",
                    build_add_sub(offset=float(v - 1)).SerializeToString())  # fmt: skip
        rollout = ServeConfig(
            (ModelConfig("s3://models/adder/1/model.onnx", "adder",
                         versions=(ModelVersion(2, "s3://models/adder/2/model.onnx"),),
                         traffic=TrafficPolicy({1: 50, 2: 50}),
                         batching=BatchingPolicy(latency_budget_ms=100)),),
            ServerConfig(exit_timeout_s=2), runtime="native",
            storage=StorageConfig(cache=str(tmp_path / "cache"), s3_endpoint_url=s3),
        ).on_loopback()  # fmt: skip
        store = ServeConfig(
            (), ServerConfig(exit_timeout_s=2), runtime="native",
            store=StoreConfig(root=str(folder), memory_budget_mb=30, load="on_demand"),
        ).on_loopback()  # fmt: skip
        jobs = {f"servekit-{n}": (c.server.metrics_url.removeprefix("http://")
                                  .removesuffix("/metrics"), "/metrics")
                for n, c in (("rollout", rollout), ("store", store))}  # fmt: skip
        with NativeServer(rollout), NativeServer(store), prometheus(tmp_path, jobs) as prom:
            a = np.ones((1, 16), np.float32)
            x = {"INPUT0": a, "INPUT1": a}
            with Client(rollout.server.http_url) as c, Client(store.server.http_url) as d:
                c.infer("adder", x)
                d.infer("m0", x)
                wait_until(lambda: total(prom, "sum(servekit_version_requests_total)") == 1,
                           "the first request scraped", 60)  # fmt: skip
                answers = [float(c.infer("adder", x)["OUTPUT0"][0, 0]) for _ in range(59)]
                assert set(answers) == {2.0, 3.0}  # both versions answered
                for name in ["m1", "m2", "m0", "m1", "m2"]:
                    d.infer(name, x)
            wait_until(lambda: total(prom, 'sum(servekit_version_requests_total{model="adder"})')
                       == 60, "the rollout's requests scraped", 60)  # fmt: skip
            own = scrape(store.server.metrics_url)  # the store's own counts
            loads = sum(v for (n, _), v in own.items() if n == "servekit_store_loads")
            evictions = sum(v for (n, _), v in own.items() if n == "servekit_store_evictions")
            assert loads >= 3  # evictions too, mostly: RSS decides how many models fit
            wait_until(lambda: total(prom, "sum(servekit_store_loads_total)") == loads,
                       "the store's loads scraped", 60)  # fmt: skip
            assert total(prom, "sum(servekit_store_evictions_total)") == evictions
            # Both servers run in this process, so one job says its downloads.
            downloads = f'sum({downloads_total}{{job="servekit-rollout"}})'
            assert total(prom, downloads) == before + 2
            time.sleep(2)
            check_panels(prom, dashboard_exprs(features=True), ".*", "the feature servers")
