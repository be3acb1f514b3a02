"""The router: latency classes at the same load (p99 for realtime, throughput for
batch), the router's own overhead over calling the ensemble directly, and how many gateway calls
it serves at once (a local fake gateway answering after a fixed delay)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from triton_pipelines.client import TritonClient, text_tensor
from triton_pipelines.server.launcher import start_on_free_ports

from .bench_text import corpus, text_input_data
from .perf import BENCH_DIR, markdown_table, perf_analyzer

ROOT = Path(__file__).resolve().parents[1]
LOAD = 16  # concurrent requests for the latency-class comparison
GATEWAY_DELAY_S = 0.2


def router_input_data(task: str, texts: list[str], latency_class: str) -> Path:
    BENCH_DIR.mkdir(exist_ok=True)
    path = BENCH_DIR / f"router_{task}_{latency_class}.json"
    path.write_text(json.dumps({"data": [
        {"task": {"content": [task], "shape": [1]},
         "payload": {"content": [json.dumps({"text": t})], "shape": [1]},
         "latency_class": {"content": [latency_class], "shape": [1]}} for t in texts]}))
    return path


def latency_classes(server, texts: list[str]) -> str:
    rows = []
    for latency_class in ("realtime", "batch"):
        row = perf_analyzer("router", server.grpc_url, LOAD,
                            input_data=router_input_data("text_embedding", texts, latency_class))
        rows.append([f"router → text_embedding, `{latency_class}`", LOAD, row.throughput, row.p50_ms, row.p99_ms])
    for model in ("text_embedding", "text_embedding_batch"):
        row = perf_analyzer(model, server.grpc_url, LOAD, input_data=text_input_data(texts))
        rows.append([f"`{model}` directly", LOAD, row.throughput, row.p50_ms, row.p99_ms])
    return markdown_table(["path", "concurrency", "texts/s", "p50 ms", "p99 ms"], rows)


def overhead(server, texts: list[str]) -> str:
    rows = []
    for concurrency in (1, 8):
        direct = perf_analyzer("text_classification", server.grpc_url, concurrency, input_data=text_input_data(texts))
        routed = perf_analyzer("router", server.grpc_url, concurrency,
                               input_data=router_input_data("text_classification", texts, "realtime"))
        rows.append([concurrency, direct.throughput, routed.throughput, direct.p50_ms, routed.p50_ms,
                     routed.p50_ms - direct.p50_ms])
    return markdown_table(["concurrency", "direct texts/s", "router texts/s", "direct p50 ms", "router p50 ms",
                           "router overhead p50 ms"], rows)


def gateway_concurrency(repository: Path) -> str:
    """A router-only server whose gateway is the tests' fake, answering after GATEWAY_DELAY_S."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_gateway import FakeGateway, Reply

    fake = FakeGateway().start()
    fake.default = Reply(delay_s=GATEWAY_DELAY_S)
    scratch = Path(tempfile.mkdtemp(prefix="bench-router-"))
    shutil.copytree(repository / "router", scratch / "router", ignore=shutil.ignore_patterns("splits.json"))
    saved = {k: os.environ.get(k) for k in ("LLM_GATEWAY_BASE_URL", "LLM_GATEWAY_API_KEY")}
    os.environ.update(LLM_GATEWAY_BASE_URL=fake.base_url, LLM_GATEWAY_API_KEY="sk-bench")
    try:
        server = start_on_free_ports(scratch, BENCH_DIR / "router-gateway-server.log", response_cache_bytes=0)
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    rows = []
    try:
        local = threading.local()

        def one(i):
            if not hasattr(local, "client"):
                local.client = TritonClient("grpc", server.grpc_url)
            started = time.perf_counter()
            local.client.infer("router", {"task": text_tensor(["general_llm"]),
                                          "payload": text_tensor([json.dumps({"text": f"q{i}"})])})
            return time.perf_counter() - started

        for in_flight in (1, 4, 16, 32):
            with ThreadPoolExecutor(in_flight) as pool:
                list(pool.map(one, range(in_flight)))  # warm the clients
                started = time.perf_counter()
                latencies = list(pool.map(one, range(in_flight * 4)))
                wall = time.perf_counter() - started
            rows.append([in_flight, in_flight * 4, wall, in_flight * 4 / wall,
                         statistics.median(latencies) * 1000, max(latencies) * 1000])
    finally:
        server.stop()
        fake.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return markdown_table(["requests in flight", "requests", "wall s", "requests/s", "p50 ms", "max ms"], rows)


def run(server) -> str:
    repository = Path(server.options.model_repository)
    texts = corpus(64)
    split = repository / "router" / "splits.json"
    split.write_text(json.dumps({"text_encoder": {"1": 100}}))  # stable version only while measuring
    try:
        classes = latency_classes(server, texts)
        cost = overhead(server, texts)
    finally:
        split.unlink(missing_ok=True)
    gateway = gateway_concurrency(repository)
    return f"""## Router

### Latency classes at the same load ({LOAD} concurrent requests, gRPC, perf_analyzer)

`realtime` goes to `text_embedding` (the encoder's own batching: no queue delay); `batch` goes to
`text_embedding_batch` → `text_encoder_batch` (preferred batch sizes 16/32, 20 ms queue delay,
`preserve_ordering`), the same ONNX weights.

{classes}

### Router overhead (text_classification, realtime)

{cost}

### Gateway calls in flight at once (fake gateway on 127.0.0.1 answering after {GATEWAY_DELAY_S * 1000:.0f} ms)

Serial service would take {GATEWAY_DELAY_S * 1000:.0f} ms x requests; the router serves a batch's
requests concurrently (async execute, gateway calls on a thread pool) on 2 instances.

{gateway}
"""
