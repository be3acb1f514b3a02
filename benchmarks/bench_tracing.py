"""The cost of tracing (docs/operations.md, "Tracing"): text_embedding's throughput and latency with
tracing off, at the default sampling (parent-based, ``DEFAULT_SAMPLE_RATIO`` of the requests without
a client traceparent) and at 100 %, every span exported to a loopback OTLP receiver that reads and
drops them (so the export's own cost, on the same cores, is in the figures).

Three servers of the same three models, the response cache off (every request is computed; each
one also carries a text of its own). Off and the default sampling alternate three times each
(ABBA: a drift of the machine falls on both alike), then 100 % twice; before each window the
receiver has had nothing for ``QUIET_S`` (the exporters of the window before have drained: a
100 % window's queued spans would otherwise be exported, on the same cores, during the next)."""

from __future__ import annotations

import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from triton_pipelines.server.launcher import start_on_free_ports
from triton_pipelines.telemetry.tracing import DEFAULT_SAMPLE_RATIO

from .bench_text import corpus
from .loadgen import Target, measure, triton_check, triton_request
from .perf import BENCH_DIR, markdown_table
from .settings import current

MODEL = "text_embedding"
MODELS = ["text_tokenizer", "text_encoder", MODEL]
UNIQUE = 6000
MODES = {"off": {}, "default": {"OTEL_TRACES_SAMPLER": "", "OTEL_TRACES_SAMPLER_ARG": ""},
         "100%": {"OTEL_TRACES_SAMPLER": "always_on"}}
ORDER = ("off", "default", "default", "off", "off", "default", "100%", "100%")
QUIET_S = 2.0


class Sink:
    """An OTLP/HTTP receiver on loopback that counts what it is sent and drops it."""

    def __init__(self):
        sink = self
        self.bytes = 0
        self.last = time.monotonic()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                sink.bytes += len(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                sink.last = time.monotonic()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_quiet(self, quiet_s: float = QUIET_S, limit_s: float = 60.0) -> None:
        """Until nothing has arrived for ``quiet_s`` (at most ``limit_s``)."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() - self.last < quiet_s and time.monotonic() < deadline:
            time.sleep(0.2)

    def close(self):
        self.server.shutdown()


def start(repository, label: str, sink: Sink):
    saved = dict(os.environ)
    try:
        if label != "off":
            os.environ.update(OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint, **MODES[label])
        else:
            os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        return start_on_free_ports(repository, BENCH_DIR / f"tracing-{label.rstrip('%')}-server.log", models=MODELS,
                                   response_cache_bytes=0)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run(server) -> str:
    settings = current()
    sink, servers, results = Sink(), {}, {}
    try:
        for label in MODES:
            servers[label] = start(server.options.model_repository, label, sink)
        rows = []
        for concurrency in (1, 8):
            for turn, label in enumerate(ORDER):
                texts = [f"{text} (tracing {concurrency}-{turn}-{i})" for i, text in enumerate(corpus(UNIQUE, seed=5))]
                batch = [triton_request([("text", "BYTES", np.array([[t.encode()]], dtype=object))], ["embedding"])
                         for t in texts]
                url = f"http://{servers[label].http_url}/v2/models/{MODEL}/infer"
                sink.wait_quiet()
                result = measure(Target(f"tracing {label}", url, batch, triton_check), concurrency,
                                 seconds=settings.seconds, min_requests=settings.min_requests)
                results.setdefault((label, concurrency), []).append(result)
                rows.append([label, concurrency, f"{result.throughput:.1f}", f"{result.p50:.1f}", f"{result.p99:.1f}",
                             result.errors])
        costs = span_cost_us(sink.endpoint)
    finally:
        for launched in servers.values():
            launched.stop()
        sink.close()
    lines = [f"- the front's span in process, CPU per request (all threads, its export included): "
             f"{costs['off']:.2f} µs off, {costs['unsampled']:.1f} µs unsampled, {costs['sampled']:.1f} µs sampled"]
    for concurrency in (1, 8):
        off = np.mean([r.throughput for r in results[("off", concurrency)]])
        for label in ("default", "100%"):
            traced = np.mean([r.throughput for r in results[(label, concurrency)]])
            lines.append(f"- concurrency {concurrency}, {label}: {traced:.1f} texts/s against {off:.1f} off "
                         f"({traced / max(off, 1e-9) - 1:+.1%}; means of {len(results[(label, concurrency)])} and "
                         f"{len(results[('off', concurrency)])} windows)")
    return "\n".join([
        "## Tracing",
        "",
        (f"`{MODEL}` over HTTP (binary tensors), one unique text a request, closed loop, response cache off, on "
         f"three servers of the same three models: tracing off, at the default sampling (parent-based, "
         f"{DEFAULT_SAMPLE_RATIO:.0%} of requests without a client traceparent) and at 100 %, spans exported to "
         f"a loopback OTLP receiver ({sink.bytes / 1e6:.1f} MB received). Windows in the order "
         f"{', '.join(ORDER)}. Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores."),
        "",
        markdown_table(["tracing", "concurrency", "texts/s", "p50 ms", "p99 ms", "errors"], rows),
        "",
        "\n".join(lines),
    ])


def span_cost_us(sink_endpoint: str, requests: int = 20000) -> dict[str, float]:
    """CPU µs per request of the front's span in this process (start, the context for Triton,
    x-trace-id, end and its hand-off to the exporter), sampled and not, and with tracing off: what a
    closed-loop window on a shared machine cannot resolve."""
    import time

    from triton_pipelines.telemetry import front, tracing

    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    costs = {}
    for label, environ in (("off", None), ("unsampled", {"OTEL_TRACES_SAMPLER": "always_off"}),
                           ("sampled", {"OTEL_TRACES_SAMPLER": "always_on"})):
        tracing._State.checked, tracing._State.tracer = True, None
        if environ is not None:
            settings = tracing.TraceSettings.from_environment({"OTEL_EXPORTER_OTLP_ENDPOINT": sink_endpoint, **environ})
            tracing._State.tracer = tracing._tracer(settings, "bench")
        started = time.process_time()
        for _ in range(requests):
            traced = front.screen_trace("http", MODEL, None, None)
            traced.http_headers()
            traced.http_answer(answer)
        costs[label] = (time.process_time() - started) / requests * 1e6
    tracing._State.checked, tracing._State.tracer = False, None
    return costs
