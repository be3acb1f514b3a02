"""Shared by the monitoring tests (tests/test_prometheus*.py, tests/test_deploy_*.py): where the
deploy/ files are, Debian's promtool and prometheus, the catalog of raw metric names the rules and
the dashboard may use, and a small PromQL reader that lists the metric names of an expression."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from tests.support.paths import PROJECT_ROOT

DEPLOY = PROJECT_ROOT / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
RULE_FILES = [PROMETHEUS_DIR / "rules" / "recording.yml", PROMETHEUS_DIR / "rules" / "alerts.yml"]
RULE_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*_test.yml"))
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "triton-pipelines.json"
ADAPTER_RULES = DEPLOY / "k8s" / "prometheus-adapter-rules.yaml"

# Raw metric names, each checked against a running server or, where the embedded (CPU-only,
# gateway-less) server cannot show it, against its source. tests/server/test_prometheus_live.py scrapes
# the session's server and fails if a name listed as exported there is missing.
TRITON_EXPORTED = {  # tritonserver 2.51 with --metrics-config=summary_latencies=true (the launcher's)
    "nv_inference_request_success": "counter", "nv_inference_request_failure": "counter",
    "nv_inference_count": "counter", "nv_inference_exec_count": "counter",
    "nv_inference_request_duration_us": "counter", "nv_inference_queue_duration_us": "counter",
    "nv_inference_compute_input_duration_us": "counter", "nv_inference_compute_infer_duration_us": "counter",
    "nv_inference_compute_output_duration_us": "counter",
    "nv_inference_pending_request_count": "gauge",
    "nv_inference_request_summary_us": "summary", "nv_inference_queue_summary_us": "summary",
    "nv_inference_compute_input_summary_us": "summary", "nv_inference_compute_infer_summary_us": "summary",
    "nv_inference_compute_output_summary_us": "summary",
    "nv_pinned_memory_pool_total_bytes": "gauge", "nv_pinned_memory_pool_used_bytes": "gauge",
    "nv_cpu_utilization": "gauge", "nv_cpu_memory_total_bytes": "gauge", "nv_cpu_memory_used_bytes": "gauge",
    # the response cache's, for the models built with it (the launcher turns the cache on by default)
    "nv_cache_num_hits_per_model": "counter", "nv_cache_num_misses_per_model": "counter",
    "nv_cache_hit_duration_per_model": "counter", "nv_cache_miss_duration_per_model": "counter",
    "nv_cache_hit_summary_per_model": "summary", "nv_cache_miss_summary_per_model": "summary",
}
# DCGM metrics, only where Triton sees a GPU (Triton's metrics docs; core r24.10 src/metrics.cc).
TRITON_GPU = {
    "nv_gpu_utilization": "gauge", "nv_gpu_memory_total_bytes": "gauge", "nv_gpu_memory_used_bytes": "gauge",
    "nv_gpu_power_usage": "gauge", "nv_gpu_power_limit": "gauge", "nv_energy_consumption": "counter",
}
# The router's custom metrics (python_models/router/model.py); created on first use, so they appear
# after the first request of their kind.
ROUTER_EXPORTED = {
    "router_requests_total": "counter", "router_failures_total": "counter",
    "router_upstream_latency_seconds": "histogram", "router_canary_requests_total": "counter",
}
# Only after a gateway call (tests/server/test_router_gateway.py checks them against the fake gateway).
ROUTER_GATEWAY = {"router_gateway_tokens_total": "counter", "router_gateway_cost_usd_total": "counter",
                  # keys, budgets, fallbacks (tests/server/test_gateway_server.py checks them through a server)
                  "router_spend_usd_total": "counter", "router_budget_remaining_usd": "gauge",
                  "router_key_window_spend_usd": "gauge", "router_key_soft_budget_usd": "gauge",
                  "router_fallbacks_total": "counter", "router_cooldowns_total": "counter",
                  "router_refusals_total": "counter"}
# The OpenAI-compatible frontend's (openai_api/metrics.py), merged into :8002/metrics by the launcher
# (tests/server/test_openai_server.py and tests/server/test_gateway_chat.py read them through a server).
OPENAI_FRONTEND = {"openai_requests_total": "counter", "openai_spend_usd_total": "counter",
                   "openai_budget_remaining_usd": "gauge", "openai_key_window_spend_usd": "gauge",
                   "openai_key_soft_budget_usd": "gauge", "openai_fallbacks_total": "counter",
                   "openai_cooldowns_total": "counter", "openai_refusals_total": "counter"}
# Announced by the lead (router gauge, launcher metrics), not in this tree yet: when a server
# exports one, tests/server/test_prometheus_live.py checks its type.
ANNOUNCED = {
    "router_gateway_circuit_open": "gauge",
    "launcher_tritonserver_restarts_total": "counter",
    "launcher_proxy_restarts_total": "counter",
    "launcher_stub_restarts_total": "counter",
    "launcher_model_ready": "gauge",
}
PROMETHEUS_OWN = {"up": "gauge"}
RAW_METRICS = {**TRITON_EXPORTED, **TRITON_GPU, **ROUTER_EXPORTED, **ROUTER_GATEWAY, **OPENAI_FRONTEND, **ANNOUNCED, **PROMETHEUS_OWN}
SERIES_SUFFIXES = {"summary": ("", "_sum", "_count"), "histogram": ("_bucket", "_sum", "_count")}


def series_names(catalog: dict[str, str]) -> set[str]:
    """The sample names of each family (a summary's _sum/_count, a histogram's _bucket/...)."""
    return {name + suffix for name, kind in catalog.items() for suffix in SERIES_SUFFIXES.get(kind, ("",))}


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: `make test` installs Debian's prometheus package (promtool, prometheus)")
    return path


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def rules() -> list[dict]:
    return [rule for path in RULE_FILES for group in load_yaml(path)["groups"] for rule in group["rules"]]


def recorded_names() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def alert_names() -> list[str]:
    return [rule["alert"] for rule in rules() if "alert" in rule]


_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
             "group_right", "inf", "nan", "atan2", "start", "end"}


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are not functions, keywords, label
    names (inside {...} or grouping lists), durations or parts of numbers."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.:])([a-zA-Z_:][a-zA-Z0-9_:]*)", text):
        name = match.group(1)
        if name.lower() in _KEYWORDS or re.match(r"\s*\(", text[match.end():]):
            continue
        names.add(name)
    return names


def dashboard_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) for every query of every panel, rows' nested panels included."""
    found = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                found.append((panel["title"], target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    return found


def adapter_rule() -> dict:
    rules_ = load_yaml(ADAPTER_RULES)["rules"]["custom"]
    assert len(rules_) == 1
    return rules_[0]


def render_adapter_query(template: str, series: str, label_matchers: str, group_by: str) -> str:
    """prometheus-adapter's metricsQuery is a Go template over .Series, .LabelMatchers, .GroupBy
    (with << >> delimiters); these three fields are all the rule uses."""
    values = {"Series": series, "LabelMatchers": label_matchers, "GroupBy": group_by}
    rendered = re.sub(r"<<\s*\.(\w+)\s*>>", lambda m: values[m.group(1)], template)
    assert "<<" not in rendered and ">>" not in rendered, rendered
    return rendered
