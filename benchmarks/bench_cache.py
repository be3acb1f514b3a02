"""The response cache (docs/operations.md, "Response cache"): text_embedding's latency and throughput
on repeated texts (hits) and on texts never sent before (misses), with the cache on and off.

The other benchmarks run on a server with the cache off (their corpora repeat, and they measure
the computation); this one starts a second server with the launcher's default cache on the same
repository, and uses the benchmarks' server as the uncached one. Every "unique" request carries a
text no server has seen (a numbered tag), so it is a miss wherever the cache is on."""

from __future__ import annotations

import os

import numpy as np

from triton_pipelines import prometheus_text
from triton_pipelines.limits import DEFAULT_RESPONSE_CACHE_BYTES
from triton_pipelines.server.launcher import start_on_free_ports

from .bench_text import corpus
from .loadgen import LoadResult, Target, measure, triton_check, triton_request
from .perf import BENCH_DIR, markdown_table
from .settings import current

MODEL = "text_embedding"
MODELS = ["text_tokenizer", "text_encoder", MODEL]
REPEATED = 16  # distinct texts of the repeated traffic (each a hit after its first request)
UNIQUE = 6000  # unique texts per measurement: more than a measurement window sends


def requests(texts: list[str]) -> list:
    return [triton_request([("text", "BYTES", np.array([[t.encode()]], dtype=object))], ["embedding"]) for t in texts]


def unique_texts(tag: str) -> list[str]:
    return [f"{text} (request {tag}-{i})" for i, text in enumerate(corpus(UNIQUE, seed=11))]


CACHE_COUNTERS = ("nv_cache_num_hits_per_model", "nv_cache_num_misses_per_model",
                  "nv_cache_hit_duration_per_model", "nv_cache_miss_duration_per_model")


def hits_and_misses(server) -> tuple[float, ...]:
    """Hits, misses, and their total time inside Triton (µs: a hit's lookup and copy, a miss's
    lookup and insert)."""
    samples = prometheus_text.parse_samples(prometheus_text.scrape(server.metrics_url))
    return tuple(prometheus_text.total(samples, name, model=MODEL) for name in CACHE_COUNTERS)


def measure_one(target_server, label: str, traffic: str, batch: list, concurrency: int) -> tuple[LoadResult, str]:
    """One closed-loop window; with the cache on, the hit ratio over it and the cache's own time per
    hit or miss (from Triton's counters, so the shared machine's noise does not blur it)."""
    settings = current()
    url = f"http://{target_server.http_url}/v2/models/{MODEL}/infer"
    before = hits_and_misses(target_server) if label == "on" else None
    result = measure(Target(f"{traffic} cache {label}", url, batch, triton_check), concurrency,
                     seconds=settings.seconds, min_requests=settings.min_requests)
    if before is None:
        return result, "n/a"
    hits, misses, hit_us, miss_us = (a - b for a, b in zip(hits_and_misses(target_server), before, strict=True))
    own = hit_us / hits if hits >= misses else miss_us / max(misses, 1)
    return result, f"{hits / max(hits + misses, 1):.0%}, {own:.0f} µs"


def run(server) -> str:
    """Two servers of the same three models, the cache on and off (the benchmarks' own server is
    not used: its other models would make the two unequal). Unique traffic is measured on, off,
    off, on (each window with texts of its own) so that a drift of the shared machine falls on both."""
    servers = {}
    try:
        for label, size in (("on", DEFAULT_RESPONSE_CACHE_BYTES), ("off", 0)):
            servers[label] = start_on_free_ports(server.options.model_repository, BENCH_DIR / f"cache-{label}-server.log",
                                                 models=MODELS, response_cache_bytes=size)
        rows, unique = [], {}
        repeated = requests(corpus(REPEATED, seed=7))
        for concurrency in (1, 8):
            for label in ("on", "off"):
                result, ratio = measure_one(servers[label], label, "repeated", repeated, concurrency)
                rows.append(row("repeated", label, concurrency, result, ratio))
            for turn, label in enumerate(("on", "off", "off", "on")):
                batch = requests(unique_texts(f"{concurrency}-{turn}"))
                result, ratio = measure_one(servers[label], label, "unique", batch, concurrency)
                unique.setdefault((label, concurrency), []).append(result)
                rows.append(row("unique", label, concurrency, result, ratio))
    finally:
        for launched in servers.values():
            launched.stop()
    return "\n".join([
        "## Response cache",
        "",
        (f"`{MODEL}` over HTTP (binary tensors), one text a request, closed loop, on two servers of the same "
         f"three models: the cache on ({DEFAULT_RESPONSE_CACHE_BYTES >> 20} MiB, the launcher's default) and off. "
         f"Repeated: {REPEATED} distinct texts in turn (each a hit once sent); unique: texts never sent before "
         "(misses), measured on, off, off, on. Hit ratio and the cache's own time: Triton's nv_cache_* counters "
         f"over the window. Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores."),
        "",
        markdown_table(["traffic", "cache", "concurrency", "texts/s", "p50 ms", "p99 ms",
                        "hit ratio, the cache's time per hit (repeated) or miss (unique)", "errors"], rows),
        "",
        summary(rows, unique),
    ])


def row(traffic: str, label: str, concurrency: int, result: LoadResult, ratio: str) -> list:
    return [traffic, label, concurrency, f"{result.throughput:.1f}", f"{result.p50:.1f}", f"{result.p99:.1f}",
            ratio, result.errors]


def summary(rows: list, unique: dict) -> str:
    lines = []
    for concurrency in (1, 8):
        hit = next(r for r in rows if r[:3] == ["repeated", "on", concurrency])
        computed = next(r for r in rows if r[:3] == ["repeated", "off", concurrency])
        on = np.mean([r.throughput for r in unique[("on", concurrency)]])
        off = np.mean([r.throughput for r in unique[("off", concurrency)]])
        lines.append(f"- concurrency {concurrency}: repeated texts p50 {hit[4]} ms from the cache against "
                     f"{computed[4]} ms computed; unique texts {on:.1f} texts/s with the cache on against "
                     f"{off:.1f} off (mean of two windows each, {on / max(off, 1e-9) - 1:+.0%})")
    return "\n".join(lines)
