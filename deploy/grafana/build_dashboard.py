"""Write dashboards/triton-pipelines.json, the Grafana dashboard of the pipelines.

    .venv/bin/python deploy/grafana/build_dashboard.py      # or: make dashboard

One row per pipeline (every ensemble in ensembles/: its requests, latency and queue quantiles, the
batch size, failures and pending requests of its steps, found from the ensemble configs and the
BLS models' `bls_dependencies`), then models, memory, router and health rows. Queries read the
recording rules of deploy/prometheus/rules/recording.yml wherever one exists.
tests/unit/deploy/test_grafana.py fails when the committed JSON differs from what this writes, and
checks every query against promtool and the recorded/raw metric names.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROJECT_ROOT = HERE.parents[1]
OUTPUT = HERE / "dashboards" / "triton-pipelines.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Latency-class and canary variants of a model or ensemble (build/repo_builder/variants.py).
VARIANTS = "(_batch)?(_v[0-9]+)?"


def _config_models(path: Path) -> list[str]:
    """Models an ensemble's steps name, or a BLS model's bls_dependencies (none for '*'). The step the
    builder names (image_classification's classifier: --image-model) is the default build's."""
    from repo_builder.vision_models import DEFAULT_MODEL_NAME
    from repo_builder.vision_pipeline import CLASSIFIER_STEP

    text = path.read_text()
    names = [DEFAULT_MODEL_NAME if name == CLASSIFIER_STEP else name
             for name in re.findall(r'model_name:\s*"([^"]+)"', text)]
    deps = re.search(r'key:\s*"bls_dependencies"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)
    if deps and deps.group(1) != "*":
        names += [name.strip() for name in deps.group(1).split(",") if name.strip()]
    return names


def pipeline_steps(pipeline: str) -> list[str]:
    """Every model a request to ``pipeline`` runs: ensemble steps, nested ensembles' steps, BLS callees."""
    steps: list[str] = []
    pending = _config_models(PROJECT_ROOT / "ensembles" / pipeline / "config.pbtxt")
    while pending:
        model = pending.pop(0)
        if model in steps:
            continue
        for folder in ("ensembles", "python_models"):
            config = PROJECT_ROOT / folder / model / "config.pbtxt"
            if config.exists():  # depth first: a nested ensemble's steps or a BLS model's callees next
                pending = _config_models(config) + pending
        if not (PROJECT_ROOT / "ensembles" / model).exists():
            steps.append(model)
    return steps


def pipelines() -> list[str]:
    return sorted(p.name for p in (PROJECT_ROOT / "ensembles").iterdir() if (p / "config.pbtxt").exists())


class Layout:
    """Panels left to right, 24 grid units wide, a row header before each group."""

    def __init__(self):
        self.panels: list[dict] = []
        self.x = self.y = 0
        self.next_id = 1

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y = 0, self.y + 8
        self.panels.append({"type": "row", "id": self._id(), "title": title, "collapsed": False,
                            "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1}, "panels": []})
        self.y += 1

    def _place(self, panel: dict, width: int) -> dict:
        if self.x + width > 24:
            self.x, self.y = 0, self.y + 8
        panel["id"] = self._id()
        panel["gridPos"] = {"x": self.x, "y": self.y, "w": width, "h": 8}
        self.x += width
        self.panels.append(panel)
        return panel

    def timeseries(self, title: str, targets: list[tuple[str, str]], unit: str, description: str = "",
                   width: int = 8, threshold: float | None = None) -> None:
        defaults: dict = {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 10, "spanNulls": False}}
        if threshold is not None:
            defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": "green", "value": None},
                                                                      {"color": "red", "value": threshold}]}
            defaults["custom"]["thresholdsStyle"] = {"mode": "line"}
        self._place({
            "type": "timeseries", "title": title, "description": description, "datasource": DATASOURCE,
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": [{"datasource": DATASOURCE, "refId": chr(ord("A") + i), "expr": expr,
                         "legendFormat": legend, "range": True} for i, (expr, legend) in enumerate(targets)],
        }, width)

    def stat(self, title: str, targets: list[tuple[str, str]], unit: str, description: str = "",
             width: int = 8) -> None:
        self._place({
            "type": "stat", "title": title, "description": description, "datasource": DATASOURCE,
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area", "textMode": "value_and_name"},
            "targets": [{"datasource": DATASOURCE, "refId": chr(ord("A") + i), "expr": expr,
                         "legendFormat": legend, "instant": True} for i, (expr, legend) in enumerate(targets)],
        }, width)

    def text(self, title: str, content: str, width: int = 8) -> None:
        self._place({"type": "text", "title": title, "options": {"mode": "markdown", "content": content}}, width)


def pipeline_rows(layout: Layout) -> None:
    for pipeline in pipelines():
        steps = pipeline_steps(pipeline)
        own = f'model=~"{pipeline}{VARIANTS}"'
        parts = f'model=~"({"|".join(steps)}){VARIANTS}"'
        layout.row(f"Pipeline {pipeline}: {' → '.join(steps)}")
        layout.timeseries(f"{pipeline}: throughput", [
            (f"sum by (model) (model_version:nv_inference_request_success:rate5m{{{own}}})", "{{model}} requests/s"),
            (f"sum by (model) (model_version:nv_inference_count:rate5m{{{own}}})", "{{model}} inferences/s"),
            (f'sum by (outcome) (task_route_outcome:router_requests:rate5m{{task="{pipeline}"}})', "via router: {{outcome}}"),
        ], "reqps", "Successful requests per second (all pods), and the router's requests for the task of the same name.")
        layout.timeseries(f"{pipeline}: latency p50/p95/p99 (worst pod) and mean", [
            (f"model_version_quantile:nv_inference_request_seconds:max{{{own}}}", "{{model}} v{{version}} q{{quantile}}"),
            (f"model_version:nv_inference_request_seconds:mean5m{{{own}}}", "{{model}} v{{version}} mean"),
        ], "s", "Triton's request summary: per-pod quantiles over ~60 s, the worst pod shown (summaries do not add "
                "across pods); the mean is over all pods.")
        layout.timeseries(f"{pipeline}: queue time p50/p95/p99 per step (worst pod)", [
            (f"model_version_quantile:nv_inference_queue_seconds:max{{{parts}}}", "{{model}} v{{version}} q{{quantile}}"),
        ], "s", "Time requests wait in each step's scheduler queue. The alert and the HPA use p99 > 100 ms.",
            threshold=0.1)
        layout.timeseries(f"{pipeline}: batch size per step", [
            (f"model_version:nv_inference_batch_size:mean5m{{{parts}}}", "{{model}} v{{version}}"),
        ], "none", "Inferences per execution: what the dynamic batcher (or the BLS loop) achieved.")
        layout.timeseries(f"{pipeline}: failures", [
            (f"model:pipeline_failures:rate5m{{{own}}}", "{{model}} failures/s"),
            (f"model:pipeline_failures:ratio_rate5m{{{own}}}", "{{model}} failure ratio"),
            (f'sum by (reason) (task_route_reason:router_failures:rate5m{{task="{pipeline}"}})', "router: {{reason}}"),
        ], "short", "Triton's failures of the ensemble (a failed ensemble request counts twice) plus the router's "
                    "rejections before it; router failures by reason below.")
        layout.timeseries(f"{pipeline}: pending requests per step", [
            (f"model_version:nv_inference_pending_request_count:sum{{{parts}}}", "{{model}} v{{version}}"),
        ], "short", "Requests queued and not yet executing, summed over pods.")


def model_rows(layout: Layout) -> None:
    layout.row("Models")
    layout.timeseries("Queue time p99 by model (worst pod)", [
        ('model_version_quantile:nv_inference_queue_seconds:max{quantile="0.99"}', "{{model}} v{{version}}"),
    ], "s", "The HPA's signal, per model.", threshold=0.1)
    layout.timeseries("Compute time (mean) by model", [
        ("model_version:nv_inference_compute_infer_seconds:mean5m", "{{model}} v{{version}}"),
    ], "s")
    layout.timeseries("Triton failures by model and reason", [
        ("model_version_reason:nv_inference_request_failure:rate5m > 0", "{{model}} v{{version}} {{reason}}"),
    ], "reqps", "REJECTED: queue policy / timeout; CANCELED; BACKEND: the backend's execute failed; OTHER: the rest "
                "(ensembles). A Python model's error response counts as a success.")

    layout.row("Response cache")
    layout.timeseries("Response cache hit ratio by model", [
        ("model_version:nv_cache_hit:ratio_rate5m", "{{model}} v{{version}}"),
    ], "percentunit", "Hits / lookups of Triton's response cache (the models built with response_cache: the "
                      "text_embedding ensembles), all pods. Sized by --response-cache-bytes / "
                      "TRITON_RESPONSE_CACHE_BYTES (docs/operations.md).")
    layout.timeseries("Response cache hits and misses", [
        ("model_version:nv_cache_hits:rate5m", "{{model}} v{{version}} hits/s"),
        ("model_version:nv_cache_misses:rate5m", "{{model}} v{{version}} misses/s"),
    ], "reqps")
    layout.timeseries("Response cache time per hit and per miss (mean)", [
        ("model_version:nv_cache_hit_seconds:mean5m", "{{model}} v{{version}} hit"),
        ("model_version:nv_cache_miss_seconds:mean5m", "{{model}} v{{version}} miss (lookup + insert)"),
    ], "s", "A cached model exports no request-latency summary (Triton 2.51): its mean request time is in the "
            "pipeline row, the cache's own share here.")

    layout.row("Memory")
    layout.timeseries("GPU memory used", [
        ("instance_gpu:nv_gpu_memory_used:ratio", "{{instance}} {{gpu_uuid}}"),
    ], "percentunit", "nv_gpu_memory_used_bytes / nv_gpu_memory_total_bytes per GPU (DCGM; GPU pods only).", threshold=0.9)
    layout.timeseries("GPU utilization", [
        ("instance_gpu:nv_gpu_utilization:avg5m", "{{instance}} {{gpu_uuid}}"),
    ], "percentunit")
    layout.timeseries("Host memory used", [
        ("instance:nv_cpu_memory_used:ratio", "{{instance}}"),
        ("instance:nv_pinned_memory_pool_used:ratio", "{{instance}} pinned pool"),
    ], "percentunit", "nv_cpu_memory_* read /proc/meminfo: the node's memory, not the container's limit.", threshold=0.9)
    layout.text("Memory per model", (
        "Triton 2.51 exports no per-model memory metric: `nv_gpu_memory_*` is per GPU and `nv_cpu_memory_*` per "
        "node. Per-model figures exist only in the statistics API (`/v2/models/<model>/stats`, `memory_usage`, "
        "when the backend reports it). See docs/operations.md."))

    layout.row("Router")
    layout.timeseries("Router requests by task, route and outcome", [
        ("task_route_outcome:router_requests:rate5m", "{{task}} {{route}} {{outcome}}"),
    ], "reqps")
    layout.timeseries("Router failures by task and reason", [
        ("task_route_reason:router_failures:rate5m > 0", "{{task}} {{route}} {{reason}}"),
    ], "reqps")
    layout.timeseries("Router upstream latency p50/p95/p99", [
        ("task_route_quantile:router_upstream_latency_seconds:5m", "{{task}} {{route}} q{{quantile}}"),
    ], "s", "BLS or gateway time, retries included (a histogram: aggregated over pods).")
    layout.timeseries("Canary share by served version", [
        ("task_model_version:router_canary_requests:share5m", "{{task}} {{model}} v{{version}}"),
    ], "percentunit", "Share of each version of the canaried model among the task's requests (router_canary_requests_total).")
    layout.timeseries("Gateway tokens per model", [
        ("model_direction:router_gateway_tokens:rate5m", "{{model}} {{direction}}"),
    ], "short", "Tokens per second reported by the gateway.")
    layout.timeseries("Gateway spend per model", [
        ("model:router_gateway_cost_usd:rate5m * 3600", "{{model}}"),
    ], "currencyUSD", "USD per hour at the current rate (router_gateway_cost_usd_total).")
    layout.stat("Gateway spend, last hour, against the budget", [
        ("sum(model:router_gateway_cost_usd:increase1h)", "spent"),
        ("router_gateway:budget_usd_per_hour:constant", "budget"),
    ], "currencyUSD", "GatewaySpendOverBudget fires when the spend stays over the budget for 5 min.")
    layout.timeseries("Gateway circuit breakers", [
        ("model:router_gateway_circuit_open:max", "{{model}}"),
    ], "bool_on_off", "1 while the router's breaker for the gateway model is open (fails fast with 503).")
    layout.timeseries("Spend per API key and model, last hour", [
        ("key_name_model:router_spend_usd:increase1h", "{{key_name}} {{model}}"),
    ], "currencyUSD", "USD settled in the spend ledger per key and model (router_spend_usd_total); "
                      "python -m triton_pipelines spend has the ledger's full report.")
    layout.timeseries("Budget left per API key", [
        ("key_name:router_budget_remaining_usd:min", "{{key_name}} left"),
        ("key_name:router_key_window_spend_usd:max", "{{key_name}} spent this window"),
    ], "currencyUSD", "max_budget_usd less spend and reservations in the key's current window; at 0 the key "
                      "is refused with 429 until the window resets.")
    layout.timeseries("Gateway fallbacks", [
        ("from_to_reason:router_fallbacks:rate5m > 0", "{{from}} → {{to}} ({{reason}})"),
    ], "reqps", "Requests answered by a fallback model; GatewayFallbacksRising fires past 10% of gateway requests.")
    layout.timeseries("Cooldowns and refusals", [
        ("model:router_cooldowns:increase1h > 0", "{{model}} cooled down (1 h)"),
        ("key_name_reason:router_refusals:rate5m > 0", "{{key_name}} refused: {{reason}}"),
    ], "short", "Models skipped after repeated failures (circuit open); requests refused by a key's limits.")

    layout.row("Health")
    layout.timeseries("Pods where each model is ready", [
        ("model_version:launcher_model_ready:sum", "{{model}} v{{version}}"),
        ('count(up{job="triton"} == 1)', "pods scraped"),
    ], "short", "launcher_model_ready: READY with every Python stub alive.")
    layout.timeseries("Python stub restarts (1 h)", [
        ("model:launcher_stub_restarts:increase1h > 0", "{{model}}"),
    ], "short")
    layout.timeseries("tritonserver and proxy restarts (1 h)", [
        ("sum by (instance) (increase(launcher_tritonserver_restarts_total[1h]))", "{{instance}} tritonserver"),
        ("sum by (instance) (increase(launcher_proxy_restarts_total[1h]))", "{{instance}} nginx"),
    ], "short")


def dashboard() -> dict:
    layout = Layout()
    pipeline_rows(layout)
    model_rows(layout)
    return {
        "uid": "triton-pipelines",
        "title": "Triton pipelines",
        "description": "Generated by deploy/grafana/build_dashboard.py (make dashboard); do not edit by hand.",
        "tags": ["triton", "inference"],
        "timezone": "browser",
        "editable": False,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-3h", "to": "now"},
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": [{
            "name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {"text": "Prometheus", "value": "prometheus"}, "hide": 0, "refresh": 1,
            "options": [], "includeAll": False, "multi": False,
        }]},
        "panels": layout.panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
