"""A real Prometheus (Debian's 2.42) with deploy/prometheus's scrape job and rules, scraping the
session's real Triton every second: after traffic through every pipeline and the router, the
recording rules return values for the pipelines, every rule evaluates without error, the raw metric
names the rules rely on are the server's, and every Grafana query and the prometheus-adapter query
run against it."""

from __future__ import annotations

import base64
import json
import math
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml

from triton_pipelines.client import InferenceServerException, TritonClient, text_tensor
from triton_pipelines.server.launcher import free_ports

from tests.support.prometheus_helpers import (
    ANNOUNCED, DASHBOARD, PROMETHEUS_DIR, ROUTER_EXPORTED, RULE_FILES, TRITON_EXPORTED, adapter_rule,
    dashboard_exprs, render_adapter_query, tool,
)
from tests.support.router_helpers import route, scrape
from tests.support.paths import TEST_DATA
from tests.conftest import ensure_repository, image_classifier

DATA = TEST_DATA
PIPELINES = ["text_embedding", "text_classification", "image_classification", "speech_recognition"]


class Prometheus:
    def __init__(self, url: str, process: subprocess.Popen, log: Path):
        self.url, self.process, self.log = url, process, log

    def get(self, path: str, **params) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:  # 400/422: a bad query; the body says why
            return json.loads(error.read())

    def query(self, expr: str) -> list[dict]:
        answer = self.get("/api/v1/query", query=expr)
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def values(self, expr: str) -> dict[tuple, float]:
        return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in self.query(expr)}

    def wait_for(self, expr: str, check, timeout_s: float = 60.0):
        """Poll until check(values) holds; returns the values (the last ones on failure, in the error)."""
        deadline = time.monotonic() + timeout_s
        while True:
            values = self.values(expr)
            if values and check(values):
                return values
            if time.monotonic() > deadline:
                pytest.fail(f"{expr}: {values} after {timeout_s:.0f} s")
            time.sleep(0.5)


@pytest.fixture(scope="module")
def prometheus(triton_server, tmp_path_factory):
    """deploy/prometheus/prometheus.yml with a 1 s scrape/evaluation interval and the session server
    as its target, on a free loopback port, with a temporary TSDB."""
    directory = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="1s")
    config["rule_files"] = [str(path) for path in RULE_FILES]
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [f"localhost:{triton_server.options.metrics_port}"]}]
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    (port,) = free_ports(1)
    log = directory / "prometheus.log"
    process = subprocess.Popen(
        [tool("prometheus"), f"--config.file={directory / 'prometheus.yml'}",
         f"--storage.tsdb.path={directory / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    server = Prometheus(f"http://127.0.0.1:{port}", process, log)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        # Scraped at least once before any traffic, so rates see every request.
        server.wait_for(f'up{{job="{job["job_name"]}"}}', lambda v: all(x == 1 for x in v.values()))
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def drive_traffic(url: str) -> None:
    """Two rounds, 2.5 s apart (the router's counters appear at their first increment, so a rate
    needs a second one), through every pipeline, the router, and a few failures."""
    client = TritonClient("http", url)
    image = (DATA / "scene.jpg").read_bytes()
    try:
        for round_ in range(2):
            for i in range(3):
                client.infer("text_embedding", {"text": text_tensor([f"where is my parcel {round_} {i}"])})
            client.infer("text_classification", {"text": text_tensor(["I was charged twice this month"])})
            client.infer("image_classification", {"image": text_tensor([image])})
            if round_ == 1:  # once (it is the slow one), late: its quantiles last ~60 s
                client.infer("speech_recognition", {"audio": text_tensor([(DATA / "speech_hello.wav").read_bytes()]),
                                                    "max_new_tokens": np.array([[16]], np.int32)})
            for i in range(2):
                route(client, "text_classification", {"text": "reset my password", "user": f"u{round_}{i}"})
            route(client, "image_classification", {"image": base64.b64encode(image).decode()})
            failures = [
                lambda: client.infer("image_classification", {"image": text_tensor([b"not an image"])}),
                lambda: route(client, "text_embedding", {"txt": "a misspelt field"}),  # router: invalid_input
                lambda: route(client, "general_llm", {"text": "hello"}),  # router: not_configured
            ]
            for call in failures:
                with pytest.raises(InferenceServerException):
                    call()
            if round_ == 0:
                time.sleep(2.5)
    finally:
        client.close()


@pytest.fixture(scope="module")
def loaded(prometheus, triton_server):
    drive_traffic(triton_server.http_url)
    return prometheus


def test_target_is_up_and_every_rule_evaluates(loaded):
    (target,) = loaded.get("/api/v1/targets")["data"]["activeTargets"]
    # Triton's exposition (summaries print "Nan" for idle models) parses.
    assert target["health"] == "up" and target["lastError"] == "", target
    deadline = time.monotonic() + 30
    while True:
        groups = loaded.get("/api/v1/rules")["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        if all(rule.get("lastEvaluation", "").startswith("20") for rule in rules) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(rules) == sum(len(g["rules"]) for p in RULE_FILES for g in yaml.safe_load(p.read_text())["groups"])
    broken = [(rule["name"], rule.get("lastError")) for rule in rules if rule["health"] != "ok"]
    assert not broken


def response_cached(pipeline: str) -> bool:
    """Built with Triton's response cache (text_embedding): such a model exports no request summary."""
    from repo_builder.files import read_config

    return read_config(ensure_repository() / pipeline / "config.pbtxt").response_cache.enable


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_recording_rules_return_the_pipelines_rates_and_latencies(loaded, pipeline):
    selector = f'{{model="{pipeline}"}}'
    (rate,) = loaded.wait_for(f"model_version:nv_inference_request_success:rate5m{selector}",
                              lambda v: all(x > 0 for x in v.values())).values()
    if response_cached(pipeline):
        # no request quantiles (Triton 2.51 leaves the summary out for a cached model): the cache's rules
        # instead; text_classification's repeated text hit its text_embedding step
        (ratio,) = loaded.wait_for(f"model_version:nv_cache_hit:ratio_rate5m{selector}", lambda v: True).values()
        assert 0 < ratio < 1
        loaded.wait_for(f"model_version:nv_cache_hit_seconds:mean5m{selector}", lambda v: min(v.values()) > 0)
        assert not loaded.values(f"model_version_quantile:nv_inference_request_seconds:max{selector}")
    else:
        quantiles = loaded.wait_for(f"model_version_quantile:nv_inference_request_seconds:max{selector}",
                                    lambda v: len(v) == 3)
        by_quantile = {dict(k)["quantile"]: x for k, x in quantiles.items()}
        assert 0 < by_quantile["0.5"] <= by_quantile["0.95"] <= by_quantile["0.99"] < 120, by_quantile
    (mean,) = loaded.wait_for(f"model_version:nv_inference_request_seconds:mean5m{selector}",
                              lambda v: True).values()
    assert 0 < mean < 120
    loaded.wait_for(f"model:pipeline_requests:rate5m{selector}", lambda v: all(x > 0 for x in v.values()))


def test_queue_batch_pending_and_memory_rules(loaded):
    queue = loaded.wait_for('model_version_quantile:nv_inference_queue_seconds:max{model="text_encoder",version="1"}',
                            lambda v: len(v) == 3)
    assert all(0 <= x < 10 for x in queue.values())
    (batch,) = loaded.wait_for('model_version:nv_inference_batch_size:mean5m{model="text_encoder",version="1"}',
                               lambda v: True).values()
    assert batch >= 1
    pending = loaded.values("model_version:nv_inference_pending_request_count:sum")
    models = {dict(k)["model"] for k in pending}
    assert {"text_encoder", image_classifier(), "whisper_decoder", "router", *PIPELINES} <= models
    (memory,) = loaded.wait_for("instance:nv_cpu_memory_used:ratio", lambda v: True).values()
    assert 0 < memory < 1


def test_failure_rules_count_triton_and_router_failures(loaded):
    # The bad image: Triton's failure counter of the ensemble.
    loaded.wait_for('model:pipeline_failures:rate5m{model="image_classification"}', lambda v: min(v.values()) > 0)
    # The misspelt payload never reached text_embedding: only the router counted it.
    loaded.wait_for('model:pipeline_failures:rate5m{model="text_embedding"}', lambda v: min(v.values()) > 0)
    assert loaded.values('rate(nv_inference_request_failure{model="text_embedding"}[5m])') and all(
        x == 0 for x in loaded.values('rate(nv_inference_request_failure{model="text_embedding"}[5m])').values())
    # general_llm without a gateway: every request failed, server-side (not_configured).
    loaded.wait_for('task:router_server_failures:ratio_rate5m{task="general_llm"}', lambda v: v and min(v.values()) == 1)
    (ratio,) = loaded.wait_for('task:router_failures:ratio_rate5m{task="text_embedding"}', lambda v: True).values()
    assert ratio == 1  # every text_embedding request through the router was the misspelt one
    (server_side,) = loaded.values('task:router_server_failures:ratio_rate5m{task="text_embedding"}').values()
    assert server_side == 0  # invalid_input is the client's


def test_router_rules(loaded):
    shares = loaded.wait_for('task_model_version:router_canary_requests:share5m{task="text_classification"}',
                             lambda v: True)
    assert math.isclose(sum(shares.values()), 1.0)
    latency = loaded.wait_for('task_route_quantile:router_upstream_latency_seconds:5m{task="text_classification"}',
                              lambda v: len(v) == 3)
    assert all(0 < x <= 60 for x in latency.values())
    outcomes = loaded.wait_for("task_route_outcome:router_requests:rate5m", lambda v: len(v) >= 3)
    assert {(dict(k)["task"], dict(k)["outcome"]) for k in outcomes} >= {
        ("text_classification", "success"), ("general_llm", "error"), ("text_embedding", "error")}
    assert loaded.values("router_gateway:budget_usd_per_hour:constant") == {
        (("__name__", "router_gateway:budget_usd_per_hour:constant"),): 20.0}


def test_raw_metric_names_are_the_servers(loaded, triton_server):
    """The catalog the rules and the dashboard are checked against (tests/support/prometheus_helpers.py)
    matches what this server exports, types included."""
    types = {}
    for line in scrape(triton_server.metrics_url).splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
    for name, kind in {**TRITON_EXPORTED, **ROUTER_EXPORTED}.items():
        assert types.get(name) == kind, (name, types.get(name))
    for name, kind in ANNOUNCED.items():  # the lead's additions, once they are there
        assert types.get(name, kind) == kind, (name, types[name])
    # Nothing the tutorial invented.
    assert not {"triton_queue_duration_p99", "triton_server_memory_usage", "triton_request_duration",
                "triton_inference_count", "triton_queue_duration"} & set(types)


def test_every_dashboard_query_runs_and_pipeline_panels_have_data(loaded):
    dashboard = json.loads(DASHBOARD.read_text())
    for title, expr in dashboard_exprs(dashboard):
        answer = loaded.get("/api/v1/query", query=expr)
        assert answer["status"] == "success", (title, expr, answer)
    queries = {panel["title"]: [t["expr"] for t in panel["targets"]] for panel in dashboard["panels"]
               if panel.get("targets")}
    for pipeline in PIPELINES:
        for panel in ("throughput", "latency p50/p95/p99 (worst pod) and mean", "failures"):
            # a cached pipeline's latency panel: its mean (it has no quantiles)
            latency_mean = panel.startswith("latency") and response_cached(pipeline)
            loaded.wait_for(queries[f"{pipeline}: {panel}"][1 if latency_mean else 0], lambda v: True)
    for title in ("Response cache hit ratio by model", "Response cache hits and misses"):
        loaded.wait_for(queries[title][0], lambda v: True)


def test_adapter_query_runs_on_the_real_series(loaded):
    """Rendered for this Prometheus' target (no Kubernetes labels here: by instance instead of pod)."""
    rule = adapter_rule()
    query = render_adapter_query(rule["metricsQuery"], "nv_inference_queue_summary_us", 'job="triton"', "instance")
    ((labels, value),) = loaded.wait_for(query, lambda v: True).items()
    assert dict(labels).keys() == {"instance"}
    assert 0 <= value < 10


def test_health_rules_on_the_launchers_metrics(loaded, triton_server):
    """With the launcher's metrics on the endpoint (the supervisor's launcher_* series): every
    model is ready on this one pod, nothing restarted, and the health alerts stay quiet."""
    exported = scrape(triton_server.metrics_url)
    if "launcher_model_ready{" not in exported:
        pytest.skip("this launcher exports no launcher_model_ready yet")
    ready = loaded.wait_for("model_version:launcher_model_ready:sum", lambda v: len(v) >= 20)
    assert all(x == 1 for x in ready.values()), {k: x for k, x in ready.items() if x != 1}
    assert {dict(k)["model"] for k in ready} >= {"router", "text_encoder", *PIPELINES}
    alerts = loaded.values('ALERTS{alertname=~"TritonModelNotReady|TritonStubRestarted|TritonServerRestarted|'
                           'TritonProxyRestarted|TritonMetricsDown"}')
    assert not alerts
