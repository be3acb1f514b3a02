"""The asyncio micro-batcher of the FastAPI peers: what a careful engineer puts in front of an ONNX
Runtime session instead of running one request at a time.

Requests wait in one queue; a single consumer takes the first, then everything else already queued
(up to ``max_items`` inferences, waiting at most ``max_wait_ms`` for more), runs the batch on a
worker thread (the event loop keeps accepting requests meanwhile) and resolves each request's future
with its own part of the result. With ``max_wait_ms=0`` the batch is whatever arrived while the
previous batch ran: no added latency at low load, large batches at high load."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence


class MicroBatcher:
    def __init__(self, run_batch: Callable[[Sequence[Any]], Sequence[Any]], max_items: int,
                 max_wait_ms: float = 0.0, size: Callable[[Any], int] = lambda item: 1):
        """``run_batch(items) -> results`` (one result per item, same order) runs on the worker thread."""
        self.run_batch = run_batch
        self.max_items = max_items
        self.max_wait_s = max_wait_ms / 1000.0
        self.size = size
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None
        self.carry = None  # a request that did not fit the last batch: first of the next
        self.batches = 0
        self.items = 0

    async def start(self) -> None:
        self.queue = asyncio.Queue()
        self.task = asyncio.create_task(self._consume())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, item: Any) -> Any:
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((item, future))
        return await future

    async def _consume(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.carry is not None:
                (item, future), self.carry = self.carry, None
            else:
                item, future = await self.queue.get()
            batch, count = [(item, future)], self.size(item)
            deadline = loop.time() + self.max_wait_s
            while count < self.max_items:
                try:
                    queued = self.queue.get_nowait()
                except asyncio.QueueEmpty:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    try:
                        queued = await asyncio.wait_for(self.queue.get(), remaining)
                    except asyncio.TimeoutError:
                        break
                if count + self.size(queued[0]) > self.max_items:
                    self.carry = queued
                    break
                batch.append(queued)
                count += self.size(queued[0])
            batch = [(i, f) for i, f in batch if not f.cancelled()]
            if not batch:
                continue
            try:
                results = await loop.run_in_executor(self.executor, self.run_batch, [i for i, _ in batch])
            except Exception as error:  # the batch fails, the service goes on
                for _, f in batch:
                    if not f.done():
                        f.set_exception(error)
                continue
            self.batches += 1
            self.items += count
            for (_, f), result in zip(batch, results):
                if not f.done():
                    f.set_result(result)
