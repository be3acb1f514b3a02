"""The span of one call to the external LLM gateway, with OpenTelemetry's GenAI attributes
(``gen_ai.request.model``, ``gen_ai.response.model``, ``gen_ai.usage.*``) and ours: the cost, the
key's name (never its secret), the ledger's request id, the fallback. A client span under the
current one (the /v1 frontend's request, or the router's); None when not tracing."""

from __future__ import annotations

from triton_pipelines.telemetry import names, tracing

GATEWAY_SYSTEM = "openai_compatible_gateway"  # gen_ai.system: the gateway speaks OpenAI's API


def gateway_span(model: str, key_name: str, request_id: str, max_tokens: int | None):
    if not tracing.enabled():
        return None
    attributes = {names.GEN_AI_OPERATION: "chat", names.GEN_AI_SYSTEM: GATEWAY_SYSTEM,
                  names.GEN_AI_REQUEST_MODEL: model, names.GATEWAY_KEY_NAME: key_name,
                  names.GATEWAY_REQUEST_ID: request_id}
    if max_tokens is not None:
        attributes[names.GEN_AI_MAX_TOKENS] = int(max_tokens)
    return tracing.start_span(names.GATEWAY_SPAN.format(model=model), None, "client", attributes)


def gateway_answered(span, model: str, input_tokens: int | None, output_tokens: int | None, cost_usd,
                     requested: str | None = None, fallback_reason: str | None = None) -> None:
    """End the span of a call that answered: the model, its usage and cost; ``requested``: the
    model asked for (a fallback when it is not ``model``)."""
    if span is None:
        return
    fallback_from = requested if requested and requested != model else None
    span.set_attribute(names.GEN_AI_RESPONSE_MODEL, model)
    if input_tokens is not None:
        span.set_attribute(names.GEN_AI_INPUT_TOKENS, int(input_tokens))
    if output_tokens is not None:
        span.set_attribute(names.GEN_AI_OUTPUT_TOKENS, int(output_tokens))
    if cost_usd is not None:
        span.set_attribute(names.GATEWAY_COST_USD, float(cost_usd))
    if fallback_from:
        span.set_attribute(names.GATEWAY_FALLBACK_FROM, fallback_from)
        span.set_attribute(names.GATEWAY_FALLBACK_REASON, fallback_reason or "unknown")
    span.set_attribute(names.GATEWAY_OUTCOME, "success")
    span.end()


def gateway_failed(span, reason: str, message: str = "") -> None:
    """End the span of a call that failed (``reason``: the gateway client's, e.g. rate_limited)."""
    if span is None:
        return
    span.set_attribute(names.GATEWAY_OUTCOME, reason)
    tracing.fail(span, reason, message)
    span.end()


def traced_stream(span, model: str, chunks):
    """A streamed call's chunks as they come; its span ends with the usage of the last (the relay's)."""
    return chunks if span is None else _traced_chunks(span, model, chunks)


async def _traced_chunks(span, model: str, chunks):
    usage = {}
    try:
        async for chunk in chunks:
            usage = chunk.get("usage") or usage
            yield chunk
    finally:
        await chunks.aclose()
        gateway_answered(span, model, usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("cost_usd"))
