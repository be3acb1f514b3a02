"""The Router: a request validated and sent to its route (a Triton model or the gateway), and its result.

The ``router`` BLS model (``python_models/router/model.py``) is a thin adapter over this module:
it reads ``task``/``payload``/``latency_class``, asks ``Router.prepare`` for a ``RoutedRequest``,
does the BLS call (or hands a gateway request to ``gateway.GatewayClient``) and turns the outputs
into the ``result`` JSON with ``Router.triton_result`` / ``Router.gateway_result``.
Nothing here imports Triton, so it is unit-tested without a server.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

import numpy as np

from triton_pipelines.errors import InputError, as_bytes, decode_utf8
# The variant names the builder writes; STABLE_VERSION: the version every plain ensemble pins and
# the router serves by default (canary versions are 2, 3, ...).
from triton_pipelines.repository.contract import LATENCY_CLASSES, STABLE_VERSION, variant_name
from triton_pipelines.repository.routes import TIERS, RoutedRequest, RouteTable, TaskRoute, choose_model, cost_usd
from triton_pipelines.pipelines.router.canary import SplitFile, choose_version, split_point
from triton_pipelines.pipelines.router.payload import decode_base64, gateway_messages, number_field, parse_payload


class Router:
    def __init__(self, table: RouteTable, split_file: SplitFile | None = None):
        self.table = table
        self.split_file = split_file or SplitFile(None, table.canaries)

    def known_tasks(self) -> list[str]:
        return sorted(self.table.tasks)

    def prepare(self, task_raw: Any, payload_raw: Any, latency_class_raw: Any = None,
                key: str | None = None) -> RoutedRequest:
        """Validate one request and decide where it goes. Raises InputError with a clear message."""
        task = decode_utf8(task_raw, "input 'task'").strip()
        route = self.table.tasks.get(task)
        if route is None:
            raise InputError(f"unknown task {task!r}; known tasks: {', '.join(self.known_tasks())}")
        latency_class = "realtime"
        if latency_class_raw is not None:
            latency_class = decode_utf8(latency_class_raw, "input 'latency_class'").strip() or "realtime"
            if latency_class not in LATENCY_CLASSES:
                raise InputError(f"latency_class must be one of {', '.join(LATENCY_CLASSES)}, not {latency_class!r}")
        raw = as_bytes(payload_raw)
        if len(raw) > self.table.max_payload_bytes:
            raise InputError(f"payload is {len(raw)} bytes; the limit is {self.table.max_payload_bytes} bytes")
        payload = parse_payload(raw)
        user = payload.get("user")
        if user is not None and not isinstance(user, str):
            raise InputError("payload field 'user' must be a string")
        key = user or key
        if route.route == "triton":
            return self._prepare_triton(route, payload, latency_class, key)
        return self._prepare_gateway(route, payload, latency_class)

    def _prepare_triton(self, route: TaskRoute, payload: dict, latency_class: str, key: str | None) -> RoutedRequest:
        inputs = {}
        for name, encoding in route.inputs.items():
            if name not in payload:
                raise InputError(f"task {route.task} needs payload field '{name}' "
                                 f"({'a string' if encoding == 'text' else 'base64-encoded bytes'})")
            value = payload[name]
            if not isinstance(value, str):
                raise InputError(f"payload field '{name}' must be a string, not {type(value).__name__}")
            data = value.encode() if encoding == "text" else decode_base64(value, name)
            inputs[name] = np.array([[data]], dtype=np.object_)
        version = None
        if route.canary:
            version = choose_version(self.split_file.split(route.canary), split_point(route.task, key))
        return RoutedRequest(route.task, "triton", latency_class, variant_name(route.model, latency_class, version),
                             route.model, model_version=version, canary=route.canary, inputs=inputs,
                             outputs=route.outputs, realtime_target=variant_name(route.model, version=version))

    @staticmethod
    def fallback(routed: RoutedRequest) -> RoutedRequest | None:
        """The same request for a model more likely to be loaded, when ``routed.target`` is not; None
        when there is none left. First the realtime model of a ``_batch`` variant (an ensemble with
        no compute step of its own has none), then the stable version of a canary version (a canary
        unloaded, or never loaded, costs its share of the traffic nothing)."""
        if routed.target != routed.realtime_target:
            return dataclasses.replace(routed, target=routed.realtime_target, latency_class="realtime",
                                       note=f"{routed.target} is not loaded: served by the realtime model")
        if routed.canary and routed.model_version not in (None, STABLE_VERSION):
            stable = variant_name(routed.model)
            return dataclasses.replace(routed, target=stable, realtime_target=stable, model_version=STABLE_VERSION,
                                       note=f"{routed.target} is not loaded: served by the stable version "
                                            f"({stable}, {routed.canary} version {STABLE_VERSION})")
        return None

    def _prepare_gateway(self, route: TaskRoute, payload: dict, latency_class: str) -> RoutedRequest:
        messages = gateway_messages(payload)
        tier = payload.get("tier")
        if tier is not None and tier not in TIERS:
            raise InputError(f"payload field 'tier' must be one of {', '.join(TIERS)}, not {tier!r}")
        settings = self.table.gateway
        temperature = number_field(payload, "temperature", float, 0.0, 2.0)
        max_tokens = number_field(payload, "max_tokens", int, 1, settings.max_tokens_limit) or settings.default_max_tokens
        model = choose_model(route, self.table.prices, tier)
        return RoutedRequest(route.task, "gateway", latency_class, model, model, messages=messages,
                             temperature=temperature, max_tokens=max_tokens, tier=tier)

    # ------------------------------------------------------------------------------- results
    def triton_result(self, routed: RoutedRequest, outputs: Mapping[str, np.ndarray]) -> dict:
        result = {
            "task": routed.task, "route": "triton", "model": routed.model,
            "model_version": str(routed.model_version or STABLE_VERSION),
            "served_by": routed.target, "latency_class": routed.latency_class,
            "output": {name: tensor_to_json(outputs[name]) for name in routed.outputs},
            "usage": {},
        }
        if routed.canary:
            result["canary"] = {"model": routed.canary, "version": routed.model_version}
        if routed.note:
            result["note"] = routed.note
        return result

    def gateway_result(self, routed: RoutedRequest, text: str, input_tokens: int, output_tokens: int) -> dict:
        price = self.table.prices[routed.target]
        return {
            "task": routed.task, "route": "gateway", "model": routed.target, "model_version": None,
            "tier": routed.tier, "latency_class": routed.latency_class,
            "output": {"text": text},
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                      "cost_usd": cost_usd(price, input_tokens, output_tokens)},
        }


def tensor_to_json(array: np.ndarray) -> Any:
    """One request row of an output tensor as JSON: strings for BYTES, numbers otherwise; a
    single-element row becomes a scalar, e.g. ``label`` [1] → ``"refund"``, ``embedding`` → list."""
    row = array[0] if array.ndim > 0 and array.shape[0] == 1 else array
    if array.dtype == np.object_ or array.dtype.kind in "SU":
        converted = np.vectorize(lambda v: v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v),
                                 otypes=[object])(row) if np.size(row) else np.asarray(row, dtype=object)
        values = converted.tolist() if isinstance(converted, np.ndarray) else converted
    else:
        values = np.asarray(row).tolist()
    if isinstance(values, list) and len(values) == 1 and not isinstance(values[0], list):
        return values[0]
    return values


def json_bytes(document: Mapping) -> bytes:
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()
