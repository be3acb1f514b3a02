"""One closed-loop load generator for Triton and for every peer.

``concurrency`` workers each send a request, wait for the whole response, and send the next: the
same shape of load as perf_analyzer's concurrency mode. Every target gets its requests as prepared
HTTP bodies (binary: Triton's binary tensor protocol, raw bytes for the peers) posted by the same
aiohttp client on the same event loop, so a difference between two targets is the server's.

Requests of the warm-up are not counted; a measurement lasts ``seconds`` and at least
``min_requests`` responses (a slow pipeline is measured on enough requests, not on one or two).
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np


@dataclass
class Request:
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    items: int = 1  # inferences carried (texts, images, clips)


@dataclass
class Target:
    """An endpoint and the requests to cycle through. ``check(status, body)`` raises on a bad
    answer (run on the first response of every measurement, so a broken peer cannot look fast)."""
    name: str
    url: str
    requests: Sequence[Request]
    check: Callable[[int, bytes], None] | None = None


@dataclass
class LoadResult:
    target: str
    concurrency: int
    requests: int
    items: int
    seconds: float
    latencies_ms: list[float]
    errors: int = 0
    first_error: str = ""

    @property
    def throughput(self) -> float:
        """Inferences (items) per second."""
        return self.items / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else float("nan")

    @property
    def p50(self) -> float:
        return self.percentile(50)

    @property
    def p95(self) -> float:
        return self.percentile(95)

    @property
    def p99(self) -> float:
        return self.percentile(99)

    @property
    def mean(self) -> float:
        return float(np.mean(self.latencies_ms)) if self.latencies_ms else float("nan")

    def as_dict(self) -> dict:
        return {"target": self.target, "concurrency": self.concurrency, "throughput": self.throughput,
                "mean_ms": self.mean, "p50_ms": self.p50, "p95_ms": self.p95, "p99_ms": self.p99,
                "requests": self.requests, "errors": self.errors}


def bytes_tensor(items: Sequence[bytes]) -> bytes:
    """Triton's serialization of a BYTES tensor (4-byte little-endian length, then the bytes, per
    element): the peers take the same bytes as their request body."""
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def split_bytes_tensor(body: bytes) -> list[bytes]:
    items, offset = [], 0
    while offset < len(body):
        if offset + 4 > len(body):
            raise ValueError("truncated length prefix")
        (length,) = struct.unpack_from("<I", body, offset)
        offset += 4
        if offset + length > len(body):
            raise ValueError("truncated element")
        items.append(body[offset:offset + length])
        offset += length
    return items


def triton_request(inputs: Sequence[tuple[str, str, np.ndarray]], outputs: Sequence[str],
                   parameters: dict | None = None) -> Request:
    """A binary-tensor HTTP inference request (tritonclient's own encoder): ``inputs`` are
    (name, datatype, array); every output is asked for in binary form."""
    import tritonclient.http as httpclient

    tensors = []
    for name, datatype, array in inputs:
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=True)
        tensors.append(tensor)
    wanted = [httpclient.InferRequestedOutput(name, binary_data=True) for name in outputs]
    body, json_size = httpclient.InferenceServerClient.generate_request_body(tensors, wanted, parameters=parameters)
    headers = {"Content-Type": "application/octet-stream"}
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    items = int(inputs[0][2].shape[0])
    return Request(body if isinstance(body, bytes) else body.encode(), headers, items)


def triton_check(status: int, body: bytes) -> None:
    if status != 200:
        raise RuntimeError(f"Triton answered {status}: {body[:300]!r}")


async def _measure(target: Target, concurrency: int, seconds: float, warmup_s: float, min_requests: int,
                   max_seconds: float) -> LoadResult:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=max(120.0, max_seconds))
    latencies: list[float] = []
    counted = {"requests": 0, "items": 0, "errors": 0, "first_error": ""}
    next_index = [0]
    phase = {"measuring": False, "stop": False}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if target.check is not None:  # one checked request before any timing
            request = target.requests[0]
            async with session.post(target.url, data=request.body, headers=request.headers) as response:
                target.check(response.status, await response.read())

        async def worker():
            while not phase["stop"]:
                request = target.requests[next_index[0] % len(target.requests)]
                next_index[0] += 1
                started = time.perf_counter()
                try:
                    async with session.post(target.url, data=request.body, headers=request.headers) as response:
                        body = await response.read()
                        ok = response.status == 200
                        error = "" if ok else f"{response.status}: {body[:200]!r}"
                except Exception as exc:  # counted, the loop goes on
                    ok, error = False, repr(exc)
                elapsed = (time.perf_counter() - started) * 1000
                if phase["measuring"] and not phase["stop"]:
                    if ok:
                        latencies.append(elapsed)
                        counted["requests"] += 1
                        counted["items"] += request.items
                    else:
                        counted["errors"] += 1
                        counted["first_error"] = counted["first_error"] or error

        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        await asyncio.sleep(warmup_s)
        phase["measuring"] = True
        started = time.perf_counter()
        while True:
            await asyncio.sleep(0.05)
            elapsed = time.perf_counter() - started
            if (elapsed >= seconds and counted["requests"] >= min_requests) or elapsed >= max_seconds:
                break
        phase["stop"] = True
        measured = time.perf_counter() - started
        # Requests still in flight finish but are not counted: the window is closed.
        await asyncio.gather(*workers, return_exceptions=True)
    return LoadResult(target.name, concurrency, counted["requests"], counted["items"], measured, latencies,
                      counted["errors"], counted["first_error"])


def measure(target: Target, concurrency: int, seconds: float = 5.0, warmup_s: float = 1.0,
            min_requests: int = 20, max_seconds: float | None = None) -> LoadResult:
    """One closed-loop measurement at a fixed concurrency."""
    max_seconds = max_seconds if max_seconds is not None else max(seconds * 6, 60.0)
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is in requirements-bench.txt
        runner = asyncio.run
    return runner(_measure(target, concurrency, seconds, warmup_s, min_requests, max_seconds))


def json_request(document: dict, items: int = 1) -> Request:
    return Request(json.dumps(document).encode(), {"Content-Type": "application/json"}, items)
