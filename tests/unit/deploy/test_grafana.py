"""deploy/grafana and the monitoring services of docker-compose.yml, offline: the dashboard is what
build_dashboard.py generates, every query parses (promtool) and reads only recorded series or raw
metrics that exist, each pipeline and the router have their panels, and the provisioning files,
the compose services and the Prometheus scrape target fit together. (tests/server/test_prometheus_live.py
runs the same queries against a real Prometheus scraping a real Triton.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.prometheus_helpers import (
    DASHBOARD, DEPLOY, PROJECT_ROOT, RAW_METRICS, dashboard_exprs, load_yaml, metric_names, promtool,
    recorded_names, series_names,
)

GRAFANA = DEPLOY / "grafana"


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def pipelines() -> list[str]:
    return sorted(p.name for p in (PROJECT_ROOT / "ensembles").iterdir() if (p / "config.pbtxt").exists())


def test_dashboard_is_generated_by_build_dashboard():
    result = subprocess.run([sys.executable, "-c", "import build_dashboard as b; print(b.render(), end='')"],
                            cwd=GRAFANA, capture_output=True, text=True, check=True)
    assert result.stdout == DASHBOARD.read_text(), "run `make dashboard`"


def test_every_query_parses(dashboard, tmp_path):
    exprs = dashboard_exprs(dashboard)
    assert len(exprs) >= 40
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}:check", "expr": expr} for i, (_, expr) in enumerate(exprs)]}]}
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


def test_queries_read_recorded_series_or_known_raw_metrics(dashboard):
    recorded = recorded_names()
    known = recorded | series_names(RAW_METRICS)
    raw_reads = set()
    for title, expr in dashboard_exprs(dashboard):
        names = metric_names(expr)
        assert names, f"{title}: {expr} reads no metric"
        assert not names - known, f"{title}: unknown metrics {sorted(names - known)} in {expr}"
        raw_reads |= names - recorded
    # Raw reads are the exceptions: scrape health and restarts over 1 h.
    assert raw_reads == {"up", "launcher_tritonserver_restarts_total", "launcher_proxy_restarts_total"}


def test_every_panel_uses_the_provisioned_datasource(dashboard):
    (variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    provisioned = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    assert variable["current"]["value"] == provisioned[0]["uid"]
    assert variable["query"] == provisioned[0]["type"] == "prometheus"

    def walk(panels):
        for panel in panels:
            if panel.get("targets"):
                assert panel["datasource"] == {"type": "prometheus", "uid": "${" + variable["name"] + "}"}
                assert all(t["datasource"] == panel["datasource"] for t in panel["targets"])
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_each_pipeline_has_throughput_latency_queue_batch_and_failure_panels(dashboard):
    titles = [p["title"] for p in dashboard["panels"]]
    for pipeline in pipelines():
        assert any(t.startswith(f"Pipeline {pipeline}:") for t in titles)
        for what in ("throughput", "latency p50/p95/p99", "queue time p50/p95/p99", "batch size", "failures"):
            assert any(t.startswith(f"{pipeline}: {what}") for t in titles), (pipeline, what)
        # Its queue panel reads the steps of the pipeline, e.g. text_encoder for text_embedding.
    queue = {p["title"]: p["targets"][0]["expr"] for p in dashboard["panels"] if "queue time p50" in p["title"]}
    assert "text_encoder" in queue["text_embedding: queue time p50/p95/p99 per step (worst pod)"]
    assert "whisper_decoder" in queue["speech_recognition: queue time p50/p95/p99 per step (worst pod)"]
    assert "intent_classifier" in queue["text_classification: queue time p50/p95/p99 per step (worst pod)"]


def test_router_memory_and_health_panels(dashboard):
    exprs = " ".join(expr for _, expr in dashboard_exprs(dashboard))
    for name in ("task_route_outcome:router_requests:rate5m", "task_model_version:router_canary_requests:share5m",
                 "model_direction:router_gateway_tokens:rate5m", "model:router_gateway_cost_usd:rate5m",
                 "model:router_gateway_circuit_open:max", "instance_gpu:nv_gpu_memory_used:ratio",
                 "instance:nv_cpu_memory_used:ratio", "model_version:launcher_model_ready:sum"):
        assert name in exprs


def test_compose_monitoring_services_mount_existing_files_with_pinned_images():
    compose = load_yaml(PROJECT_ROOT / "docker-compose.yml")
    services = compose["services"]
    for name in ("prometheus", "grafana"):
        service = services[name]
        image, _, tag = service["image"].partition(":")
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), service["image"]
        for volume in service["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (PROJECT_ROOT / source).exists(), volume
            else:
                assert source in compose["volumes"], volume
        for port in service["ports"]:
            assert port.startswith("127.0.0.1:"), f"{name} is published beyond the host's loopback: {port}"
    # Prometheus reads its config where the volume puts deploy/prometheus.
    prometheus = services["prometheus"]
    config = next(a.split("=", 1)[1] for a in prometheus["command"] if a.startswith("--config.file="))
    mount = next(v for v in prometheus["volumes"] if v.startswith("./deploy/prometheus:"))
    assert Path(config).parent == Path(mount.split(":")[1])
    # It scrapes the triton service's metrics port, and Grafana reaches it by its service name.
    scrape = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")["scrape_configs"]
    (target,) = [t for c in scrape for s in c["static_configs"] for t in s["targets"]]
    host, port = target.split(":")
    # the container port (the host port may be chosen with ${TRITON_METRICS_PORT:-8002})
    assert host == "triton" and any(p.endswith(f":{port}") for p in services["triton"]["ports"])
    datasource = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"
    # Grafana's dashboard provider reads the folder the compose file mounts the dashboards into.
    provider = load_yaml(GRAFANA / "provisioning" / "dashboards" / "triton-pipelines.yml")["providers"][0]
    dashboards_mount = next(v for v in services["grafana"]["volumes"] if v.startswith("./deploy/grafana/dashboards:"))
    assert provider["options"]["path"] == dashboards_mount.split(":")[1]
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
