"""OpenTelemetry tracing: its settings from the standard OTEL_* variables, the W3C trace context
and the span names and attributes, once for every process (docs/operations.md, "Tracing")."""
