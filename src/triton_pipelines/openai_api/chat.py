"""``POST /v1/chat/completions`` through ``gateway.service.GatewayService`` on this process's event
loop (``acomplete``/``astream``), as the native router's gateway tasks do: the key's model
allow-list, budget, rpm and tpm, fallbacks, cooldowns and the spend ledger."""

from __future__ import annotations

import asyncio
import time
import uuid

from triton_pipelines.errors import InputError, RouteError
from triton_pipelines.gateway.refusal import GatewayRefusal
from triton_pipelines.openai_api import protocol as proto
from triton_pipelines.openai_api.metrics import Metrics
from triton_pipelines.openai_api.replies import json_body, reply

GATEWAY_ERRORS = (GatewayRefusal, RouteError, InputError)  # what GatewayService raises for a request
CHAT_IN_FLIGHT = 64  # chat completions in flight on this process; more: 429


class ServingChat:
    def __init__(self, gateway, catalog: proto.ModelCatalog, metrics: Metrics):
        self.gateway = gateway  # gateway.service.GatewayService, or None without a route table
        self.catalog, self.metrics = catalog, metrics
        self.chat_slots = asyncio.Semaphore(CHAT_IN_FLIGHT)
        self.chat_calls: set[asyncio.Future] = set()  # calls whose client left, finishing to settle

    async def chat_completions(self, request):
        """Through ``GatewayService``: refusals (403 model not allowed for the key; 429 budget, rpm,
        tpm with ``Retry-After``) before the gateway is called, fallbacks, the ledger. The answer
        names the model that answered and why (headers ``x-gateway-model``, ``x-fallback-from``,
        ``x-fallback-reason``; field ``x_gateway``) and its cost (``usage.cost_usd``,
        ``x-request-cost-usd``)."""
        body = await json_body(request)
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
            return reply(completion, headers=proto.gateway_headers(completion["x_gateway"], answer.cost_usd))

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
