"""Custom metrics on Triton's ``/metrics`` through ``pb_utils.MetricFamily``.

Families are kept alive for the model's lifetime (a Metric outliving its MetricFamily fails); one
Metric per label set, created on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import triton_python_backend_utils as pb_utils

if TYPE_CHECKING:
    from triton_pipelines.gateway.upstream import Completion
    from triton_pipelines.repository.routes import RoutedRequest

LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class MetricSet:
    def __init__(self, specs: Mapping[str, tuple[str, str, str]]):
        """``specs``: key → (metric name, description, counter|gauge|histogram)."""
        # The stub defines MetricFamily after our module is imported: look it up here.
        family = pb_utils.MetricFamily
        kinds = {"counter": family.COUNTER, "gauge": family.GAUGE, "histogram": family.HISTOGRAM}
        self.families = {key: family(name, description, kinds[kind]) for key, (name, description, kind) in specs.items()}
        self.kinds = {key: kind for key, (_, _, kind) in specs.items()}
        self.metrics = {}

    def __call__(self, key: str, **labels: str):
        index = (key, tuple(sorted(labels.items())))
        if index not in self.metrics:
            extra = {"buckets": LATENCY_BUCKETS_S} if self.kinds[key] == "histogram" else {}
            self.metrics[index] = self.families[key].Metric(labels=labels, **extra)
        return self.metrics[index]


class RouterMetrics(MetricSet):
    """The router's metrics (``pipelines.router.service.Recorder``)."""

    def __init__(self):
        super().__init__({
            "requests": ("router_requests_total", "Router requests by task, route and outcome (success|error); "
                         "Triton's own counters count error responses as successes", "counter"),
            "failures": ("router_failures_total", "Router requests that failed, by task, route and reason",
                         "counter"),
            "latency": ("router_upstream_latency_seconds",
                        "Time spent in the upstream call (BLS ensemble or gateway, retries included)", "histogram"),
            "tokens": ("router_gateway_tokens_total", "Tokens reported by the gateway, by model and direction "
                       "(input|output)", "counter"),
            "cost": ("router_gateway_cost_usd_total", "USD spent at the gateway, by model", "counter"),
            "canary": ("router_canary_requests_total", "Requests served per canary model version, by task",
                       "counter"),
            "circuit": ("router_gateway_circuit_open", "1 while the circuit breaker of a gateway model is open",
                        "gauge"),
            "spend": ("router_spend_usd_total", "USD spent at the gateway, by API key name and model (the spend "
                      "ledger's settled costs)", "counter"),
            "remaining": ("router_budget_remaining_usd", "What is left of an API key's budget in its current "
                          "window (spent and reserved subtracted)", "gauge"),
            "window_spend": ("router_key_window_spend_usd", "An API key's spend (and outstanding reservations) in "
                             "its current budget window", "gauge"),
            "soft_budget": ("router_key_soft_budget_usd", "An API key's soft budget (an alert, not a refusal)",
                            "gauge"),
            "fallbacks": ("router_fallbacks_total", "Gateway requests answered by a fallback model, by the model "
                          "asked for (from), the one that answered (to) and why", "counter"),
            "cooldowns": ("router_cooldowns_total", "Times a gateway model was cooled down (its circuit opened "
                          "after repeated failures; skipped while it lasts)", "counter"),
            "over_reservation": ("router_over_reservation_total", "Gateway calls settled above their reservation "
                                 "(charged in full), by API key name and model", "counter"),
            "over_reservation_usd": ("router_over_reservation_usd_total", "USD gateway calls cost above their "
                                     "reservations, by API key name and model", "counter"),
            "refusals": ("router_refusals_total", "Gateway requests refused before the gateway was called, by API "
                         "key name and reason (unauthenticated, model_not_allowed, over_budget, rate_limited)",
                         "counter"),
        })

    def request(self, task: str, route: str, reason: str | None, latency_s: float | None,
                routed: RoutedRequest | None, completion: Completion | None, cost_usd: float) -> None:
        self("requests", task=task, route=route, outcome="error" if reason else "success").increment(1)
        if reason:
            self("failures", task=task, route=route, reason=reason).increment(1)
        if latency_s is not None:
            self("latency", task=task, route=route).observe(latency_s)
        if routed is not None and routed.canary and not reason:
            self("canary", task=task, model=routed.canary, version=str(routed.model_version)).increment(1)
        if completion is not None and routed is not None:
            self("tokens", model=routed.target, direction="input").increment(completion.input_tokens)
            self("tokens", model=routed.target, direction="output").increment(completion.output_tokens)
            self("cost", model=routed.target).increment(cost_usd)

    def circuit(self, model: str, open_: bool) -> None:
        self("circuit", model=model).set(1 if open_ else 0)

    # gateway.recorder.SpendRecorder
    def spend(self, key_name: str, model: str, cost_usd: float) -> None:
        self("spend", key_name=key_name, model=model).increment(cost_usd)

    def budget(self, key_name: str, remaining_usd: float | None, window_spend_usd: float,
               soft_budget_usd: float | None) -> None:
        if remaining_usd is not None:
            self("remaining", key_name=key_name).set(remaining_usd)
        self("window_spend", key_name=key_name).set(window_spend_usd)
        if soft_budget_usd is not None:
            self("soft_budget", key_name=key_name).set(soft_budget_usd)

    def fallback(self, from_model: str, to_model: str, reason: str) -> None:
        # "from" is a Python keyword: the labels go in as a mapping
        self("fallbacks", **{"from": from_model, "to": to_model, "reason": reason}).increment(1)

    def cooldown(self, model: str) -> None:
        self("cooldowns", model=model).increment(1)

    def refusal(self, key_name: str, reason: str) -> None:
        self("refusals", key_name=key_name, reason=reason).increment(1)

    def overspend(self, key_name: str, model: str, over_usd: float) -> None:
        self("over_reservation", key_name=key_name, model=model).increment(1)
        self("over_reservation_usd", key_name=key_name, model=model).increment(over_usd)

    def start_at_zero(self, tasks: Mapping[str, str], gateway_models: list[str]) -> None:
        """Create the known series at 0 (``tasks``: task → route): a counter first seen at 1 hides
        that first event from rate() and increase()."""
        for task, route in tasks.items():
            for outcome in ("success", "error"):
                self("requests", task=task, route=route, outcome=outcome)
            reasons = ("invalid_input", "timeout", "overloaded", "internal") + (
                ("upstream_invalid_input", "upstream_unavailable", "upstream_error", "not_loaded") if route == "triton"
                else ("not_configured", "circuit_open", "unreachable", "upstream_status", "rejected", "bad_response",
                      "context_window", "ledger_unavailable", "unauthenticated", "model_not_allowed", "over_budget",
                      "rate_limited"))
            for reason in reasons:
                self("failures", task=task, route=route, reason=reason)
        for model in gateway_models:
            self("cooldowns", model=model)
            self("circuit", model=model).set(0)
            for direction in ("input", "output"):
                self("tokens", model=model, direction=direction)
            self("cost", model=model)


class PreprocessMetrics(MetricSet):
    """``image_preprocess``'s split of its compute time, summed over images (``vision.DecodeTiming``)."""

    def __init__(self, model: str, version: str):
        super().__init__({
            "decode": ("image_preprocess_decode_duration_us",
                       "Cumulative time decoding images to RGB (header checks, decompression, mode conversion)",
                       "counter"),
            "transform": ("image_preprocess_transform_duration_us",
                          "Cumulative time resizing, cropping and normalizing decoded images", "counter"),
        })
        # Created now, so that both series exist (at 0) before the first request.
        self.decode_us = self("decode", model=model, version=version)
        self.transform_us = self("transform", model=model, version=version)

    def record(self, timing) -> None:
        self.decode_us.increment(timing.decode_s * 1e6)
        self.transform_us.increment(timing.transform_s * 1e6)
