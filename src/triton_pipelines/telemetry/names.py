"""Every span name and attribute key our processes write, once (docs/operations.md, "Tracing").
Gateway calls follow OpenTelemetry's GenAI conventions (``gen_ai.*``); the rest are ours."""

from __future__ import annotations

# Span names.
SCREEN_SPAN = "screen {model}"  # the request screen, per inference request (HTTP or gRPC)
FRONTEND_SPAN = "{method} {route}"  # the /v1 frontend, per request (HTTP server span)
GATEWAY_SPAN = "chat {model}"  # one call to the external LLM gateway (GenAI: "{operation} {model}")
STUB_SPAN = "{model}"  # a Python stub's work on one request (tokenizer, image decode, audio features ...)
BLS_SPAN = "bls {model}"  # one BLS call from a stub (router, whisper_decode)

# Our attributes.
PROCESS = "triton_pipelines.process"  # resource: screen, frontend, stub (tritonserver sets its own)
MODEL = "triton.model"
PROTOCOL = "network.protocol.name"  # http or grpc
BATCH_SIZE = "triton.batch_size"  # requests in the stub's execute
HTTP_STATUS = "http.response.status_code"
HTTP_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
GRPC_STATUS = "rpc.grpc.status_code"
ROUTER_TASK = "router.task"
ROUTER_ROUTE = "router.route"  # self_hosted or gateway
ERROR_TYPE = "error.type"

# OpenTelemetry GenAI semantic conventions, and ours beside them for the gateway.
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GATEWAY_COST_USD = "gateway.cost_usd"
GATEWAY_KEY_NAME = "gateway.key_name"  # the key's name from the keys file, never its secret
GATEWAY_REQUEST_ID = "gateway.request_id"  # the spend ledger row's request_id
GATEWAY_FALLBACK_FROM = "gateway.fallback_from"
GATEWAY_FALLBACK_REASON = "gateway.fallback_reason"
GATEWAY_OUTCOME = "gateway.outcome"  # success, or the failure's reason (rate_limited, upstream_error ...)
