"""The router's request handling, as plain asyncio (the ``router`` model is a thin adapter over it).

Every request is its own task: the model's ``execute`` starts one per request and returns at once,
and each task sends its own response (``RouterService.handle`` → ``Answer``). So a request never
waits for another: self-hosted requests do not queue behind slow gateway calls, and a request that
breaks (any exception) fails alone, as an INTERNAL error with a short message, its traceback in the
log.

Bounds: at most ``max_in_flight_triton`` self-hosted and ``gateway.max_in_flight`` gateway requests
at once; beyond them a request is refused at once (UNAVAILABLE, reason ``overloaded``). Each
routed request has one deadline (its task's ``deadline_s``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import traceback
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence

import numpy as np

from triton_pipelines.errors import InputError, RouteError, decode_utf8, error_kind, parse_refusal, refusal_text
from triton_pipelines.gateway.upstream import Completion, GatewayClient
from triton_pipelines.gateway.refusal import GatewayRefusal
from triton_pipelines.gateway.service import GatewayService
from triton_pipelines.limits import CLIENT_CANCEL_PARAMETER, CLIENT_DEADLINE_PARAMETER, client_deadline_value
from triton_pipelines.repository.routes import RoutedRequest
from triton_pipelines.pipelines.router.router import Router, json_bytes

@dataclass
class Answer:
    """One request's response: ``result`` ([rows, 1] BYTES) or a failure ``reason`` + ``message``."""
    result: np.ndarray | None = None
    reason: str = ""
    message: str = ""


class Recorder(Protocol):
    """Metrics sink (the Triton adapter implements it with custom metrics)."""

    def request(self, task: str, route: str, reason: str | None, latency_s: float | None,
                routed: RoutedRequest | None, completion: Completion | None, cost_usd: float) -> None: ...

    def circuit(self, model: str, open_: bool) -> None: ...

    def start_at_zero(self, tasks: Mapping[str, str], gateway_models: list[str]) -> None: ...


# BLS call: (target model, inputs, requested outputs, request parameters) → outputs; raises RouteError.
TritonCall = Callable[[str, Mapping[str, np.ndarray], Sequence[str], Mapping[str, str]],
                      Awaitable[dict[str, np.ndarray]]]


def forwarded_parameters(deadline_s: float, cancel_id: str | None, now_ns: int | None = None) -> dict[str, str]:
    """What a self-hosted task's BLS request carries for the models that run long (whisper_decode):
    the task's deadline (Triton 2.51 never stops a running ensemble step when its BLS caller gives
    up) and the router request's id on the screen's cancel board, when it has one."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    parameters = {CLIENT_DEADLINE_PARAMETER: client_deadline_value(deadline_s, now_ns)}
    if cancel_id:
        parameters[CLIENT_CANCEL_PARAMETER] = cancel_id
    return parameters


class RouterService:
    def __init__(self, router: Router, gateway: GatewayClient, call_triton: TritonCall, recorder: Recorder,
                 log_error: Callable[[str], None] = lambda message: None,
                 gateway_service: GatewayService | None = None):
        self.router = router
        self.gateway = gateway
        # keys, budgets, the spend ledger and fallbacks around the gateway client
        self.gateway_service = gateway_service or GatewayService(router.table, gateway)
        self.call_triton = call_triton
        self.recorder = recorder
        self.log_error = log_error
        self.in_flight = {"triton": 0, "gateway": 0}
        self.limits = {"triton": router.table.max_in_flight_triton, "gateway": router.table.gateway.max_in_flight}
        self.recorder.start_at_zero({task: route.route for task, route in router.table.tasks.items()},
                                    sorted(router.table.prices))

    async def refresh_circuits(self, every_s: float = 1.0) -> None:
        """Keep ``router_gateway_circuit_open`` true to the breakers between requests (an open
        circuit turns half-open by time alone)."""
        while True:
            for model, breaker in list(self.gateway.breakers.items()):
                self.recorder.circuit(model, breaker.state == "open")
            await asyncio.sleep(every_s)

    # ------------------------------------------------------------------------- one request
    async def handle(self, tasks: np.ndarray | None, payloads: np.ndarray | None, classes: np.ndarray | None,
                     request_id: str | None, key_id: str | None = None, cancel_id: str | None = None) -> Answer:
        """All rows of one request, concurrently; never raises. ``key_id``: the API key's id the
        request screen forwarded (``api_keys.KEY_ID_PARAMETER``), for gateway tasks; ``cancel_id``:
        the request's id on the cancel board (``limits.CLIENT_CANCEL_PARAMETER``), passed on."""
        try:
            rows = self._rows(tasks, payloads, classes)
        except InputError as error:
            self.recorder.request("unknown", "none", "invalid_input", None, None, None, 0.0)
            return Answer(reason="invalid_input", message=str(error))
        answers = await asyncio.gather(*(self.route_row(task, payload, latency_class, request_id, key_id, cancel_id)
                                         for task, payload, latency_class in rows))
        failed = [(reason, message) for reason, message in answers if reason]
        if failed:
            if len(answers) == 1:
                return Answer(reason=failed[0][0], message=failed[0][1])
            # The request fails as a whole (one response): with the most client-actionable code.
            reason = min((r for r, _ in failed), key=lambda r: ("invalid_input", "unavailable",
                                                                 "internal").index(error_kind(r)))
            refusals = [parse_refusal(message) for _, message in failed if parse_refusal(message)]
            text = "; ".join(f"row {i}: {parse_refusal(message)[2] if parse_refusal(message) else message}"
                             for i, (r, message) in enumerate(answers) if r)
            if refusals:  # the first refusal's status for the whole request
                reason = next(r for r, message in failed if parse_refusal(message))
                text = refusal_text(refusals[0][0], text, refusals[0][1])
            return Answer(reason=reason, message=text)
        return Answer(result=np.array([[message] for _, message in answers], dtype=np.object_))

    def _rows(self, tasks, payloads, classes) -> list[tuple[Any, Any, Any]]:
        if tasks is None or payloads is None:
            raise InputError("inputs 'task' and 'payload' are required")
        tasks, payloads = tasks.reshape(-1), payloads.reshape(-1)
        classes = classes.reshape(-1) if classes is not None else None
        if len(tasks) > self.router.table.max_rows_per_request:
            raise InputError(f"{len(tasks)} rows in one request; the limit is {self.router.table.max_rows_per_request}")
        if len(payloads) != len(tasks) or (classes is not None and len(classes) not in (1, len(tasks))):
            raise InputError("inputs 'task', 'payload' and 'latency_class' need the same batch size")
        return [(tasks[i], payloads[i], None if classes is None else classes[min(i, len(classes) - 1)])
                for i in range(len(tasks))]

    # ------------------------------------------------------------------------- one row
    async def route_row(self, task: Any, payload: Any, latency_class: Any, key: str | None,
                        key_id: str | None = None, cancel_id: str | None = None) -> tuple[str, Any]:
        """(\"\", result JSON bytes) or (failure reason, message). Records metrics; never raises."""
        routed = None
        started = time.monotonic()
        try:
            routed = self.router.prepare(task, payload, latency_class, key)
            result, completion, cost, routed = await self._serve(routed, key_id, cancel_id)
        except GatewayRefusal as refusal:
            self.recorder.request(routed.task, routed.route, refusal.reason, None, routed, None, 0.0)
            return refusal.reason, refusal.marked()
        except InputError as error:
            self.recorder.request(self._task_label(task), self._route_label(task), "invalid_input", None,
                                  None, None, 0.0)
            return "invalid_input", str(error)
        except RouteError as error:
            self.recorder.request(routed.task, routed.route, error.reason, time.monotonic() - started,
                                  routed, None, 0.0)
            self._note_circuit(routed)
            return error.reason, f"task {routed.task} ({routed.route}): {error}"
        except Exception as error:  # a bug must fail this row only; the trace goes to the log
            label = routed.task if routed else self._task_label(task)
            self.log_error(f"router: unexpected {type(error).__name__} serving task {label!r}: "
                           + "".join(traceback.format_exception(error)))
            self.recorder.request(label, routed.route if routed else self._route_label(task), "internal",
                                  None, routed, None, 0.0)
            return "internal", f"internal error in the router ({type(error).__name__}); it has been logged"
        self.recorder.request(routed.task, routed.route, None, time.monotonic() - started, routed, completion, cost)
        self._note_circuit(routed)
        return "", json_bytes(result)

    async def _serve(self, routed: RoutedRequest, key_id: str | None = None, cancel_id: str | None = None
                     ) -> tuple[dict, Completion | None, float, RoutedRequest]:
        """(result, completion, cost, the request as served: a fallback names the model that answered)."""
        kind = routed.route
        api_key = self.gateway_service.key_by_id(key_id) if kind == "gateway" else None
        if self.in_flight[kind] >= self.limits[kind]:
            raise RouteError("overloaded", f"the router has {self.in_flight[kind]} {kind} requests in flight "
                                           f"(its limit): retry later")
        self.in_flight[kind] += 1
        try:
            deadline = self.router.table.deadline_s(routed.task)
            if kind == "triton":
                try:
                    serving = self._serve_triton(routed, forwarded_parameters(deadline, cancel_id))
                    result, served = await asyncio.wait_for(serving, deadline)
                    return result, None, 0.0, served
                except asyncio.TimeoutError:
                    raise RouteError("timeout", f"no answer from {routed.target} within the task's deadline "
                                                f"of {deadline:g} s") from None
            answer = await self.gateway_service.acomplete(
                api_key, task=routed.task, model=routed.target, messages=routed.messages, max_tokens=routed.max_tokens,
                temperature=routed.temperature, deadline_s=deadline)
            served = dataclasses.replace(routed, target=answer.model, model=answer.model)
            result = self.router.gateway_result(served, answer.text, answer.input_tokens, answer.output_tokens)
            if answer.fallback_from:
                result["fallback"] = {"from": answer.fallback_from, "reason": answer.fallback_reason}
            completion = Completion(answer.text, answer.input_tokens, answer.output_tokens, len(answer.attempts))
            return result, completion, result["usage"]["cost_usd"], served
        finally:
            self.in_flight[kind] -= 1

    async def _serve_triton(self, routed: RoutedRequest, parameters: Mapping[str, str]
                            ) -> tuple[dict, RoutedRequest]:
        """(result, the request as served): a target that is not loaded falls back (``Router.fallback``)."""
        while True:
            try:
                outputs = await self.call_triton(routed.target, routed.inputs, routed.outputs, parameters)
                return self.router.triton_result(routed, outputs), routed
            except RouteError as error:
                fallback = self.router.fallback(routed) if error.reason == "not_loaded" else None
                if fallback is None:
                    raise
                routed = fallback  # the result and the metrics name what really served it

    def _note_circuit(self, routed: RoutedRequest) -> None:
        if routed.route == "gateway" and routed.target in self.gateway.breakers:
            self.recorder.circuit(routed.target, self.gateway.breakers[routed.target].state == "open")

    # ------------------------------------------------------------------------- labels
    def _task_label(self, task: Any) -> str:
        """The metric label of a task that failed validation: its name if known, else ``unknown``."""
        try:
            name = decode_utf8(task, "input 'task'").strip()
        except ValueError:  # InputError, or a str that does not encode
            return "unknown"
        return name if name in self.router.table.tasks else "unknown"

    def _route_label(self, task: Any) -> str:
        label = self._task_label(task)
        return self.router.table.tasks[label].route if label != "unknown" else "none"
