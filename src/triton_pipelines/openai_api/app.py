"""The ``/v1`` aiohttp application: its routes to the endpoint groups (``models.py``,
``embeddings.py``, ``audio.py``, ``chat.py``), ``GET /metrics`` and ``GET /health``, and the
middleware every ``/v1`` request passes: the bearer key (``$TRITON_API_KEYS_FILE``; the key found is
``request["api_key"]``), the errors as OpenAI error bodies, the request metrics."""

from __future__ import annotations

import asyncio
import sys
import time

from triton_pipelines.errors import OPENAI_METHOD_NOT_ALLOWED, OPENAI_NOT_FOUND
from triton_pipelines.front.nginx_config import CLIENT_ADDRESS_HEADER
from triton_pipelines.front.places import Places, byte_budget, bytes_overloaded_message
from triton_pipelines.gateway.keys import KeyRing, bearer_secret
from triton_pipelines.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_INFLIGHT_BYTES
from triton_pipelines.openai_api import protocol as proto
from triton_pipelines.openai_api.audio import ServingAudio
from triton_pipelines.openai_api.chat import ServingChat
from triton_pipelines.openai_api.embeddings import TRITON_TIMEOUT_S, ServingEmbeddings
from triton_pipelines.openai_api.metrics import Metrics
from triton_pipelines.openai_api.models import ServingModels
from triton_pipelines.openai_api.replies import error_reply, reply
from triton_pipelines.openai_api.triton_grpc import Triton
from triton_pipelines.openai_api.triton_http import TritonHttp
from triton_pipelines.telemetry import tracing
from triton_pipelines.telemetry.context import TRACE_ID_HEADER
from triton_pipelines.telemetry.front import HttpServerSpan

# /v1's own health through the public port, for probes: no key (docs/openai.md).
HEALTH_PATH = "/v1/health"


class Frontend:
    def __init__(self, triton: Triton, catalog: proto.ModelCatalog, keys: KeyRing | None, token_counter,
                 gateway=None, language_codes=(), triton_timeout_s: float = TRITON_TIMEOUT_S,
                 triton_http: TritonHttp | None = None, request_bytes: Places | None = None):
        self.catalog, self.keys = catalog, keys
        # The request bytes in flight through /v1 (by each body's Content-Length, before it is read;
        # nginx sends one with every body it forwards) and one client's share (nginx's address header).
        self.request_bytes = request_bytes or byte_budget(DEFAULT_MAX_INFLIGHT_BYTES, None, DEFAULT_MAX_BODY_BYTES)
        known = {row["id"] for row in catalog.entries()}
        self.metrics = Metrics(known)
        self.draining = False
        self.models = ServingModels(catalog)
        self.embeddings = ServingEmbeddings(triton, catalog, token_counter, triton_timeout_s, triton_http)
        self.audio = ServingAudio(triton, catalog, language_codes, self.metrics)
        self.chat = ServingChat(gateway, catalog, self.metrics)

    def app(self):
        from aiohttp import web

        app = web.Application(middlewares=[self.middleware], client_max_size=proto.MAX_JSON_BODY_BYTES)
        if tracing.enabled():
            app.on_response_prepare.append(trace_id_header)
        app.router.add_get("/v1/models", self.models.models)
        app.router.add_get("/v1/models/{model}", self.models.model)
        app.router.add_post("/v1/embeddings", self.embeddings.embeddings)
        app.router.add_post("/v1/audio/transcriptions", self.audio.transcriptions)
        app.router.add_post("/v1/audio/translations", self.audio.translations)
        app.router.add_post("/v1/chat/completions", self.chat.chat_completions)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/health", self.health)
        app.router.add_get(HEALTH_PATH, self.health)  # through the public port: is /v1 up (docs/openai.md)
        return app

    async def middleware(self, app, handler):
        from aiohttp import web

        async def handle(request):
            if not request.path.startswith("/v1") or request.path == HEALTH_PATH:
                return await handler(request)  # health is for probes: no key, not counted
            started = time.perf_counter()
            endpoint = request.path.split("?")[0]
            if request.match_info.route.resource is None or endpoint.startswith("/v1/models/"):
                endpoint = "/v1/models" if endpoint.startswith("/v1/models") else "other"
            request["model"] = None
            status = 500
            size, client = request.content_length or 0, request.headers.get(CLIENT_ADDRESS_HEADER, "")
            held = 0
            try:
                request["api_key"] = self.api_key(request.headers.get("Authorization"))
                if not self.request_bytes.try_take(client, size):
                    raise proto.unavailable(bytes_overloaded_message(self.request_bytes))
                held = size
                response = await handler(request)
                status = response.status
                return response
            except proto.OpenAIError as error:
                status = error.status
                return error_reply(error)
            except web.HTTPException as error:  # aiohttp's own: unknown path, wrong method, body too large
                status = error.status
                method_message, method_code = OPENAI_METHOD_NOT_ALLOWED
                kind = {404: OPENAI_NOT_FOUND, 405: (method_message.format(method=request.method), method_code),
                        413: ("the request body is too large", "request_too_large")}
                message, code = kind.get(error.status, (error.reason, None))
                return error_reply(proto.OpenAIError(error.status, message, "invalid_request_error", None, code))
            except asyncio.CancelledError:
                status = 499  # the client left (aiohttp cancels the handler)
                raise
            except ConnectionError:
                # The client left while its body was read or its answer written, before aiohttp
                # cancelled the handler: raised on, aiohttp would log it as a failed request with a
                # traceback (its handle_error); ended as aiohttp ends a disconnection, it is not logged.
                status = 499
                raise asyncio.CancelledError from None
            except Exception as error:  # noqa: BLE001 - a bug answers 500, the server lives
                status = 500
                print(f"[openai] {endpoint}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
                return error_reply(proto.internal(f"internal error ({type(error).__name__})"))
            finally:
                if held:
                    self.request_bytes.give_back(client, held)
                self.metrics.observe(endpoint, request.get("model"), status, time.perf_counter() - started)

        async def traced(request):
            """``handle`` inside the request's span (the client's traceparent honoured when well formed)."""
            if not request.path.startswith("/v1") or request.path == HEALTH_PATH:
                return await handle(request)
            route = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
            span = HttpServerSpan(request.method, route, request.headers.get("traceparent"),
                                  request.headers.get("tracestate"))
            request["trace_id"] = span.trace_id
            status = 499
            try:
                with span.current():
                    response = await handle(request)
                status = response.status
                return response
            finally:
                span.end(status)
        return traced if tracing.enabled() else handle

    def api_key(self, authorization: str | None):
        """The key of ``Authorization: Bearer <key>`` (None with keys off), or 401. A key is printable
        ASCII (gateway/keys.py); aiohttp reads other bytes of a header as lone surrogates, which no key
        holds (and which cannot be hashed as UTF-8)."""
        if self.keys is None:
            return None
        secret = bearer_secret(authorization)
        if secret is None:
            raise proto.unauthorized("You didn't provide an API key: send 'Authorization: Bearer <key>'")
        if not (secret.isascii() and secret.isprintable()):
            raise proto.unauthorized("Incorrect API key provided: an API key is printable ASCII, and the "
                                     "Authorization header holds other bytes.")
        key = self.keys.lookup(secret)
        if key is None:
            raise proto.unauthorized("Incorrect API key provided.")
        return key

    async def metrics_page(self, request):
        return reply(self.metrics.render(), content_type="text/plain")

    async def health(self, request):
        return reply({"status": "draining" if self.draining else "ok"}, 503 if self.draining else 200)


async def trace_id_header(request, response) -> None:
    """Every /v1 answer names its trace (``x-trace-id``), streamed ones included (before their headers go)."""
    if request.get("trace_id"):
        response.headers[TRACE_ID_HEADER] = request["trace_id"]
