"""The ``/v1`` frontend's metrics (``GET /metrics`` on its loopback port; the launcher appends them
to the public ``:8002/metrics``): ``openai_requests_total``, ``openai_request_duration_seconds``,
``openai_streamed_responses_total``, ``openai_stream_disconnects_total``; chat's gateway figures
``openai_spend_usd_total``, ``openai_budget_remaining_usd``, ``openai_fallbacks_total``,
``openai_cooldowns_total``, ``openai_refusals_total``, ``openai_over_reservation_total`` and
``openai_over_reservation_usd_total`` (the router's are ``router_*``).
"""

from __future__ import annotations

import threading
from collections import Counter

from triton_pipelines.prometheus_text import family

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics:
    """Counters by endpoint, model (a known name or "other") and status; latency histogram."""

    def __init__(self, known_models: set[str]):
        self.known = known_models
        self.lock = threading.Lock()
        self.requests: Counter = Counter()
        self.streams: Counter = Counter()
        self.disconnects: Counter = Counter()
        self.buckets: dict[tuple[str, str], list[int]] = {}
        self.sums: Counter = Counter()
        # GatewayService's spend recorder (gateway.recorder.SpendRecorder): /v1 chat's share
        self.spent: Counter = Counter()
        self.fallbacks: Counter = Counter()
        self.cooldowns: Counter = Counter()
        self.refusals: Counter = Counter()
        self.over_reservation: Counter = Counter()
        self.over_reservation_usd: Counter = Counter()
        self.budgets: dict[str, float] = {}
        self.window_spend: dict[str, float] = {}
        self.soft_budgets: dict[str, float] = {}

    def spend(self, key_name: str, model: str, cost_usd: float) -> None:
        with self.lock:
            self.spent[(key_name, model)] += cost_usd

    def budget(self, key_name: str, remaining_usd: float | None, window_spend_usd: float,
               soft_budget_usd: float | None) -> None:
        with self.lock:
            if remaining_usd is not None:
                self.budgets[key_name] = remaining_usd
            self.window_spend[key_name] = window_spend_usd
            if soft_budget_usd is not None:
                self.soft_budgets[key_name] = soft_budget_usd

    def fallback(self, from_model: str, to_model: str, reason: str) -> None:
        with self.lock:
            self.fallbacks[(from_model, to_model, reason)] += 1

    def cooldown(self, model: str) -> None:
        with self.lock:
            self.cooldowns[model] += 1

    def refusal(self, key_name: str, reason: str) -> None:
        with self.lock:
            self.refusals[(key_name, reason)] += 1

    def overspend(self, key_name: str, model: str, over_usd: float) -> None:
        with self.lock:
            self.over_reservation[(key_name, model)] += 1
            self.over_reservation_usd[(key_name, model)] += over_usd

    def model_label(self, model) -> str:
        return model if isinstance(model, str) and model in self.known else ("" if model is None else "other")

    def observe(self, endpoint: str, model, status: int, seconds: float) -> None:
        label = self.model_label(model)
        with self.lock:
            self.requests[(endpoint, label, str(status))] += 1
            counts = self.buckets.setdefault((endpoint, label), [0] * (len(LATENCY_BUCKETS) + 1))
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    counts[i] += 1
            counts[-1] += 1
            self.sums[(endpoint, label)] += seconds

    def streamed(self, endpoint: str, model, disconnected: bool = False) -> None:
        with self.lock:
            (self.disconnects if disconnected else self.streams)[(endpoint, self.model_label(model))] += 1

    def render(self) -> str:
        with self.lock:
            lines = family("openai_requests_total", "counter", "/v1 requests of the OpenAI-compatible frontend by "
                           "endpoint, model and HTTP status", ("endpoint", "model", "code"), self.requests)
            lines += ["# HELP openai_request_duration_seconds time to the last byte of a /v1 response",
                      "# TYPE openai_request_duration_seconds histogram"]
            for (e, m), counts in sorted(self.buckets.items()):
                for bound, count in zip(LATENCY_BUCKETS, counts):
                    lines.append(f'openai_request_duration_seconds_bucket{{endpoint="{e}",model="{m}",le="{bound}"}} {count}')
                lines.append(f'openai_request_duration_seconds_bucket{{endpoint="{e}",model="{m}",le="+Inf"}} {counts[-1]}')
                lines.append(f'openai_request_duration_seconds_sum{{endpoint="{e}",model="{m}"}} {self.sums[(e, m)]:.6f}')
                lines.append(f'openai_request_duration_seconds_count{{endpoint="{e}",model="{m}"}} {counts[-1]}')
            endpoint_model, key, usd = ("endpoint", "model"), ("key_name",), "{:.9f}"
            lines += family("openai_streamed_responses_total", "counter",
                            "/v1 responses sent as server-sent events", endpoint_model, self.streams)
            lines += family("openai_stream_disconnects_total", "counter", "streams whose client left before the "
                            "end (the Triton stream was cancelled)", endpoint_model, self.disconnects)
            lines += family("openai_spend_usd_total", "counter", "settled spend of /v1/chat/completions by key name "
                            "and model (the router's: router_spend_usd_total)", ("key_name", "model"), self.spent, usd)
            lines += family("openai_budget_remaining_usd", "gauge", "a key's budget less spend and reservations in "
                            "its window (the shared ledger, read after each /v1 chat call)", key, self.budgets, usd)
            # the same two gauges as the router's (router_key_*): the soft-budget alert reads both families
            lines += family("openai_key_window_spend_usd", "gauge", "a key's spend and outstanding reservations in "
                            "its budget window (the shared ledger, read after each /v1 chat call)", key,
                            self.window_spend, usd)
            lines += family("openai_key_soft_budget_usd", "gauge", "a key's soft budget (an alert, not a refusal)",
                            key, self.soft_budgets, usd)
            lines += family("openai_fallbacks_total", "counter", "/v1 chat completions answered by another model "
                            "than asked", ("from", "to", "reason"), self.fallbacks)
            lines += family("openai_cooldowns_total", "counter", "times a gateway model's circuit opened in this "
                            "frontend", ("model",), self.cooldowns)
            lines += family("openai_refusals_total", "counter", "/v1 chat completions refused by a key's limits or "
                            "models", ("key_name", "reason"), self.refusals)
            lines += family("openai_over_reservation_total", "counter", "/v1 chat completions settled above their "
                            "reservation (charged in full)", ("key_name", "model"), self.over_reservation)
            lines += family("openai_over_reservation_usd_total", "counter", "what /v1 chat completions cost above "
                            "their reservations", ("key_name", "model"), self.over_reservation_usd, usd)
        return "\n".join(lines) + "\n"
