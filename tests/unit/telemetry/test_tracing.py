"""Tracing's settings from the standard OTEL_* variables, tritonserver's flags from them, and the
spans a process makes (into the SDK's in-memory exporter: what the OTLP exporter would send)."""

from __future__ import annotations

import pytest

from triton_pipelines.telemetry import names, tracing
from triton_pipelines.telemetry.front import NO_TRACE, ScreenTrace
from triton_pipelines.telemetry.tracing import DEFAULT_SAMPLE_RATIO, DEFAULT_SAMPLER, TraceSettings

CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_no_endpoint_means_no_tracing():
    assert TraceSettings.from_environment({}) is None
    assert TraceSettings.from_environment({"OTEL_TRACES_SAMPLER": "always_on"}) is None


def test_settings_follow_the_standard_variables():
    settings = TraceSettings.from_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"})
    assert settings.traces_url == "http://collector:4318/v1/traces"
    assert (settings.sampler, settings.ratio, settings.service_name) == (DEFAULT_SAMPLER, DEFAULT_SAMPLE_RATIO,
                                                                          tracing.DEFAULT_SERVICE_NAME)
    settings = TraceSettings.from_environment({
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://jaeger:4318/v1/traces", "OTEL_TRACES_SAMPLER": "traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
        "OTEL_RESOURCE_ATTRIBUTES": "service.name=inference,deployment.environment=prod%20eu"})
    assert settings.traces_url == "http://jaeger:4318/v1/traces"
    assert (settings.sampler, settings.ratio, settings.service_name) == ("traceidratio", 0.25, "inference")
    assert ("deployment.environment", "prod eu") in settings.resource
    named = TraceSettings.from_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SERVICE_NAME": "svc",
                                            "OTEL_RESOURCE_ATTRIBUTES": "service.name=other"})
    assert named.service_name == "svc"


@pytest.mark.parametrize("environ, message", [
    ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
    ({"OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG"),
    ({"OTEL_TRACES_SAMPLER_ARG": "1.5"}, "OTEL_TRACES_SAMPLER_ARG"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
])
def test_a_bad_value_is_named(environ, message):
    with pytest.raises(ValueError, match=message):
        TraceSettings.from_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", **environ})


def test_tritonserver_traces_what_the_front_passes_it_to_the_same_receiver():
    settings = TraceSettings.from_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                                               "OTEL_SERVICE_NAME": "svc",
                                               "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod"})
    flags = settings.triton_flags()
    for expected in ("mode=opentelemetry", "rate=0", "level=TIMESTAMPS", "count=-1",
                     "opentelemetry,url=http://c:4318/v1/traces", "opentelemetry,resource=service.name=svc",
                     f"opentelemetry,resource={names.PROCESS}=tritonserver",
                     "opentelemetry,resource=deployment.environment=prod"):
        assert f"--trace-config={expected}" in flags


@pytest.fixture
def exported(monkeypatch):
    """This process traced into an in-memory exporter, sampler as the variables say."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    def install(environ):
        settings = TraceSettings.from_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", **environ})
        real = tracing._tracer(settings, "test")  # the sampler and resource as a process would have them
        provider = TracerProvider(sampler=real.sampler, resource=real.resource)
        memory = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(memory))
        monkeypatch.setattr(tracing._State, "checked", True)
        monkeypatch.setattr(tracing._State, "tracer", provider.get_tracer("test"))
        return memory
    yield install


def test_off_a_span_is_nothing(monkeypatch):
    monkeypatch.setattr(tracing._State, "checked", True)
    monkeypatch.setattr(tracing._State, "tracer", None)
    from triton_pipelines.telemetry.front import screen_trace

    assert screen_trace("http", "m", CLIENT) is NO_TRACE
    assert NO_TRACE.http_answer(b"HTTP/1.1 200 OK\r\n\r\n") == b"HTTP/1.1 200 OK\r\n\r\n"
    with tracing.span("x") as span:
        assert span is None
    assert tracing.trace_id() is None


def test_a_client_context_is_honoured_and_replaced_by_the_fronts_own(exported):
    memory = exported({"OTEL_TRACES_SAMPLER_ARG": "0"})
    from triton_pipelines.telemetry.front import screen_trace

    traced = screen_trace("http", "text_embedding", CLIENT.encode(), b"vendor=1")
    assert isinstance(traced, ScreenTrace) and traced.trace_id == "0af7651916cd43dd8448eb211c80319c"
    forwarded = dict(traced.headers)
    assert forwarded["traceparent"] != CLIENT and forwarded["traceparent"].startswith(
        "00-0af7651916cd43dd8448eb211c80319c-") and forwarded["tracestate"] == "vendor=1"
    answer = traced.http_answer(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    assert b"\r\nx-trace-id: 0af7651916cd43dd8448eb211c80319c\r\n" in answer
    (span,) = memory.get_finished_spans()
    assert span.parent.span_id == 0xb7ad6b7169203331 and span.attributes[names.HTTP_STATUS] == 400
    assert forwarded["traceparent"].split("-")[2] == f"{span.context.span_id:016x}"


def test_sampling_ratio_zero_traces_only_sampled_parents(exported):
    memory = exported({"OTEL_TRACES_SAMPLER_ARG": "0"})
    from triton_pipelines.telemetry.front import screen_trace

    for parent in (None, "garbage", CLIENT[:-2] + "00"):
        traced = screen_trace("grpc", "m", parent)
        assert traced.headers == []  # nothing for Triton to trace
        traced.end()
    assert memory.get_finished_spans() == ()
    screen_trace("grpc", "m", CLIENT).end()
    assert len(memory.get_finished_spans()) == 1


def test_a_hostile_traceparent_starts_a_new_trace(exported):
    memory = exported({"OTEL_TRACES_SAMPLER": "parentbased_always_on"})
    from triton_pipelines.telemetry.front import screen_trace

    traced = screen_trace("http", "m", "00-" + "a" * 5000, "x" * 100_000)
    assert "tracestate" not in dict(traced.headers)
    assert traced.trace_id != "a" * 32 and dict(traced.headers)["traceparent"].split("-")[1] == traced.trace_id
    traced.end()
    (span,) = memory.get_finished_spans()
    assert span.parent is None


def test_gateway_spans_carry_the_genai_attributes_and_never_the_secret(exported):
    memory = exported({"OTEL_TRACES_SAMPLER": "always_on"})
    from decimal import Decimal

    from triton_pipelines.telemetry.genai import gateway_answered, gateway_span

    with tracing.span("parent"):
        span = gateway_span("claude-sonnet-4.5", "team-a", "req-1", 200)
        gateway_answered(span, "gpt-4.1", 11, 7, Decimal("0.0001545"), "claude-sonnet-4.5", "rate_limited")
    gateway = next(s for s in memory.get_finished_spans() if s.name == "chat claude-sonnet-4.5")
    assert gateway.attributes[names.GEN_AI_REQUEST_MODEL] == "claude-sonnet-4.5"
    assert gateway.attributes[names.GEN_AI_RESPONSE_MODEL] == "gpt-4.1"
    assert (gateway.attributes[names.GEN_AI_INPUT_TOKENS], gateway.attributes[names.GEN_AI_OUTPUT_TOKENS]) == (11, 7)
    assert gateway.attributes[names.GATEWAY_COST_USD] == pytest.approx(0.0001545)
    assert gateway.attributes[names.GATEWAY_KEY_NAME] == "team-a"
    assert gateway.attributes[names.GATEWAY_FALLBACK_REASON] == "rate_limited"
    parent = next(s for s in memory.get_finished_spans() if s.name == "parent")
    assert gateway.parent.span_id == parent.context.span_id
