"""The inside of ``POST /v1/chat/completions``: a narrow seam the OpenAI-compatible frontend calls.

    backend.complete(api_key, body) -> dict             # an OpenAI chat.completion, usage.cost_usd
    backend.stream(api_key, body) -> Iterator[dict]     # chat.completion.chunk dicts

``api_key`` is the caller's ``api_keys.ApiKey`` (None when the server runs without keys); ``body``
the request as ``openai_protocol.parse_chat`` validated it. Both are blocking and run in the
frontend's bounded thread pool. Failures are ``ChatError`` (status, message, code).

For now this is implemented over the router's ``gateway.GatewayClient`` (one per process, on its
own event-loop thread, so its circuit breakers are shared by every call): time-outs, bounded
retries, breaker, and the route table's prices → ``usage.cost_usd``. Streaming is produced from the
complete answer (one content chunk, then the finish chunk and, with ``include_usage``, the usage
chunk): GatewayClient makes one non-streamed call. The gateway service of issue 24 (budgets,
fallbacks, upstream streaming) replaces this module behind the same two functions.
"""

from __future__ import annotations

import asyncio
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
        """Chunks of the completed answer (see the module docstring); the last one carries the usage
        when ``stream_options.include_usage`` is set."""
        answer = self.complete(api_key, body)
        base = {"id": answer["id"], "object": "chat.completion.chunk", "created": answer["created"],
                "model": answer["model"]}
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        extra = {"usage": None} if include_usage else {}
        yield {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None}], **extra}
        yield {**base, "choices": [{"index": 0, "delta": {"content": answer["choices"][0]["message"]["content"]},
                                    "finish_reason": None}], **extra}
        yield {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], **extra}
        if include_usage:
            yield {**base, "choices": [], "usage": answer["usage"]}

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.client.close(), self.loop).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
