"""The inside of ``POST /v1/chat/completions``: a narrow seam the OpenAI-compatible frontend calls.

    backend.complete(api_key, body) -> dict             # an OpenAI chat.completion, usage.cost_usd
    backend.stream(api_key, body) -> Iterator[dict]     # chat.completion.chunk dicts

``api_key`` is the caller's ``api_keys.ApiKey`` (None when the server runs without keys); ``body``
the request as ``openai_protocol.parse_chat`` validated it. Both are blocking and run in the
frontend's bounded thread pool. Failures are ``ChatError`` (status, message, code).

For now this is implemented over the router's ``gateway.GatewayClient`` (one per process, on its
own event-loop thread, so its circuit breakers are shared by every call): time-outs, bounded
retries, breaker, and the route table's prices → ``usage.cost_usd``. A streamed completion is the
gateway's own stream passed through chunk by chunk (one attempt, the same breaker, usage always
asked for upstream so that the final chunk carries the cost). The gateway service of issue 24
(budgets, fallbacks) replaces this module behind the same two functions.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from typing import Any, Iterator, Mapping

from .routing import RouteError, RoutedRequest, RouteTable, cost_usd

# RouteError reasons → (HTTP status, OpenAI error code)
STATUS = {"not_configured": (503, "gateway_not_configured"), "circuit_open": (503, "circuit_open"),
          "timeout": (504, "upstream_timeout"), "unreachable": (502, "upstream_unreachable"),
          "upstream_status": (502, "upstream_error"), "rejected": (400, "upstream_rejected"),
          "bad_response": (502, "upstream_bad_response")}


class ChatError(Exception):
    def __init__(self, status: int, message: str, code: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.code, self.retry_after_s = status, code, retry_after_s


class GatewayChatBackend:
    def __init__(self, table: RouteTable, environ: Mapping[str, str] | None = None):
        from .gateway import GatewayClient

        self.table = table
        self.client = GatewayClient(table.gateway, environ)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="chat-gateway", daemon=True)
        self.thread.start()

    @property
    def configured(self) -> bool:
        return self.client.configured

    def _messages(self, body: Mapping[str, Any]) -> list[dict]:
        return [{key: value for key, value in message.items() if key in ("role", "content", "name", "tool_call_id")}
                for message in body["messages"]]

    def complete(self, api_key, body: Mapping[str, Any]) -> dict:
        model = body["model"]
        settings = self.table.gateway
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or settings.default_max_tokens
        routed = RoutedRequest(task="chat_completions", route="gateway", latency_class="realtime", target=model,
                               model=model, messages=self._messages(body), temperature=body.get("temperature"),
                               max_tokens=min(int(max_tokens), settings.max_tokens_limit))
        future = asyncio.run_coroutine_threadsafe(self.client.complete(routed), self.loop)
        try:
            completion = future.result(timeout=settings.deadline_s + 5)
        except RouteError as error:
            status, code = STATUS.get(error.reason, (502, "upstream_error"))
            retry = self.client.breaker(model).retry_in_s() if error.reason == "circuit_open" else None
            raise ChatError(status, str(error), code, retry) from None
        except TimeoutError:
            future.cancel()
            raise ChatError(504, "the gateway did not answer within the deadline", "upstream_timeout") from None
        cost = cost_usd(self.table.prices[model], completion.input_tokens, completion.output_tokens)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": completion.text}}],
            "usage": {"prompt_tokens": completion.input_tokens, "completion_tokens": completion.output_tokens,
                      "total_tokens": completion.input_tokens + completion.output_tokens, "cost_usd": cost},
        }

    def stream(self, api_key, body: Mapping[str, Any]) -> Iterator[dict]:
        """The gateway's own chunks, passed through as they arrive (``stream=True``, usage always asked
        for so the cost is known): the usage chunk gains ``cost_usd`` and is passed on only when the
        client asked for it (``stream_options.include_usage``). One attempt (a stream that has started
        cannot be retried); the model's circuit breaker counts it. Closing the iterator (the client
        left) cancels the upstream call."""
        model = body["model"]
        if not self.client.configured:
            raise ChatError(503, "the external gateway is not configured: set LLM_GATEWAY_BASE_URL and "
                                 "LLM_GATEWAY_API_KEY in the server's environment", "gateway_not_configured")
        breaker = self.client.breaker(model)
        if not breaker.allow():
            raise ChatError(503, f"the external gateway is failing for model {model}: circuit open",
                            "circuit_open", breaker.retry_in_s())
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks: queue.Queue = queue.Queue(maxsize=256)
        done = object()
        future = asyncio.run_coroutine_threadsafe(self._pump(body, chunks, done), self.loop)
        verdict = False
        try:
            usage_seen = False
            while True:
                try:
                    item = chunks.get(timeout=self.table.gateway.timeout_s)
                except queue.Empty:
                    breaker.record_failure()
                    verdict = True
                    raise ChatError(504, f"the gateway sent nothing for {self.table.gateway.timeout_s:g} s",
                                    "upstream_timeout") from None
                if item is done:
                    break
                if isinstance(item, ChatError):
                    (breaker.record_success if item.status == 400 else breaker.record_failure)()
                    verdict = True
                    raise item
                usage = item.get("usage")
                if usage:
                    usage_seen = True
                    usage["cost_usd"] = cost_usd(self.table.prices[model], int(usage.get("prompt_tokens") or 0),
                                                 int(usage.get("completion_tokens") or 0))
                    if not include_usage:
                        if not item.get("choices"):
                            continue
                        item = {k: v for k, v in item.items() if k != "usage"}
                elif include_usage and "usage" in item:
                    item["usage"] = None
                yield item
            breaker.record_success()
            verdict = True
            if not usage_seen:  # an unaccountable stream: said at its end
                raise ChatError(502, "the gateway's stream reported no token usage, so its cost is unknown",
                                "upstream_bad_response")
        finally:
            future.cancel()
            if not verdict:
                breaker.release_trial()

    async def _pump(self, body: Mapping[str, Any], chunks: "queue.Queue", done: object) -> None:
        import openai

        settings = self.table.gateway
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or settings.default_max_tokens
        arguments = {"model": body["model"], "messages": self._messages(body),
                     "max_tokens": min(int(max_tokens), settings.max_tokens_limit), "stream": True,
                     "stream_options": {"include_usage": True}}
        if body.get("temperature") is not None:
            arguments["temperature"] = body["temperature"]
        put = lambda item: self.loop.run_in_executor(None, chunks.put, item)  # noqa: E731 - never block the loop
        try:
            stream = await self.client._openai().chat.completions.create(**arguments, timeout=settings.timeout_s)
            async for chunk in stream:
                await put(chunk.model_dump(exclude_unset=True))
            await put(done)
        except openai.APIStatusError as error:
            status = 400 if 400 <= error.status_code < 500 and error.status_code != 429 else 502
            await put(ChatError(status, f"the gateway answered HTTP {error.status_code}", "upstream_error"))
        except (openai.APIConnectionError, openai.APITimeoutError):
            await put(ChatError(502, "the gateway is unreachable or did not answer", "upstream_unreachable"))

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.client.close(), self.loop).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
