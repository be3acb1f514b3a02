"""The streamed call: the gateway's chunks relayed to the caller (the first one naming the model
that answers), the call settled with the usage the gateway reported (or its reservation when it
reported none or broke mid-way), and the same stream as a blocking iterator for threads."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Iterator

from triton_pipelines.gateway.admission import Admission, Plan
from triton_pipelines.gateway.fallback import Attempt, fallback_label
from triton_pipelines.gateway.keys import ApiKey
from triton_pipelines.gateway.ledger import call_cost_nusd, usd
from triton_pipelines.gateway.recorder import BudgetGauges, SpendRecorder


def blocking(chunks: AsyncIterator[dict], loop: asyncio.AbstractEventLoop) -> Iterator[dict]:
    """An async stream running on ``loop`` (another thread's) as a blocking iterator; closing it
    closes the stream."""
    try:
        while True:
            try:
                yield asyncio.run_coroutine_threadsafe(chunks.__anext__(), loop).result()
            except StopAsyncIteration:
                return
    finally:
        asyncio.run_coroutine_threadsafe(chunks.aclose(), loop).result(timeout=30)


class StreamRelay:
    """One service's relay of its streamed calls."""

    def __init__(self, prices: dict, admission: Admission, recorder: SpendRecorder, gauges: BudgetGauges):
        self.prices, self.admission, self.recorder, self.gauges = prices, admission, recorder, gauges

    async def relay(self, call, row: int | None, plan: Plan, current: str, attempts: list[Attempt],
                    started: float, api_key: ApiKey | None) -> AsyncIterator[dict]:
        requested = plan.requested
        fallback_from = requested if current != requested else None
        reason = fallback_label(attempts[0]) if attempts and fallback_from else None
        settled = False
        chunks = call.__aiter__()
        gateway = {"model": current, "requested_model": requested, "fallback_from": fallback_from,
                   "fallback_reason": reason, "request_id": plan.request_id}
        try:
            last: dict = {}
            first = True
            async for chunk in chunks:
                last = chunk
                chunk.pop("usage", None)
                if chunk.get("choices"):
                    if first:
                        chunk["x_gateway"], first = dict(gateway), False
                    yield chunk
            if call.usage is None:
                input_tokens = output_tokens = None
                charged = self.admission.reserved(plan, current)
            else:
                input_tokens, output_tokens = call.usage
                price = self.prices[current]
                charged = call_cost_nusd(price.input_per_million, price.output_per_million, input_tokens,
                                         output_tokens)
            await self.admission.settle_success(row, plan, current, charged, input_tokens=input_tokens,
                                                output_tokens=output_tokens, latency_s=time.monotonic() - started,
                                                outcome="success" if call.usage else "success_without_usage",
                                                fallback_from=fallback_from, fallback_reason=reason)
            settled = True
            if fallback_from:
                self.recorder.fallback(requested, current, reason or "unknown")
            self.recorder.spend(plan.limits.name, current, float(usd(charged)))
            await self.gauges.refresh(api_key)
            yield {"id": last.get("id", f"chatcmpl-{plan.request_id}"), "object": "chat.completion.chunk",
                   "created": last.get("created", int(time.time())), "model": current, "choices": [],
                   "usage": {"prompt_tokens": input_tokens, "completion_tokens": output_tokens,
                             "total_tokens": None if call.usage is None else input_tokens + output_tokens,
                             "cost_usd": float(usd(charged))},
                   "x_gateway": gateway}
        finally:
            await chunks.aclose()  # the upstream stream closes now
            if not settled:  # broken mid-way or abandoned by its client: tokens went out, figure unknown
                await self.admission.settle(row, "failed", cost_nusd=self.admission.reserved(plan, current),
                                            latency_s=time.monotonic() - started, outcome="stream_interrupted",
                                            fallback_from=fallback_from, fallback_reason=reason)
