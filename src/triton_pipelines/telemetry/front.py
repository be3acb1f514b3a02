"""The front's span of one inference request (the request screen's, HTTP and gRPC): the client's
``traceparent`` checked and honoured (or a trace started), the span's own context passed on to
Triton, so that tritonserver's spans hang under it, and the trace id handed back to the client
(``x-trace-id``). The client's own ``traceparent``/``tracestate`` never reach Triton as they came.
Off (no endpoint), ``screen_trace`` returns ``NO_TRACE``, which adds nothing and costs one call."""

from __future__ import annotations

from triton_pipelines.telemetry import names, tracing
from triton_pipelines.telemetry.context import TRACE_ID_HEADER, TRACEPARENT, TRACESTATE

# What the front strips from what it forwards, always: only its own context goes on.
TRACE_HEADERS = frozenset({TRACEPARENT, TRACESTATE})
_TRACE_ID_LINE = b"\r\n" + TRACE_ID_HEADER.encode() + b": "


class _NoTrace:
    trace_id = None

    def http_headers(self) -> list:
        return []

    def http_answer(self, answer: bytes) -> bytes:
        return answer

    def grpc_metadata(self, context=None) -> tuple:
        return ()

    def end(self, grpc_code: str | None = None) -> None:
        pass


NO_TRACE = _NoTrace()


class ScreenTrace(_NoTrace):
    """The screen's span of one request, started by ``screen_trace``, ended by ``http_answer`` or
    ``end`` (the first call counts)."""

    def __init__(self, span):
        self.span = span
        self.headers = tracing.propagation_headers(span)
        self.trace_id = f"{span.get_span_context().trace_id:032x}"
        self.ended = False

    def http_headers(self) -> list[tuple[bytes, bytes]]:
        return [(name.encode(), value.encode()) for name, value in self.headers]

    def http_answer(self, answer: bytes) -> bytes:
        """Triton's (or the screen's) HTTP answer with ``x-trace-id``; the span ends with its status."""
        try:
            status = int(answer[9:12])
        except ValueError:
            status = 0
        if not self.ended:
            self.ended = True
            self.span.set_attribute(names.HTTP_STATUS, status)
            if status >= 400 or status == 0:
                tracing.fail(self.span, str(status))
            self.span.end()
        return answer.replace(b"\r\n", _TRACE_ID_LINE + self.trace_id.encode() + b"\r\n", 1)

    def grpc_metadata(self, context=None) -> tuple:
        """The metadata that carries the span's context to Triton; ``context``: the caller's call,
        whose trailing metadata gets ``x-trace-id`` (kept when the call is aborted)."""
        if context is not None:
            context.set_trailing_metadata(((TRACE_ID_HEADER, self.trace_id),))
        return tuple(self.headers)

    def end(self, grpc_code: str | None = None) -> None:
        """End the span; ``grpc_code``: the failed call's status code name."""
        if self.ended:
            return
        self.ended = True
        self.span.set_attribute(names.GRPC_STATUS, grpc_code or "OK")
        if grpc_code and grpc_code != "OK":
            tracing.fail(self.span, grpc_code)
        self.span.end()


def screen_trace(protocol: str, model: str, traceparent=None, tracestate=None):
    """The screen's span for one request to ``model`` over ``protocol`` (http or grpc), child of
    the client's checked context, else a new trace; ``NO_TRACE`` when not tracing."""
    if not tracing.enabled():
        return NO_TRACE
    span = tracing.start_span(names.SCREEN_SPAN.format(model=model), tracing.remote_context(traceparent, tracestate),
                              "server", {names.MODEL: model, names.PROTOCOL: protocol})
    return ScreenTrace(span)


def metadata_value(metadata, name: str):
    """The first value of ``name`` in gRPC metadata (None when absent)."""
    return next((value for key, value in metadata if key == name), None)


class HttpServerSpan:
    """The /v1 frontend's span of one request (``FRONTEND_SPAN``), current while it is handled, so
    that the gateway's and Triton's calls hang under it; ``trace_id`` for the ``x-trace-id`` header."""

    def __init__(self, method: str, route: str, traceparent=None, tracestate=None):
        self.span = tracing.start_span(names.FRONTEND_SPAN.format(method=method, route=route),
                                       tracing.remote_context(traceparent, tracestate), "server",
                                       {names.HTTP_METHOD: method, names.HTTP_ROUTE: route})
        self.trace_id = f"{self.span.get_span_context().trace_id:032x}"

    def current(self):
        return tracing.attached(_context_of(self.span))

    def end(self, status: int) -> None:
        self.span.set_attribute(names.HTTP_STATUS, status)
        if status >= 500 or status == 499:
            tracing.fail(self.span, str(status))
        self.span.end()


def _context_of(span):
    from opentelemetry import trace

    return trace.set_span_in_context(span)
