"""BLS router: ``task`` + JSON ``payload`` (+ ``latency_class``) → ``result`` JSON.

Self-hosted tasks go to our ensembles with BLS ``async_exec``; gateway tasks go to the
OpenAI-compatible gateway on a thread pool. All requests of a batch are served concurrently.
Logic lives in ``triton_pipelines.routing`` / ``triton_pipelines.gateway``; this file adds the
BLS calls and the custom metrics."""

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from triton_pipelines.backend import model_parameters
from triton_pipelines.errors import InputError
from triton_pipelines.gateway import GatewayClient
from triton_pipelines.routing import RouteError, Router, RouteTable, SplitFile, json_bytes

# Error codes: bad input → INVALID_ARG (HTTP 400); the gateway missing or down → UNAVAILABLE;
# anything else → INTERNAL.
UNAVAILABLE_REASONS = ("not_loaded", "not_configured", "circuit_open", "timeout", "unreachable", "upstream_status")
LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class Metrics:
    """Custom metrics on :8002/metrics. Families are kept alive for the model's lifetime
    (a Metric outliving its MetricFamily fails); one Metric per label set, created on first use."""

    def __init__(self):
        family = pb_utils.MetricFamily
        self.families = {
            "requests": family("router_requests_total", "Router requests by task, route and outcome "
                               "(success|error); Triton's own counters count error responses as successes",
                               family.COUNTER),
            "failures": family("router_failures_total", "Router requests that failed, by task, route and reason",
                               family.COUNTER),
            "latency": family("router_upstream_latency_seconds",
                              "Time spent in the upstream call (BLS ensemble or gateway, retries included)",
                              family.HISTOGRAM),
            "tokens": family("router_gateway_tokens_total", "Tokens reported by the gateway, by model and "
                             "direction (input|output)", family.COUNTER),
            "cost": family("router_gateway_cost_usd_total", "USD spent at the gateway, by model", family.COUNTER),
            "canary": family("router_canary_requests_total", "Requests served per canary model version, by task",
                             family.COUNTER),
        }
        self.metrics = {}

    def _metric(self, kind, **labels):
        key = (kind, tuple(sorted(labels.items())))
        if key not in self.metrics:
            extra = {"buckets": LATENCY_BUCKETS_S} if kind == "latency" else {}
            self.metrics[key] = self.families[kind].Metric(labels=labels, **extra)
        return self.metrics[key]

    def record(self, task, route, reason=None, latency_s=None, routed=None, completion=None):
        self._metric("requests", task=task, route=route, outcome="error" if reason else "success").increment(1)
        if reason:
            self._metric("failures", task=task, route=route, reason=reason).increment(1)
        if latency_s is not None:
            self._metric("latency", task=task, route=route).observe(latency_s)
        if routed is not None and routed.canary and not reason:
            self._metric("canary", task=task, model=routed.canary, version=str(routed.model_version)).increment(1)
        if completion is not None:
            model = routed.target
            self._metric("tokens", model=model, direction="input").increment(completion.input_tokens)
            self._metric("tokens", model=model, direction="output").increment(completion.output_tokens)


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        model_dir = Path(args["model_repository"])
        table = RouteTable.load(model_dir / args["model_version"] / "routes.yaml")
        split_path = os.environ.get("ROUTER_SPLIT_FILE") or parameters.get("split_file") or model_dir / "splits.json"
        self.router = Router(table, SplitFile(split_path, table.canaries))
        self.gateway = GatewayClient(table.gateway)
        self.pool = ThreadPoolExecutor(table.gateway.max_workers, thread_name_prefix="gateway")
        self.metrics = Metrics()
        self.logger = pb_utils.Logger
        self.logger.log_info(f"router: {len(table.tasks)} tasks; split file {split_path}; external gateway "
                             + ("configured" if self.gateway.configured else "not configured"))

    async def execute(self, requests):
        return list(await asyncio.gather(*(self.handle(request) for request in requests)))

    async def handle(self, request):
        tensors = {name: pb_utils.get_input_tensor_by_name(request, name)
                   for name in ("task", "payload", "latency_class")}
        tasks = tensors["task"].as_numpy().reshape(-1)
        payloads = tensors["payload"].as_numpy().reshape(-1)
        classes = tensors["latency_class"].as_numpy().reshape(-1) if tensors["latency_class"] else None
        if len(payloads) != len(tasks) or (classes is not None and len(classes) not in (1, len(tasks))):
            return self.error("invalid_input", "inputs 'task', 'payload' and 'latency_class' need the same batch size")
        if len(tasks) > self.router.table.max_rows_per_request:
            return self.error("invalid_input", f"{len(tasks)} rows in one request; the limit is "
                              f"{self.router.table.max_rows_per_request}")
        rows = await asyncio.gather(*(
            self.route_one(tasks[i], payloads[i], None if classes is None else classes[min(i, len(classes) - 1)],
                           request.request_id() or None)
            for i in range(len(tasks))))
        failed = [(reason, message) for reason, message in rows if reason]
        if failed:
            return self.error(failed[0][0], failed[0][1] if len(rows) == 1 else "; ".join(
                f"row {i}: {message}" for i, (reason, message) in enumerate(rows) if reason))
        result = np.array([[message] for _, message in rows], dtype=np.object_)
        return pb_utils.InferenceResponse([pb_utils.Tensor("result", result)])

    @staticmethod
    def error(reason, message):
        code = (pb_utils.TritonError.INVALID_ARG if reason == "invalid_input" else
                pb_utils.TritonError.UNAVAILABLE if reason in UNAVAILABLE_REASONS else pb_utils.TritonError.INTERNAL)
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))

    async def route_one(self, task, payload, latency_class, key):
        """(None, result JSON bytes) or (failure reason, error message); records the metrics."""
        try:
            routed = self.router.prepare(task, payload, latency_class, key)
        except InputError as error:
            known = isinstance(task, bytes) and task.decode("utf-8", "replace").strip() in self.router.table.tasks
            label = task.decode().strip() if known else "unknown"
            route = self.router.table.tasks[label].route if known else "none"
            self.metrics.record(label, route, reason="invalid_input")
            return "invalid_input", str(error)
        started = time.monotonic()
        completion = None
        try:
            if routed.route == "triton":
                try:
                    outputs = await self.call_triton(routed)
                except RouteError as error:
                    fallback = self.router.without_batch_variant(routed)
                    if error.reason != "not_loaded" or fallback is None:
                        raise
                    routed = fallback
                    outputs = await self.call_triton(routed)
                result = self.router.triton_result(routed, outputs)
            else:
                loop = asyncio.get_running_loop()
                completion = await loop.run_in_executor(self.pool, self.gateway.complete, routed)
                result = self.router.gateway_result(routed, completion.text, completion.input_tokens,
                                                    completion.output_tokens)
                self.metrics._metric("cost", model=routed.target).increment(result["usage"]["cost_usd"])
        except RouteError as error:
            self.metrics.record(routed.task, routed.route, reason=error.reason,
                                latency_s=time.monotonic() - started, routed=routed)
            return error.reason, f"task {routed.task} ({routed.route}): {error}"
        self.metrics.record(routed.task, routed.route, latency_s=time.monotonic() - started, routed=routed,
                            completion=completion)
        return None, json_bytes(result)

    async def call_triton(self, routed):
        bls = pb_utils.InferenceRequest(
            model_name=routed.target, requested_output_names=list(routed.outputs),
            inputs=[pb_utils.Tensor(name, array) for name, array in routed.inputs.items()])
        try:
            response = await bls.async_exec()
        except pb_utils.TritonModelException as error:
            raise RouteError("upstream_error", f"model {routed.target}: {error}") from None
        if response.has_error():
            message = response.error().message()
            if f"Model '{routed.target}' is not ready" in message or "unknown model" in message:
                raise RouteError("not_loaded", f"model {routed.target} is not loaded on this server "
                                               f"(is its pipeline in the repository?)")
            raise RouteError("upstream_error", f"model {routed.target}: {message}")
        outputs = {}
        for name in routed.outputs:
            tensor = pb_utils.get_output_tensor_by_name(response, name)
            if tensor is None:
                raise RouteError("upstream_error", f"model {routed.target} returned no output '{name}'")
            outputs[name] = tensor.as_numpy()
        return outputs

    def finalize(self):
        self.pool.shutdown(wait=False, cancel_futures=True)
