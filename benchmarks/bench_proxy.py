"""What the public front (nginx, and for inference the request screen) costs: the same perf_analyzer
run against Triton's own loopback port and against the public port, back to back, on both protocols.

The model is ``text_tokenizer`` (a small Python model: the proxy's share is largest where the work is
smallest); pairs are measured alternately and the median difference is reported."""

from __future__ import annotations

import statistics

from .bench_text import corpus, text_input_data
from .perf import markdown_table, perf_analyzer

MODEL = "text_tokenizer"
PAIRS = 3


def run(server) -> str:
    data = text_input_data(corpus())
    internal = {"http": server.control.http_url, "grpc": f"127.0.0.1:{server.internal.grpc}"}
    rows, summary = [], {}
    for protocol in ("grpc", "http"):
        for concurrency in (1, 8):
            pairs = []
            for _ in range(PAIRS):
                direct = perf_analyzer(MODEL, internal[protocol], concurrency, input_data=data, protocol=protocol)
                proxied = perf_analyzer(MODEL, server.url(protocol), concurrency, input_data=data, protocol=protocol)
                pairs.append((direct, proxied))
            added = statistics.median(p.p50_ms - d.p50_ms for d, p in pairs)
            ratio = statistics.median(p.throughput / d.throughput for d, p in pairs)
            summary[(protocol, concurrency)] = added
            rows.append([protocol, concurrency, statistics.median(d.p50_ms for d, _ in pairs),
                         statistics.median(p.p50_ms for _, p in pairs), f"{added * 1000:+.0f} µs",
                         f"{ratio:.0%}"])
    table = markdown_table(["protocol", "concurrency", "p50 direct (ms)", "p50 through the front (ms)",
                            "added p50 (median of pairs)", "throughput through the front / direct"], rows)
    return (f"## The public front (nginx and the request screen)\n\n"
            f"`perf_analyzer` on `{MODEL}`, Triton's own loopback port against the public port (nginx, then "
            f"the replica's request screen, which parses each inference request), {PAIRS} back-to-back "
            f"pairs per row. The front adds {summary[('grpc', 1)] * 1000:+.0f} µs (gRPC) and "
            f"{summary[('http', 1)] * 1000:+.0f} µs (HTTP) to the p50 of one request at a time.\n\n{table}")
