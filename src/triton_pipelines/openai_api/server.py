"""The OpenAI-compatible frontend: ``/v1`` on the public HTTP port (nginx routes ``/v1/`` here).

    python -m triton_pipelines frontend --port P --triton-grpc 127.0.0.1:G [--triton-grpc ...] \\
        --model-repository model_repository

One aiohttp process, started, supervised, restarted and drained by the launcher
(``openai_process.FrontendProcess``). It talks to Triton over each replica's loopback gRPC port
with ``tritonclient.grpc.aio`` (round robin, a refused replica skipped), through Triton's own
batching: ``/v1/embeddings`` sends at most the pipeline's max batch (64) strings per request, so a
list of 64 strings is one ``text_embedding`` request. Audio goes to ``speech_recognition_stream``
(decoupled, gRPC ModelStreamInfer): its partial transcripts become the SSE ``transcript.text.delta``
events; without ``stream`` only its final response is asked for. Chat goes through
``gateway_service.GatewayService`` on this process's event loop (``acomplete``/``astream``), as the
native router's gateway tasks do: the key's model allow-list, budget, rpm and tpm, fallbacks,
cooldowns and the spend ledger (``$SPEND_DATABASE_URL``, which the launcher sets to the ledger the
replicas' routers use, so both paths spend one budget).

What a request may be and what it gets back is ``openai_protocol.py``; this module only moves bytes.
Keys (``$TRITON_API_KEYS_FILE``, ``api_keys.py``; the gateway service's key ring): every ``/v1``
request needs a known bearer key when the file is set; the key found is ``request["api_key"]``.
Keys never reach logs, metrics, responses or the ledger (a hash and the name).
Metrics (``GET /metrics`` on the loopback port; the launcher appends them to the public
``:8002/metrics``): ``openai_requests_total``, ``openai_request_duration_seconds``,
``openai_streamed_responses_total``, ``openai_stream_disconnects_total``; chat's gateway figures
``openai_spend_usd_total``, ``openai_budget_remaining_usd``, ``openai_fallbacks_total``,
``openai_cooldowns_total``, ``openai_refusals_total`` (the router's are ``router_*``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from urllib.parse import quote

import numpy as np

from triton_pipelines.limits import REQUEST_TIMEOUT_S, TEXT_MAX_BATCH
from triton_pipelines.openai_api import protocol as proto
from triton_pipelines.gateway.keys import KeyRing, bearer_secret, keys_from_environment
from triton_pipelines.errors import InputError, RouteError
from triton_pipelines.gateway.service import GatewayRefusal
from triton_pipelines.repository.contract import BuiltManifest
from triton_pipelines.prometheus_text import family

from triton_pipelines.front.screen import restarting_model_message
from triton_pipelines.front.screen_server import Upstream, read_body, read_head

GATEWAY_ERRORS = (GatewayRefusal, RouteError, InputError)  # what GatewayService raises for a request
# /v1/embeddings inputs of at most this many bytes (together) are token-counted on the event loop (~50 µs
# for a sentence, ~0.2 ms at this size on the 2-core machine); longer ones in the thread pool, so that
# one large request does not hold up the others (a hop costs ~0.12 ms of CPU).
INLINE_TOKENS_BYTES = 512
STREAM_MODEL = "speech_recognition_stream"
TRITON_TIMEOUT_S = 60.0
SPEECH_TIMEOUT_S = REQUEST_TIMEOUT_S
CHAT_IN_FLIGHT = 64  # chat completions in flight on this process; more: 429
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics:
    """Counters by endpoint, model (a known name or "other") and status; latency histogram."""

    def __init__(self, known_models: set[str]):
        self.known = known_models
        self.lock = threading.Lock()
        self.requests: Counter = Counter()
        self.streams: Counter = Counter()
        self.disconnects: Counter = Counter()
        self.buckets: dict[tuple[str, str], list[int]] = {}
        self.sums: Counter = Counter()
        # GatewayService's spend recorder (gateway_service.SpendRecorder): /v1 chat's share
        self.spent: Counter = Counter()
        self.fallbacks: Counter = Counter()
        self.cooldowns: Counter = Counter()
        self.refusals: Counter = Counter()
        self.budgets: dict[str, float] = {}
        self.window_spend: dict[str, float] = {}
        self.soft_budgets: dict[str, float] = {}

    def spend(self, key_name: str, model: str, cost_usd: float) -> None:
        with self.lock:
            self.spent[(key_name, model)] += cost_usd

    def budget(self, key_name: str, remaining_usd: float | None, window_spend_usd: float,
               soft_budget_usd: float | None) -> None:
        with self.lock:
            if remaining_usd is not None:
                self.budgets[key_name] = remaining_usd
            self.window_spend[key_name] = window_spend_usd
            if soft_budget_usd is not None:
                self.soft_budgets[key_name] = soft_budget_usd

    def fallback(self, from_model: str, to_model: str, reason: str) -> None:
        with self.lock:
            self.fallbacks[(from_model, to_model, reason)] += 1

    def cooldown(self, model: str) -> None:
        with self.lock:
            self.cooldowns[model] += 1

    def refusal(self, key_name: str, reason: str) -> None:
        with self.lock:
            self.refusals[(key_name, reason)] += 1

    def model_label(self, model) -> str:
        return model if isinstance(model, str) and model in self.known else ("" if model is None else "other")

    def observe(self, endpoint: str, model, status: int, seconds: float) -> None:
        label = self.model_label(model)
        with self.lock:
            self.requests[(endpoint, label, str(status))] += 1
            counts = self.buckets.setdefault((endpoint, label), [0] * (len(LATENCY_BUCKETS) + 1))
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    counts[i] += 1
            counts[-1] += 1
            self.sums[(endpoint, label)] += seconds

    def streamed(self, endpoint: str, model, disconnected: bool = False) -> None:
        with self.lock:
            (self.disconnects if disconnected else self.streams)[(endpoint, self.model_label(model))] += 1

    def render(self) -> str:
        with self.lock:
            lines = family("openai_requests_total", "counter", "/v1 requests of the OpenAI-compatible frontend by "
                           "endpoint, model and HTTP status", ("endpoint", "model", "code"), self.requests)
            lines += ["# HELP openai_request_duration_seconds time to the last byte of a /v1 response",
                      "# TYPE openai_request_duration_seconds histogram"]
            for (e, m), counts in sorted(self.buckets.items()):
                for bound, count in zip(LATENCY_BUCKETS, counts):
                    lines.append(f'openai_request_duration_seconds_bucket{{endpoint="{e}",model="{m}",le="{bound}"}} {count}')
                lines.append(f'openai_request_duration_seconds_bucket{{endpoint="{e}",model="{m}",le="+Inf"}} {counts[-1]}')
                lines.append(f'openai_request_duration_seconds_sum{{endpoint="{e}",model="{m}"}} {self.sums[(e, m)]:.6f}')
                lines.append(f'openai_request_duration_seconds_count{{endpoint="{e}",model="{m}"}} {counts[-1]}')
            endpoint_model, key, usd = ("endpoint", "model"), ("key_name",), "{:.9f}"
            lines += family("openai_streamed_responses_total", "counter",
                            "/v1 responses sent as server-sent events", endpoint_model, self.streams)
            lines += family("openai_stream_disconnects_total", "counter", "streams whose client left before the "
                            "end (the Triton stream was cancelled)", endpoint_model, self.disconnects)
            lines += family("openai_spend_usd_total", "counter", "settled spend of /v1/chat/completions by key name "
                            "and model (the router's: router_spend_usd_total)", ("key_name", "model"), self.spent, usd)
            lines += family("openai_budget_remaining_usd", "gauge", "a key's budget less spend and reservations in "
                            "its window (the shared ledger, read after each /v1 chat call)", key, self.budgets, usd)
            # the same two gauges as the router's (router_key_*): the soft-budget alert reads both families
            lines += family("openai_key_window_spend_usd", "gauge", "a key's spend and outstanding reservations in "
                            "its budget window (the shared ledger, read after each /v1 chat call)", key,
                            self.window_spend, usd)
            lines += family("openai_key_soft_budget_usd", "gauge", "a key's soft budget (an alert, not a refusal)",
                            key, self.soft_budgets, usd)
            lines += family("openai_fallbacks_total", "counter", "/v1 chat completions answered by another model "
                            "than asked", ("from", "to", "reason"), self.fallbacks)
            lines += family("openai_cooldowns_total", "counter", "times a gateway model's circuit opened in this "
                            "frontend", ("model",), self.cooldowns)
            lines += family("openai_refusals_total", "counter", "/v1 chat completions refused by a key's limits or "
                            "models", ("key_name", "reason"), self.refusals)
        return "\n".join(lines) + "\n"


def triton_error(error: Exception, what: str) -> proto.OpenAIError:
    """A tritonclient failure → the OpenAI error a client gets."""
    status = str(getattr(error, "status", lambda: "")() or "")
    message = str(getattr(error, "message", lambda: "")() or error)
    message = message.removeprefix("[StatusCode.INVALID_ARGUMENT] ")
    if "INVALID_ARGUMENT" in status or "invalid input: " in message:
        text = message.split("invalid input: ", 1)[-1]
        return proto.invalid(f"{what}: {text}", "file" if what == "audio" else "input")
    restarting = restarting_model_message(message)
    if restarting:  # a dead Python stub: the launcher is reloading that model
        return proto.unavailable(f"{what}: {restarting}")
    if "DEADLINE_EXCEEDED" in status or "Deadline" in message:
        return proto.OpenAIError(504, f"{what}: the model did not answer in time", "server_error", None, "timeout")
    if any(s in status for s in ("UNAVAILABLE", "NOT_FOUND", "CANCELLED")) or "not ready" in message \
            or "unknown model" in message or "restarting" in message:
        return proto.unavailable(f"{what}: the model is not available right now ({message[:200]})")
    return proto.internal(f"{what}: {message[:300]}")


class Triton:
    """Clients of every replica's loopback gRPC port; requests go round robin, and a replica that
    refuses (restarting) is skipped for the next.

    Unary inference (``/v1/embeddings``) is a plain ``grpc.aio`` stub call with a
    ``ModelInferRequest`` built here, tensors in ``raw_input_contents`` / ``raw_output_contents``:
    tritonclient's ``InferInput``/``InferResult`` wrappers cost more CPU per call than the rest of
    the request's handling. Streams (audio) use ``tritonclient.grpc.aio``."""

    def __init__(self, addresses: list[str]):
        import grpc
        import tritonclient.grpc.aio as grpcclient
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self.grpc, self.grpcclient, self.pb = grpc, grpcclient, service_pb2
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        self.clients = [grpcclient.InferenceServerClient(a, channel_args=options) for a in addresses]
        self.channels = [grpc.aio.insecure_channel(a, options=options) for a in addresses]
        self.model_infer = [service_pb2_grpc.GRPCInferenceServiceStub(c).ModelInfer for c in self.channels]
        self.turn = itertools.count()

    def order(self) -> list[int]:
        start = next(self.turn)
        return [(start + i) % len(self.clients) for i in range(len(self.clients))]

    def infer(self, request, timeout_s: float, fp32: str | None = None):
        """``ModelInferRequest`` → an awaitable of its ``ModelInferResponse`` (or, with ``fp32``, of
        that FP32 output as an array). The call is started here (the request goes out at the event
        loop's next turn, before the awaitable is awaited); failures are tritonclient's
        ``InferenceServerException``, as ``triton_error`` reads them."""
        order = self.order()
        return self._answer(self.model_infer[order[0]](request, timeout=timeout_s), request, order[1:], timeout_s,
                            fp32)

    async def _answer(self, call, request, others: list[int], timeout_s: float, fp32: str | None):
        while True:
            try:
                response = await call
                return response if fp32 is None else fp32_output(response, fp32)
            except self.grpc.aio.AioRpcError as failure:
                error = self.grpcclient.InferenceServerException(
                    msg=failure.details(), status=str(failure.code()), debug_details=failure.debug_error_string())
            # a replica that is restarting, or whose model lost its stub: the next one may serve
            if not others or ("UNAVAILABLE" not in error.status() and not restarting_model_message(str(error))):
                raise error
            call = self.model_infer[others.pop(0)](request, timeout=timeout_s)

    def stream(self, model: str, inputs: list, parameters: dict, timeout_s: float):
        """One request on a ModelStreamInfer stream → (call, async iterator of (result, error)); the
        request side stays open until ``done`` is set (Triton then has every response)."""
        done = asyncio.Event()

        async def requests():
            yield {"model_name": model, "inputs": inputs, "parameters": parameters}
            await done.wait()

        client = self.clients[self.order()[0]]
        call = client.stream_infer(requests(), stream_timeout=timeout_s)
        return call, done

    async def close(self):
        for client in self.clients:
            await client.close()
        for channel in self.channels:
            await channel.close()


def bytes_input(grpcclient, name: str, values: list[bytes]):
    tensor = grpcclient.InferInput(name, [len(values), 1], "BYTES")
    tensor.set_data_from_numpy(np.array(values, dtype=np.object_).reshape(-1, 1))
    return tensor


def bytes_request(pb, model: str, name: str, values: list[bytes], output: str):
    """A ``ModelInferRequest`` of one BYTES input ``[len(values), 1]`` (Triton's raw form: each
    element its 4-byte little-endian length, then its bytes) asking for ``output``."""
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = name, "BYTES"
    tensor.shape.extend((len(values), 1))
    request.outputs.add().name = output
    request.raw_input_contents.append(b"".join(len(v).to_bytes(4, "little") + v for v in values))
    return request


def fp32_output(response, name: str) -> np.ndarray:
    """The FP32 output ``name`` of a ``ModelInferResponse`` (Triton sends outputs raw)."""
    for index, tensor in enumerate(response.outputs):
        if tensor.name == name:
            if tensor.datatype != "FP32" or index >= len(response.raw_output_contents):
                raise proto.internal(f"the model's output '{name}' is {tensor.datatype}, not raw FP32")
            return np.frombuffer(response.raw_output_contents[index], dtype="<f4").reshape(tuple(tensor.shape))
    raise proto.internal(f"the model's response has no output '{name}'")


# Triton's HTTP statuses → the gRPC status names ``triton_error`` reads (Triton derives both from one
# error code: INVALID_ARG 400, NOT_FOUND 404, UNAVAILABLE 503, INTERNAL 500, ...).
HTTP_STATUS_NAMES = {400: "StatusCode.INVALID_ARGUMENT", 404: "StatusCode.NOT_FOUND", 409: "StatusCode.ALREADY_EXISTS",
                     429: "StatusCode.RESOURCE_EXHAUSTED", 499: "StatusCode.CANCELLED", 500: "StatusCode.INTERNAL",
                     501: "StatusCode.UNIMPLEMENTED", 503: "StatusCode.UNAVAILABLE", 504: "StatusCode.DEADLINE_EXCEEDED"}


class TritonHttp:
    """Unary inference over every replica's loopback HTTP port (``--triton-http``): keep-alive
    HTTP/1.1 on the event loop itself (``screen_server.Upstream``'s pool), tensors in binary form
    and the JSON header written here (small: Triton's JSON limits are never near). Per call it costs
    ~0.2 ms of CPU against ~0.85 ms for a ``grpc.aio`` call, whose answer crosses two grpc threads
    before it reaches the event loop (docs/openai.md). Round robin; a replica that answers 503 or
    cannot be reached is skipped for the next. Failures are ``InferenceServerException`` with the
    gRPC status names ``triton_error`` reads."""

    def __init__(self, addresses: list[str], grpcclient):
        self.addresses = list(addresses)
        self.upstreams = [Upstream(a) for a in addresses]
        self.grpcclient = grpcclient
        self.turn = itertools.count()

    async def infer_bytes(self, model: str, name: str, values: list[bytes], output: str,
                          timeout_s: float) -> np.ndarray:
        raw = b"".join(len(v).to_bytes(4, "little") + v for v in values)
        header = json.dumps({"inputs": [{"name": name, "shape": [len(values), 1], "datatype": "BYTES",
                                         "parameters": {"binary_data_size": len(raw)}}],
                             "outputs": [{"name": output, "parameters": {"binary_data": True}}]},
                            separators=(",", ":")).encode()
        start = next(self.turn)
        error = None
        for i in range(len(self.upstreams)):
            index = (start + i) % len(self.upstreams)
            head = (f"POST /v2/models/{quote(model, safe='')}/infer HTTP/1.1\r\nHost: {self.addresses[index]}\r\n"
                    f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {len(header)}\r\n"
                    f"Content-Length: {len(header) + len(raw)}\r\n\r\n").encode()
            try:
                status, headers, body = await asyncio.wait_for(
                    self._exchange(self.upstreams[index], head + header + raw), timeout_s)
            except asyncio.TimeoutError:
                raise self.grpcclient.InferenceServerException(
                    msg="Deadline Exceeded", status="StatusCode.DEADLINE_EXCEEDED") from None
            except (OSError, asyncio.IncompleteReadError) as failure:
                error = self.grpcclient.InferenceServerException(
                    msg=f"failed to connect to the inference server: {failure}", status="StatusCode.UNAVAILABLE")
                continue
            if status == 200:
                return http_fp32_output(headers, body, output)
            try:
                message = str(json.loads(body).get("error", ""))
            except (ValueError, AttributeError):
                message = body[:300].decode("utf-8", "replace")
            error = self.grpcclient.InferenceServerException(
                msg=message, status=HTTP_STATUS_NAMES.get(status, f"HTTP {status}"))
            # a replica that is restarting, or whose model lost its stub: the next one may serve
            if status != 503 and not restarting_model_message(message):
                raise error
        raise error

    @staticmethod
    async def _exchange(upstream, message: bytes) -> tuple[int, list, bytes]:
        for attempt in (0, 1):
            reader, writer, reused = await upstream.connection()
            try:
                writer.write(message)
                answer = await read_head(reader)
                if answer is None:
                    raise ConnectionResetError("Triton closed the connection")
                status_line, headers = answer
                body = await read_body(reader, headers)
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                writer.close()
                # Triton closes idle keep-alive connections: only a pooled one is tried again
                if attempt == 0 and reused:
                    continue
                raise
            except BaseException:  # cancelled or timed out mid-answer: the connection is unusable
                writer.close()
                raise
            keep = dict(headers).get(b"connection", b"").lower() != b"close"
            upstream.release(reader, writer, keep)
            return int(status_line.split(b" ")[1]), headers, body
        raise AssertionError("unreachable")

    async def close(self):
        for upstream in self.upstreams:
            while upstream.idle:
                upstream.idle.pop()[1].close()


def http_fp32_output(headers: list, body: bytes, name: str) -> np.ndarray:
    """The FP32 output ``name`` of Triton's binary HTTP answer (JSON header, then the binary outputs
    in the header's order)."""
    length = dict(headers).get(b"inference-header-content-length")
    try:
        size = int(length) if length is not None else len(body)
        document = json.loads(body[:size])
        offset = size
        for tensor in document.get("outputs", ()):
            binary = int(tensor.get("parameters", {}).get("binary_data_size", 0) or 0)
            if tensor.get("name") == name:
                if tensor.get("datatype") != "FP32" or binary != 4 * int(np.prod(tensor["shape"])):
                    break
                return np.frombuffer(body, dtype="<f4", count=binary // 4, offset=offset).reshape(tensor["shape"])
            offset += binary
    except (ValueError, KeyError, TypeError):
        pass
    raise proto.internal(f"the model's answer has no binary FP32 output '{name}'")


class Frontend:
    def __init__(self, triton: Triton, catalog: proto.ModelCatalog, keys: KeyRing | None, token_counter,
                 gateway=None, language_codes=(), triton_timeout_s: float = TRITON_TIMEOUT_S,
                 triton_http: TritonHttp | None = None):
        self.triton, self.catalog, self.keys = triton, catalog, keys
        self.triton_http = triton_http  # /v1/embeddings over HTTP when the replicas' HTTP ports are given
        self.count_tokens = token_counter
        self.gateway = gateway  # gateway_service.GatewayService, or None without a route table
        self.language_codes = tuple(language_codes)
        self.timeout_s = triton_timeout_s
        self.chat_slots = asyncio.Semaphore(CHAT_IN_FLIGHT)
        self.chat_calls: set[asyncio.Future] = set()  # calls whose client left, finishing to settle
        known = {row["id"] for row in catalog.entries()}
        self.metrics = Metrics(known)
        self.draining = False

    # ----------------------------------------------------------------------------- plumbing
    def app(self):
        from aiohttp import web

        app = web.Application(middlewares=[self.middleware], client_max_size=proto.MAX_JSON_BODY_BYTES)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/v1/audio/transcriptions", self.transcriptions)
        app.router.add_post("/v1/audio/translations", self.translations)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/health", self.health)
        return app

    def reply(self, body, status: int = 200, content_type: str = "application/json", headers=None):
        from aiohttp import web

        text = body if isinstance(body, str) else json.dumps(body)
        return web.Response(text=text, status=status, headers=headers,
                            content_type=content_type.split(";")[0], charset="utf-8")

    def error_reply(self, error: proto.OpenAIError):
        return self.reply(error.body(), error.status, headers=dict(error.headers))

    async def middleware(self, app, handler):
        from aiohttp import web

        async def handle(request):
            if not request.path.startswith("/v1"):
                return await handler(request)
            started = time.perf_counter()
            endpoint = request.path.split("?")[0]
            if request.match_info.route.resource is None or endpoint.startswith("/v1/models/"):
                endpoint = "/v1/models" if endpoint.startswith("/v1/models") else "other"
            request["model"] = None
            status = 500
            try:
                if self.keys is not None:
                    secret = bearer_secret(request.headers.get("Authorization"))
                    if secret is None:
                        raise proto.unauthorized("You didn't provide an API key: send 'Authorization: Bearer <key>'")
                    request["api_key"] = self.keys.lookup(secret)
                    if request["api_key"] is None:
                        raise proto.unauthorized("Incorrect API key provided.")
                else:
                    request["api_key"] = None
                response = await handler(request)
                status = response.status
                return response
            except proto.OpenAIError as error:
                status = error.status
                return self.error_reply(error)
            except web.HTTPException as error:  # aiohttp's own: unknown path, wrong method, body too large
                status = error.status
                kind = {404: ("not found: no such /v1 endpoint", "not_found"),
                        405: (f"method {request.method} is not allowed here", "method_not_allowed"),
                        413: ("the request body is too large", "request_too_large")}
                message, code = kind.get(error.status, (error.reason, None))
                return self.error_reply(proto.OpenAIError(error.status, message, "invalid_request_error", None, code))
            except (ConnectionResetError, asyncio.CancelledError):
                status = 499  # the client left
                raise
            except Exception as error:  # noqa: BLE001 - a bug answers 500, the server lives
                status = 500
                print(f"[openai] {endpoint}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
                return self.error_reply(proto.internal(f"internal error ({type(error).__name__})"))
            finally:
                self.metrics.observe(endpoint, request.get("model"), status, time.perf_counter() - started)
        return handle

    async def metrics_page(self, request):
        return self.reply(self.metrics.render(), content_type="text/plain")

    async def health(self, request):
        return self.reply({"status": "draining" if self.draining else "ok"}, 503 if self.draining else 200)

    async def json_body(self, request) -> dict:
        if request.content_length is not None and request.content_length > proto.MAX_JSON_BODY_BYTES:
            raise proto.too_large(f"the request body is {request.content_length} bytes; the limit for JSON bodies "
                                  f"is {proto.MAX_JSON_BODY_BYTES} bytes")
        if "json" not in (request.content_type or ""):
            raise proto.invalid(f"the body must be JSON (Content-Type: application/json), not "
                                f"{(request.content_type or 'none')[:64]!r}")
        return proto.parse_json_body(await request.read())

    # ----------------------------------------------------------------------------- models
    async def models(self, request):
        return self.reply(self.catalog.listing())

    async def model(self, request):
        request["model"] = request.match_info["model"]
        return self.reply(self.catalog.entry(request.match_info["model"]))

    # ----------------------------------------------------------------------------- embeddings
    async def embeddings(self, request):
        from aiohttp import web

        body = await self.json_body(request)
        request["model"] = body.get("model")
        parsed = proto.parse_embeddings(body, self.catalog)
        encoded = [text.encode("utf-8") for text in parsed.texts]
        calls = [asyncio.ensure_future(self.embed(parsed.model, encoded[a:b]))
                 for a, b in proto.batches(len(encoded), TEXT_MAX_BATCH)]
        try:
            if sum(len(text) for text in encoded) <= INLINE_TOKENS_BYTES:
                # Short texts: counted here while Triton computes (the calls go out at this first
                # turn); a thread-pool hop would cost more CPU than the count.
                await asyncio.sleep(0)
                tokens = self.count_tokens(parsed.texts)
            else:
                tokens = await asyncio.get_running_loop().run_in_executor(None, self.count_tokens, parsed.texts)
            responses = await asyncio.gather(*calls)
        except self.triton.grpcclient.InferenceServerException as error:
            raise triton_error(error, "text_embedding") from None
        finally:
            for call in calls:  # those still running when another failed or the client left
                call.cancel()
        embeddings = np.concatenate(responses)
        return web.Response(body=proto.embeddings_body(parsed.model, embeddings, parsed.encoding_format, tokens),
                            content_type="application/json", charset="utf-8")

    def embed(self, model: str, texts: list[bytes]):
        """One ``text_embedding`` request → an awaitable of its ``[n, 384]`` embeddings. (gRPC: the
        call starts here, before the awaitable is awaited.)"""
        if self.triton_http is not None:
            return self.triton_http.infer_bytes(model, "text", texts, "embedding", self.timeout_s)
        return self.triton.infer(bytes_request(self.triton.pb, model, "text", texts, "embedding"), self.timeout_s,
                                 fp32="embedding")

    # ----------------------------------------------------------------------------- audio
    async def transcriptions(self, request):
        return await self.audio(request, "transcribe")

    async def translations(self, request):
        return await self.audio(request, "translate")

    async def audio(self, request, task: str):
        fields, filename, data = await read_multipart(request)
        request["model"] = fields.get("model")
        parsed = proto.parse_transcription(fields, filename, None if data is None else len(data), task, self.catalog,
                                           self.language_codes)
        grpcclient = self.triton.grpcclient
        inputs = [bytes_input(grpcclient, "audio", [data])]
        if parsed.language:
            inputs.append(bytes_input(grpcclient, "language", [parsed.language.encode()]))
        inputs.append(bytes_input(grpcclient, "task", [task.encode()]))
        call, done = self.triton.stream(STREAM_MODEL, inputs, {"partials": parsed.stream}, SPEECH_TIMEOUT_S)
        endpoint = request.path
        try:
            if parsed.stream:
                return await self.audio_events(request, call, endpoint, parsed)
            final = await self.final_response(call)
            text, segments = final
            duration = segments[-1].end if segments else 0.0
            body, content_type = proto.format_transcript(parsed.response_format, text, segments, task,
                                                         parsed.language or "en", duration)
            return self.reply(body, content_type=content_type)
        finally:
            done.set()
            call.cancel()  # a no-op after the final response; stops the decode when the client left

    async def final_response(self, call) -> tuple[str, list[proto.Segment]]:
        async for result, error in call:
            if error is not None:
                raise triton_error(error, "audio")
            if bool(result.as_numpy("is_final").reshape(-1)[0]):
                text = result.as_numpy("transcript").reshape(-1)[0].decode("utf-8", "replace")
                return text, proto.parse_segments(result.as_numpy("segments").reshape(-1)[0])
        raise proto.unavailable("audio: the speech model ended the stream without a transcript")

    async def audio_events(self, request, call, endpoint: str, parsed: proto.TranscriptionRequest):
        from aiohttp import web

        # The first response decides between an HTTP error and a stream.
        iterator = call.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            raise proto.unavailable("audio: the speech model ended the stream without a transcript") from None
        if first[1] is not None:
            raise triton_error(first[1], "audio")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        self.metrics.streamed(endpoint, parsed.model)
        pending = [first]
        try:
            while True:
                result, error = pending.pop() if pending else await iterator.__anext__()
                if error is not None:
                    failure = triton_error(error, "audio")
                    await response.write(proto.sse(failure.body()))
                    break
                final = bool(result.as_numpy("is_final").reshape(-1)[0])
                delta = result.as_numpy("delta").reshape(-1)[0].decode("utf-8", "replace")
                if delta:
                    await response.write(proto.sse(proto.transcript_delta(delta)))
                if final:
                    text = result.as_numpy("transcript").reshape(-1)[0].decode("utf-8", "replace")
                    await response.write(proto.sse(proto.transcript_done(text)))
                    break
        except (ConnectionResetError, asyncio.CancelledError):
            self.metrics.streamed(endpoint, parsed.model, disconnected=True)
            raise
        except StopAsyncIteration:
            await response.write(proto.sse(proto.unavailable("audio: the stream ended early").body()))
        await response.write_eof()
        return response

    # ----------------------------------------------------------------------------- chat
    async def chat_completions(self, request):
        """Through ``GatewayService``: refusals (403 model not allowed for the key; 429 budget, rpm,
        tpm with ``Retry-After``) before the gateway is called, fallbacks, the ledger. The answer
        names the model that answered and why (headers ``x-gateway-model``, ``x-fallback-from``,
        ``x-fallback-reason``; field ``x_gateway``) and its cost (``usage.cost_usd``,
        ``x-request-cost-usd``)."""
        body = await self.json_body(request)
        request["model"] = body.get("model")
        parsed = proto.parse_chat(body, self.catalog)
        if self.gateway is None or not self.gateway.client.configured:
            raise proto.unavailable("the external gateway is not configured: set LLM_GATEWAY_BASE_URL and "
                                    "LLM_GATEWAY_API_KEY in the server's environment", None)
        if self.chat_slots.locked():
            raise proto.rate_limited("too many chat completions in flight on this server: retry shortly")
        arguments = proto.chat_arguments(parsed, self.gateway.table.gateway.max_tokens_limit)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"  # the id of the response and of its ledger rows
        async with self.chat_slots:
            if parsed.stream:
                return await self.chat_events(request, parsed, arguments, request_id)
            # A client that leaves does not cancel the call: it finishes and is settled at its real
            # cost (the provider bills it anyway) rather than abandoned at its reservation.
            call = asyncio.ensure_future(self.gateway.acomplete(request["api_key"], request_id=request_id,
                                                                **arguments))
            self.chat_calls.add(call)
            call.add_done_callback(lambda done: (self.chat_calls.discard(done),
                                                 done.cancelled() or done.exception()))
            try:
                answer = await asyncio.shield(call)
            except GATEWAY_ERRORS as error:
                raise proto.gateway_failure(error) from None
            completion = proto.chat_completion(answer, int(time.time()))
            return self.reply(completion, headers=proto.gateway_headers(completion["x_gateway"], answer.cost_usd))

    async def chat_events(self, request, parsed: proto.ChatRequest, arguments: dict, request_id: str):
        """A streamed completion: the gateway's chunks as server-sent events; the headers say which
        model answers (known before the first chunk: fallbacks happen only before it); the last
        event before ``[DONE]`` is the usage with ``cost_usd`` when ``stream_options.include_usage``.
        A client that leaves closes the service's stream (the upstream call stops; the ledger
        charges its reservation)."""
        from aiohttp import web

        chunks = self.gateway.astream(request["api_key"], request_id=request_id, **arguments)
        endpoint = "/v1/chat/completions"
        try:
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                raise proto.unavailable("the gateway's stream ended before its first chunk") from None
            except GATEWAY_ERRORS as error:
                raise proto.gateway_failure(error) from None
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                   "X-Accel-Buffering": "no",
                                                   **proto.gateway_headers(first.get("x_gateway") or {})})
            await response.prepare(request)
            self.metrics.streamed(endpoint, parsed.model)
            chunk = first
            try:
                while chunk is not None:
                    sent = proto.chat_chunk(chunk, parsed.include_usage)
                    if sent is not None:
                        await response.write(proto.sse(sent))
                    try:
                        chunk = await chunks.__anext__()
                    except StopAsyncIteration:
                        chunk = None
                    except GATEWAY_ERRORS as error:  # broke after the first chunk: said in the stream
                        await response.write(proto.sse(proto.gateway_failure(error).body()))
                        break
                await response.write(proto.SSE_DONE)
            except (ConnectionResetError, asyncio.CancelledError):
                self.metrics.streamed(endpoint, parsed.model, disconnected=True)
                raise
            await response.write_eof()
            return response
        finally:
            await chunks.aclose()  # settled now, whatever happened; the upstream stream is closed

    async def finish_chat_calls(self, timeout_s: float) -> None:
        """At a stop: calls whose client left finish (and are settled) within ``timeout_s``."""
        if self.chat_calls:
            await asyncio.wait(set(self.chat_calls), timeout=timeout_s)


async def read_multipart(request) -> tuple[dict[str, str], str | None, bytes | None]:
    """The multipart body, bounded: at most ``MAX_MULTIPART_PARTS`` parts, the ``file`` part at most
    the audio limit, other fields ``MAX_FIELD_BYTES``, the file name ``MAX_FILENAME_CHARS``."""
    from aiohttp import http_exceptions

    from triton_pipelines.limits import MAX_AUDIO_BYTES

    if not (request.content_type or "").startswith("multipart/form-data"):
        raise proto.invalid(f"the body must be multipart/form-data with a 'file' part, not "
                            f"{(request.content_type or 'none')[:64]!r}")
    try:
        reader = await request.multipart()
    except (ValueError, AssertionError) as error:
        raise proto.invalid(f"the multipart body cannot be read: {str(error)[:200]}") from None
    fields: dict[str, str] = {}
    filename, data = None, None
    parts = 0
    try:
        while True:
            part = await reader.next()
            if part is None:
                break
            parts += 1
            if parts > proto.MAX_MULTIPART_PARTS:
                raise proto.invalid(f"the multipart body has more than {proto.MAX_MULTIPART_PARTS} parts")
            if not hasattr(part, "read_chunk"):  # a nested multipart
                raise proto.invalid("nested multipart bodies are not accepted")
            name = part.name or ""
            if len(name) > 64:
                raise proto.invalid("a multipart part's name is longer than 64 characters")
            if name == "file":
                if data is not None:
                    raise proto.invalid("'file' is given twice", "file")
                raw_name = part.filename or ""
                if len(raw_name) > proto.MAX_FILENAME_CHARS:
                    raise proto.invalid(f"the file name is {len(raw_name)} characters; at most "
                                        f"{proto.MAX_FILENAME_CHARS}", "file")
                filename = raw_name
                data = await bounded_read(part, MAX_AUDIO_BYTES, lambda: proto.too_large(
                    f"'file' is larger than the audio limit of {MAX_AUDIO_BYTES} bytes ({MAX_AUDIO_BYTES >> 20} MiB)",
                    "file"))
            else:
                value = await bounded_read(part, proto.MAX_FIELD_BYTES, lambda: proto.invalid(
                    f"the multipart field '{name[:64]}' is longer than {proto.MAX_FIELD_BYTES} bytes", name[:64]))
                if name in fields:
                    raise proto.invalid(f"the field '{name}' is given twice", name)
                try:
                    fields[name] = value.decode("utf-8")
                except UnicodeDecodeError:
                    raise proto.invalid(f"the field '{name[:64]}' is not UTF-8 text", name[:64]) from None
    except proto.OpenAIError:
        raise
    except http_exceptions.LineTooLong:
        raise proto.invalid("a multipart part's headers are too long (a file name of at most "
                            f"{proto.MAX_FILENAME_CHARS} characters)", "file") from None
    except (ValueError, AssertionError, RuntimeError, http_exceptions.HttpProcessingError) as error:
        raise proto.invalid(f"the multipart body cannot be read: {str(error)[:200]}") from None
    return fields, filename, data


async def bounded_read(part, limit: int, error) -> bytes:
    chunks, size = [], 0
    while True:
        chunk = await part.read_chunk(1 << 16)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise error()
        chunks.append(chunk)


# --------------------------------------------------------------------------------- start-up
def token_counter(model_repository: Path):
    """Real token counts (no padding) of texts as the served ``text_tokenizer`` tokenizes them: its
    own ``tokenizer.json`` and ``max_sequence_length`` (truncation), from the repository."""
    from triton_pipelines.pipelines.text import TextTokenizer

    folder = model_repository / "text_tokenizer"
    if not (folder / "1" / "tokenizer.json").exists():
        return lambda texts: 0
    tokenizer = TextTokenizer.served(folder)  # padding (buckets or not) is not in the mask's sum
    return lambda texts: int(tokenizer.encode(list(texts)).attention_mask.sum())


def route_table(model_repository: Path):
    from triton_pipelines.repository.routes import RouteTable

    for path in (model_repository / "router" / "1" / "routes.yaml", Path("data/routes.yaml")):
        if path.exists():
            return RouteTable.load(path)
    return None


async def serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    from triton_pipelines.pipelines.speech.config import LANGUAGE_CODES

    try:
        public = BuiltManifest.read(args.model_repository).public_models
    except (OSError, ValueError):
        public = None
    table = route_table(args.model_repository)
    catalog = proto.ModelCatalog.build(public, table.prices if table else (), created=int(time.time()))
    gateway = None
    if table is not None:
        from triton_pipelines.gateway.service import GatewayService

        # Keys from $TRITON_API_KEYS_FILE, the ledger from $SPEND_DATABASE_URL (the launcher's, shared
        # with the routers), the gateway from $LLM_GATEWAY_*: the router's service, in this process.
        gateway = GatewayService.from_environment(
            table, log=lambda line: print(f"[openai] {line}", file=sys.stderr, flush=True))
    keys = gateway.keys if gateway is not None else keys_from_environment()
    triton = Triton(args.triton_grpc)
    triton_http = TritonHttp(args.triton_http, triton.grpcclient) if args.triton_http else None
    frontend = Frontend(triton, catalog, keys, token_counter(args.model_repository), gateway, LANGUAGE_CODES,
                        triton_http=triton_http)
    if gateway is not None:
        gateway.recorder = frontend.metrics  # spend, budgets, fallbacks, cooldowns, refusals of /v1 chat
        gateway.publish_budgets()
    runner = web.AppRunner(frontend.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, args.listen, args.port, backlog=1024)
    await site.start()
    print(f"[openai] serving /v1 on {args.listen}:{args.port} ({len(catalog.entries())} models, keys "
          f"{'required' if keys else 'off'})", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    # Drain: no new connections, requests in flight finish (up to the grace period).
    frontend.draining = True
    await site.stop()
    await runner.shutdown()
    await runner.cleanup()
    await triton.close()
    if triton_http is not None:
        await triton_http.close()
    if gateway is not None:
        await frontend.finish_chat_calls(timeout_s=table.gateway.deadline_s)
        await gateway.client.close()
        if gateway.ledger is not None:
            gateway.ledger.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--listen", default="127.0.0.1")
    parser.add_argument("--triton-grpc", action="append", required=True, help="host:port of a replica's gRPC port")
    parser.add_argument("--triton-http", action="append", default=[],
                        help="host:port of a replica's loopback HTTP port (optional): /v1/embeddings then calls "
                             "Triton over HTTP (less CPU and latency per call than gRPC); audio stays on gRPC")
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    args = parser.parse_args(argv)
    if args.triton_http and len(args.triton_http) != len(args.triton_grpc):
        parser.error("--triton-http: one per replica, in the order of --triton-grpc")
    event_loop_runner()(serve(args))
    return 0


def event_loop_runner():
    """uvloop's runner (requirements-serving.txt; ~0.14 ms less CPU per /v1/embeddings request than
    asyncio's loop on the 2-core machine), or asyncio's where uvloop is not installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


if __name__ == "__main__":
    sys.exit(main())
