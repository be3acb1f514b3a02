"""The response cache (docs/operations.md, "Response cache"): text_embedding's latency and throughput
on repeated texts (hits) and on texts never sent before (misses), with the cache on and off; the
same for image_classification (its nested image_logits is the cached step) on repeated and new images.

The other benchmarks run on a server with the cache off (their corpora repeat, and they measure
the computation); this one starts a second server with the launcher's default cache on the same
repository, and uses the benchmarks' server as the uncached one. Every "unique" request carries a
text no server has seen (a numbered tag), so it is a miss wherever the cache is on."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable

import numpy as np

from triton_pipelines import prometheus_text
from triton_pipelines.limits import DEFAULT_RESPONSE_CACHE_BYTES
from triton_pipelines.server.launcher import start_on_free_ports

from .bench_text import corpus
from .loadgen import LoadResult, Target, measure, triton_check, triton_request
from .perf import BENCH_DIR, markdown_table
from .settings import current

ROOT = Path(__file__).resolve().parents[1]

REPEATED = 16  # distinct inputs of the repeated traffic (each a hit after its first request)
UNIQUE = 6000  # unique inputs per measurement: more than a measurement window sends


@dataclasses.dataclass(frozen=True)
class Workload:
    """One cached pipeline: the model called, the models its servers load, the model whose cache
    answers (its nv_cache_* counters), and its repeated and unique requests."""
    model: str
    models: tuple[str, ...]
    cached: str
    unit: str
    repeated: Callable[[], list]
    unique: Callable[[str], list]


def text_requests(texts: list[str]) -> list:
    return [triton_request([("text", "BYTES", np.array([[t.encode()]], dtype=object))], ["embedding"]) for t in texts]


def image_requests(tag: str, count: int) -> list:
    """Photos of the test data, each made a new key by a tag after the file's end (JPEG decoders
    stop at the end-of-image marker: the same pixels, another cache entry)."""
    photos = [path.read_bytes() for path in sorted((ROOT / "tests" / "data").glob("scene*.jpg"))]
    return [triton_request([("image", "BYTES", np.array([[photos[i % len(photos)] + f"|{tag}|{i}".encode()]],
                                                          dtype=object))], ["labels", "scores"])
            for i in range(count)]


TEXT = Workload("text_embedding", ("text_tokenizer", "text_encoder", "text_embedding"), "text_embedding", "texts",
                lambda: text_requests(corpus(REPEATED, seed=7)),
                lambda tag: text_requests([f"{text} (request {tag}-{i})" for i, text in enumerate(corpus(UNIQUE, seed=11))]))
IMAGE = Workload("image_classification", ("image_preprocess", "efficientnet_lite0", "classification_postprocess",
                                           "image_logits", "image_classification"), "image_logits", "images",
                 lambda: image_requests("r", REPEATED), lambda tag: image_requests(tag, 1500))


CACHE_COUNTERS = ("nv_cache_num_hits_per_model", "nv_cache_num_misses_per_model",
                  "nv_cache_hit_duration_per_model", "nv_cache_miss_duration_per_model")


def hits_and_misses(server, model: str) -> tuple[float, ...]:
    """Hits, misses, and their total time inside Triton (µs: a hit's lookup and copy, a miss's
    lookup and insert)."""
    samples = prometheus_text.parse_samples(prometheus_text.scrape(server.metrics_url))
    return tuple(prometheus_text.total(samples, name, model=model) for name in CACHE_COUNTERS)


def measure_one(work: Workload, target_server, label: str, traffic: str, batch: list,
                concurrency: int) -> tuple[LoadResult, str]:
    """One closed-loop window; with the cache on, the hit ratio over it and the cache's own time per
    hit or miss (from Triton's counters, so the shared machine's noise does not blur it)."""
    settings = current()
    url = f"http://{target_server.http_url}/v2/models/{work.model}/infer"
    before = hits_and_misses(target_server, work.cached) if label == "on" else None
    result = measure(Target(f"{traffic} cache {label}", url, batch, triton_check), concurrency,
                     seconds=settings.seconds, min_requests=settings.min_requests)
    if before is None:
        return result, "n/a"
    hits, misses, hit_us, miss_us = (a - b for a, b in zip(hits_and_misses(target_server, work.cached), before,
                                                           strict=True))
    own = hit_us / hits if hits >= misses else miss_us / max(misses, 1)
    return result, f"{hits / max(hits + misses, 1):.0%}, {own:.0f} µs"


def run(server) -> str:
    return "\n".join(["## Response cache", "", *measure_workload(server, TEXT), "", *measure_workload(server, IMAGE)])


def measure_workload(server, work: Workload) -> list[str]:
    """Two servers of the same few models, the cache on and off (the benchmarks' own server is
    not used: its other models would make the two unequal). Unique traffic is measured on, off,
    off, on (each window with inputs of its own) so that a drift of the shared machine falls on both."""
    servers = {}
    try:
        for label, size in (("on", DEFAULT_RESPONSE_CACHE_BYTES), ("off", 0)):
            servers[label] = start_on_free_ports(server.options.model_repository,
                                                 BENCH_DIR / f"cache-{work.model}-{label}-server.log",
                                                 models=list(work.models), response_cache_bytes=size)
        rows, unique = [], {}
        repeated = work.repeated()
        for concurrency in (1, 8):
            for label in ("on", "off"):
                result, ratio = measure_one(work, servers[label], label, "repeated", repeated, concurrency)
                rows.append(row("repeated", label, concurrency, result, ratio))
            for turn, label in enumerate(("on", "off", "off", "on")):
                batch = work.unique(f"{concurrency}-{turn}")
                result, ratio = measure_one(work, servers[label], label, "unique", batch, concurrency)
                unique.setdefault((label, concurrency), []).append(result)
                rows.append(row("unique", label, concurrency, result, ratio))
    finally:
        for launched in servers.values():
            launched.stop()
    return [
        f"### `{work.model}` (cached: `{work.cached}`)",
        "",
        (f"`{work.model}` over HTTP (binary tensors), one input a request, closed loop, on two servers of the same "
         f"models: the cache on ({DEFAULT_RESPONSE_CACHE_BYTES >> 20} MiB, the launcher's default) and off. "
         f"Repeated: {REPEATED} distinct {work.unit} in turn (each a hit once sent); unique: {work.unit} never sent "
         "before (misses), measured on, off, off, on. Hit ratio and the cache's own time: Triton's nv_cache_* "
         f"counters of `{work.cached}` over the window. Load average at the end: {os.getloadavg()[0]:.1f} on "
         f"{os.cpu_count()} cores."),
        "",
        markdown_table(["traffic", "cache", "concurrency", f"{work.unit}/s", "p50 ms", "p99 ms",
                        "hit ratio, the cache's time per hit (repeated) or miss (unique)", "errors"], rows),
        "",
        summary(rows, unique, work.unit),
    ]


def row(traffic: str, label: str, concurrency: int, result: LoadResult, ratio: str) -> list:
    return [traffic, label, concurrency, f"{result.throughput:.1f}", f"{result.p50:.1f}", f"{result.p99:.1f}",
            ratio, result.errors]


def summary(rows: list, unique: dict, unit: str) -> str:
    lines = []
    for concurrency in (1, 8):
        hit = next(r for r in rows if r[:3] == ["repeated", "on", concurrency])
        computed = next(r for r in rows if r[:3] == ["repeated", "off", concurrency])
        on = np.mean([r.throughput for r in unique[("on", concurrency)]])
        off = np.mean([r.throughput for r in unique[("off", concurrency)]])
        lines.append(f"- concurrency {concurrency}: repeated {unit} p50 {hit[4]} ms from the cache against "
                     f"{computed[4]} ms computed; unique {unit} {on:.1f} {unit}/s with the cache on against "
                     f"{off:.1f} off (mean of two windows each, {on / max(off, 1e-9) - 1:+.0%})")
    return "\n".join(lines)
