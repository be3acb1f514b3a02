"""Spans from inside a Python stub, under the span Triton gave the request.

Triton 2.51 in OpenTelemetry mode hands each traced request's context to its model: ``request.trace()``
is the request's ``InferenceTrace`` and ``get_context()`` its W3C context as JSON
(``{"traceparent": ...}``), whose parent is that model's span in Triton. A stub's span per request
(``StubSpans``: its own work, tokenizer, image decode, audio features) hangs there. A BLS request
joins the caller's trace only if it is given ``trace=request.trace()``; Triton does not pass it on by
itself. ``bls_trace()`` is that trace for the request being served (a ``ContextVar``, set here for
the execute), and every BLS call gets a span of its own (``bls_span``). A request served after its
``execute`` returned (the router's, decoupled) cannot lend its trace: ``request_span``.

A BLS call made for a batch of requests (whisper_decode decodes a group's windows together) belongs to
every request of the batch: it is traced in the first traced request's trace, and the batch's size
says so (``triton.batch_size``). Nothing here runs when tracing is off (``tracing.enabled()``)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Sequence

from triton_pipelines.telemetry import names, tracing

# The model this stub serves (set from initialize's args: model_args.model_parameters).
MODEL = {"name": "python_model"}
_BLS_TRACE: ContextVar = ContextVar("bls_trace", default=None)


def triton_context(request):
    """The OpenTelemetry context Triton gave ``request`` (None when the request is not traced)."""
    try:
        text = request.trace().get_context()
    except Exception:  # noqa: BLE001 - a stub without trace support: untraced
        return None
    if not text:
        return None
    try:
        carrier = json.loads(text)
    except ValueError:
        return None
    return tracing.remote_context(carrier.get("traceparent"), carrier.get("tracestate"))


def bls_trace():
    """The ``trace=`` for a BLS request made for the request being served (None: untraced)."""
    return _BLS_TRACE.get()


class StubSpans:
    """One span per traced request of an execute (``begin``), the first traced one current for the
    execute's BLS calls; ``end(responses)`` marks each by its response and ends them."""

    def __init__(self, requests: Sequence):
        self.spans, self.token, self.context_token = [], None, None
        first = None
        for index, request in enumerate(requests):
            parent = triton_context(request)
            if parent is None:
                continue
            span = tracing.start_span(names.STUB_SPAN.format(model=MODEL["name"]), parent, "internal",
                                      {names.MODEL: MODEL["name"], names.BATCH_SIZE: len(requests)})
            self.spans.append((index, span))
            if first is None:
                first = (request, span)
        if first is not None:
            from opentelemetry import context as otel_context, trace

            self.token = _BLS_TRACE.set(first[0].trace())
            self.context_token = otel_context.attach(trace.set_span_in_context(first[1]))

    def end(self, responses: Sequence) -> None:
        if self.context_token is not None:
            from opentelemetry import context as otel_context

            otel_context.detach(self.context_token)
            _BLS_TRACE.reset(self.token)
        for index, span in self.spans:
            response = responses[index] if index < len(responses) else None
            if response is not None and response.has_error():
                tracing.fail(span, "error", response.error().message())
            span.end()


def begin(requests: Sequence) -> StubSpans | None:
    """The execute's spans; None when this process does not trace."""
    return StubSpans(requests) if tracing.enabled() else None


@contextmanager
def request_span(request, attributes: dict | None = None) -> Iterator:
    """A span for one request handled on its own, after ``execute`` returned (the router's task):
    under Triton's span for it, current inside the block; None when it is not traced.

    Its BLS calls get spans of their own but not ``trace=request.trace()``: the Python backend has
    released a decoupled model's requests once ``execute`` returned, and tritonserver 2.51 crashes
    (SIGSEGV in TRITONSERVER_ServerInferAsync) on a BLS request given such a request's trace. The
    callee then runs untraced by Triton (its own spans are not in the trace; the BLS span times it)."""
    parent = triton_context(request) if tracing.enabled() else None
    if parent is None:
        yield None
        return
    with tracing.span(names.STUB_SPAN.format(model=MODEL["name"]), parent, "internal",
                      {names.MODEL: MODEL["name"], **(attributes or {})}) as span:
        yield span


@contextmanager
def bls_span(target: str) -> Iterator:
    """One BLS call's span (under the current one); None when untraced."""
    if not tracing.enabled() or not _recording():
        yield None
        return
    with tracing.span(names.BLS_SPAN.format(model=target), attributes={names.MODEL: target}) as span:
        yield span


def _recording() -> bool:
    from opentelemetry import trace

    return trace.get_current_span().is_recording()
