"""OpenTelemetry tracing for every process of the server, by the standard variables, read once.

- ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, the full URL): OTLP
  over HTTP/protobuf to ``<endpoint>/v1/traces``. Unset: no tracer, no exporter, nothing exported;
  every span site checks ``enabled()`` (one global read) before doing anything else.
- ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``: default ``parentbased_traceidratio`` at
  ``DEFAULT_SAMPLE_RATIO``: a client's sampled ``traceparent`` is always traced, an unsampled one
  never, and requests without one at the ratio. Only the front decides (the screen, the /v1
  frontend): tritonserver traces exactly the requests whose context the front passes it
  (``triton_flags``: ``rate=0``), the stubs follow the context Triton hands them.
- ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``: the resource of every process, tritonserver's
  included; ``names.PROCESS`` says which process a span came from.
- ``OTEL_BSP_*``: the batch span processor's queue (bounded: a receiver that is down or slow drops
  spans, never holds a request) and schedule.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping
from urllib.parse import unquote

from triton_pipelines.telemetry import names
from triton_pipelines.telemetry.context import (TRACEPARENT, TRACESTATE, clean_tracestate, format_traceparent,
                                                parse_traceparent)

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
SAMPLER_ENV, SAMPLER_ARG_ENV = "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"
SERVICE_NAME_ENV, RESOURCE_ENV = "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"
DEFAULT_SERVICE_NAME = "triton-pipelines"
DEFAULT_SAMPLER = "parentbased_traceidratio"
# The share of requests without a client traceparent that are traced (benchmarks/: its cost).
DEFAULT_SAMPLE_RATIO = 0.1
SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
            "parentbased_traceidratio")
EXPORT_TIMEOUT_S = 5.0  # one export's HTTP timeout (on the exporter's thread, never a request's)
FLUSH_AT_EXIT_S = 2.0  # what a stopping process waits for its last spans


@dataclass(frozen=True)
class TraceSettings:
    traces_url: str
    sampler: str
    ratio: float
    service_name: str
    resource: tuple[tuple[str, str], ...]  # OTEL_RESOURCE_ATTRIBUTES, in order

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> "TraceSettings | None":
        """None when no endpoint is set (tracing off). ValueError, naming the variable, for a bad value."""
        environ = os.environ if environ is None else environ
        url = environ.get(TRACES_ENDPOINT_ENV, "").strip()
        if not url:
            base = environ.get(ENDPOINT_ENV, "").strip()
            if not base:
                return None
            url = base.rstrip("/") + "/v1/traces"
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{ENDPOINT_ENV}: {url!r} is not an http:// or https:// URL (OTLP over HTTP)")
        sampler = (environ.get(SAMPLER_ENV) or DEFAULT_SAMPLER).strip().lower()
        if sampler not in SAMPLERS:
            raise ValueError(f"{SAMPLER_ENV}={sampler!r}: choose among {', '.join(SAMPLERS)}")
        argument = environ.get(SAMPLER_ARG_ENV, "").strip()
        try:
            ratio = float(argument) if argument else DEFAULT_SAMPLE_RATIO
        except ValueError:
            raise ValueError(f"{SAMPLER_ARG_ENV}={argument!r} is not a ratio between 0 and 1") from None
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{SAMPLER_ARG_ENV}={argument!r} is not a ratio between 0 and 1")
        resource = []
        for item in environ.get(RESOURCE_ENV, "").split(","):
            key, sep, value = item.partition("=")
            if sep and key.strip():
                resource.append((key.strip(), unquote(value.strip())))
        service = (environ.get(SERVICE_NAME_ENV, "").strip() or dict(resource).get("service.name")
                   or DEFAULT_SERVICE_NAME)
        return cls(url, sampler, ratio, service, tuple(resource))

    def triton_flags(self) -> list[str]:
        """tritonserver's OpenTelemetry mode: it traces only the requests whose context the front
        passes (``rate=0``: Triton traces every request with a propagated context, whatever its rate,
        and no other), with its timestamps, to the same receiver, under the same resource."""
        settings = ["mode=opentelemetry", "level=TIMESTAMPS", "rate=0", "count=-1",
                    f"opentelemetry,url={self.traces_url}", f"opentelemetry,resource=service.name={self.service_name}",
                    f"opentelemetry,resource={names.PROCESS}=tritonserver"]
        settings += [f"opentelemetry,resource={key}={value}" for key, value in self.resource
                     if key not in ("service.name", names.PROCESS)]
        return [f"--trace-config={setting}" for setting in settings]


class _State:
    checked = False
    tracer = None
    lock = threading.Lock()


def enabled() -> bool:
    """Whether this process traces (the first call reads the environment; later ones one global)."""
    return (_State.tracer if _State.checked else _setup()) is not None


def _setup():
    with _State.lock:
        if _State.checked:
            return _State.tracer
        try:
            settings = TraceSettings.from_environment()
            _State.tracer = None if settings is None else _tracer(settings, _process_name())
        except Exception as error:  # noqa: BLE001 - tracing never stops a process: it is off, and says why
            print(f"[tracing] off: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            _State.tracer = None
        _State.checked = True
        return _State.tracer


def _process_name() -> str:
    """stub, screen, frontend (``python -m triton_pipelines <command>`` names its argv[0] so), or the program."""
    if "triton_python_backend_utils" in sys.modules:
        return "stub"
    words = (sys.argv[0] if sys.argv and sys.argv[0] else "python").split()
    return os.path.basename(words[-1])


def _tracer(settings: TraceSettings, process: str):
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace import sampling
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    ratio = settings.ratio
    sampler = {"always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF,
               "traceidratio": sampling.TraceIdRatioBased(ratio),
               "parentbased_always_on": sampling.ParentBased(sampling.ALWAYS_ON),
               "parentbased_always_off": sampling.ParentBased(sampling.ALWAYS_OFF),
               "parentbased_traceidratio": sampling.ParentBased(sampling.TraceIdRatioBased(ratio))}[settings.sampler]
    resource = Resource.create({**dict(settings.resource), "service.name": settings.service_name,
                                names.PROCESS: process})
    provider = TracerProvider(sampler=sampler, resource=resource, shutdown_on_exit=False)
    exporter = _QuietExporter(settings.traces_url)
    processor = BatchSpanProcessor(exporter)  # its queue and schedule: OTEL_BSP_* (bounded queue)
    provider.add_span_processor(processor)
    atexit.register(_flush, processor, exporter)
    return provider.get_tracer("triton_pipelines")


def _flush(processor, exporter) -> None:
    try:
        processor.force_flush(int(FLUSH_AT_EXIT_S * 1000))
    finally:
        exporter.shutdown()


class _QuietExporter:
    """The OTLP/HTTP exporter, whose failures (a receiver down or slow) are one log line a minute
    instead of a traceback per batch; spans it cannot send are dropped."""

    def __init__(self, url: str):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.inner = OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S)
        self.inner._MAX_RETRY_TIMEOUT = 4  # retries of a 5xx answer: a few seconds, then dropped
        self.failure, self.url, self.said = SpanExportResult.FAILURE, url, 0.0

    def export(self, spans):
        try:
            return self.inner.export(spans)
        except Exception as error:  # noqa: BLE001 - the receiver's trouble, not the request's
            if time.monotonic() - self.said > 60:
                self.said = time.monotonic()
                print(f"[tracing] cannot export to {self.url}: {type(error).__name__}; spans are dropped "
                      f"until it answers", file=sys.stderr, flush=True)
            return self.failure

    def shutdown(self):
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


# ----------------------------------------------------------------------------- contexts
def remote_context(traceparent, tracestate=None):
    """An OpenTelemetry context whose parent is the checked ``traceparent`` (and ``tracestate``,
    dropped alone when bad); None (a new trace) when there is none or it is not well formed."""
    parent = parse_traceparent(traceparent)
    if parent is None:
        return None
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    state = clean_tracestate(tracestate) if tracestate is not None else None
    span_context = SpanContext(int(parent.trace_id, 16), int(parent.span_id, 16), is_remote=True,
                               trace_flags=TraceFlags(TraceFlags.SAMPLED if parent.sampled else TraceFlags.DEFAULT),
                               trace_state=TraceState.from_header([state]) if state else None)
    return trace.set_span_in_context(NonRecordingSpan(span_context))


def propagation_headers(span=None) -> list[tuple[str, str]]:
    """``traceparent`` (and ``tracestate``) naming ``span`` (default: the current one) as the parent,
    for the next hop; none for a span that is not sampled (so that hop does not trace it either)."""
    if span is None:
        from opentelemetry import trace

        span = trace.get_current_span()
    context = span.get_span_context()
    if not context.is_valid or not context.trace_flags.sampled:
        return []
    headers = [(TRACEPARENT, format_traceparent(f"{context.trace_id:032x}", f"{context.span_id:016x}", True))]
    if context.trace_state:
        headers.append((TRACESTATE, context.trace_state.to_header()))
    return headers


def trace_id(span=None) -> str | None:
    """The 32-hex-digit trace id of ``span`` (default: the current one); None when not tracing."""
    if not enabled():
        return None
    if span is None:
        from opentelemetry import trace

        span = trace.get_current_span()
    context = span.get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else None


@contextmanager
def span(name: str, parent=None, kind: str = "internal", attributes: Mapping | None = None,
         links=()) -> Iterator:
    """A span, current inside the block (so the spans started inside hang under it); None when not
    tracing. ``parent``: a context (``remote_context``), else the current one. An exception that
    leaves the block marks the span failed and is raised on."""
    if not enabled():
        yield None
        return
    from opentelemetry.trace import SpanKind

    with _State.tracer.start_as_current_span(name, context=parent, kind=getattr(SpanKind, kind.upper()),
                                             attributes=dict(attributes or {}), links=links,
                                             record_exception=False) as current:
        yield current


def start_span(name: str, parent=None, kind: str = "internal", attributes: Mapping | None = None):
    """A span that is not made current (ended by the caller: ``end``); None when not tracing."""
    if not enabled():
        return None
    from opentelemetry.trace import SpanKind

    return _State.tracer.start_span(name, context=parent, kind=getattr(SpanKind, kind.upper()),
                                    attributes=dict(attributes or {}))


def fail(span, error_type: str, message: str = "") -> None:
    """Mark ``span`` failed with ``error.type`` (and the message as its status description)."""
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute(names.ERROR_TYPE, error_type)
    span.set_status(Status(StatusCode.ERROR, message[:200] or error_type))


@contextmanager
def attached(context) -> Iterator:
    """``context`` (an OpenTelemetry context, or None: nothing) current inside the block."""
    if context is None:
        yield
        return
    from opentelemetry import context as otel_context

    token = otel_context.attach(context)
    try:
        yield
    finally:
        otel_context.detach(token)
