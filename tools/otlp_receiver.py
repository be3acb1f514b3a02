"""An OTLP/HTTP trace receiver for the tests and `make rehearse`: ``POST /v1/traces`` with an
``ExportTraceServiceRequest`` in protobuf, decoded with ``opentelemetry-proto`` (the real schema),
its spans kept as plain ``ReceivedSpan`` rows. ``delay_s`` makes it a slow receiver. It listens on
loopback unless ``host`` says otherwise (the rehearsal's containers reach it on the host's address).

    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, ...}
        ...
        spans = receiver.wait_for_trace(trace_id, lambda spans: ...)
"""

from __future__ import annotations

import base64
import gzip
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


@dataclass
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    service: str  # the resource's service.name
    process: str  # the resource's triton_pipelines.process (tritonserver's too)
    kind: int
    start_ns: int
    end_ns: int
    status_code: int  # 0 unset, 1 ok, 2 error
    attributes: dict = field(default_factory=dict)
    events: list = field(default_factory=list)  # (name, time_ns): tritonserver's timestamps
    trace_state: str = ""


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return None if kind is None else getattr(any_value, kind)


_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _ids_to_base64(document):
    """OTLP/JSON writes trace and span ids in hex; protobuf's JSON reader wants bytes in base64."""
    if isinstance(document, dict):
        return {key: (base64.b64encode(bytes.fromhex(value)).decode() if key in _ID_FIELDS and value else
                      _ids_to_base64(value)) for key, value in document.items()}
    if isinstance(document, list):
        return [_ids_to_base64(item) for item in document]
    return document


def decode(body: bytes, content_type: str = "application/x-protobuf") -> list[ReceivedSpan]:
    """An ExportTraceServiceRequest, in protobuf (our processes) or OTLP/JSON (tritonserver's
    exporter, opentelemetry-cpp, sends JSON), read with the real schema."""
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    if content_type.startswith("application/json"):
        json_format.ParseDict(_ids_to_base64(json.loads(body)), request)
    else:
        request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), span.name,
                    str(resource.get("service.name", "")), str(resource.get("triton_pipelines.process", "")),
                    span.kind, span.start_time_unix_nano, span.end_time_unix_nano, span.status.code,
                    {a.key: _value(a.value) for a in span.attributes},
                    [(e.name, e.time_unix_nano) for e in span.events], span.trace_state))
    return spans


class OtlpReceiver:
    def __init__(self, delay_s: float = 0.0, host: str = "127.0.0.1"):
        self.delay_s = delay_s
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if receiver.delay_s:
                    time.sleep(receiver.delay_s)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                spans = decode(body, self.headers.get("Content-Type") or "")
                with receiver.lock:
                    receiver.requests += 1
                    receiver.spans.extend(spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.endpoint = f"http://{host}:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for_trace(self, trace_id: str, done: Callable[[list[ReceivedSpan]], bool],
                       timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """The trace's spans once ``done(spans)`` holds (or, after ``timeout_s``, what came)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if done(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "OtlpReceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# The spans one traced ``text_embedding`` request makes, (span name, process): the screen's, tritonserver's
# (the request, the ensemble, each composing model) and each stub's (tests/server/test_tracing.py and
# `make rehearse`, from inside the containers).
EMBEDDING_TREE = [("screen text_embedding", "screen"), ("InferRequest", "tritonserver"),
                  ("text_embedding", "tritonserver"), ("text_tokenizer", "tritonserver"),
                  ("text_encoder", "tritonserver"), ("text_tokenizer", "stub"), ("text_encoder", "stub")]


def missing_spans(spans: list[ReceivedSpan], wanted: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (span name, process) pairs of ``wanted`` that ``spans`` lack."""
    return [(name, process) for name, process in wanted
            if not any(s.name == name and s.process == process for s in spans)]


def tree_problems(spans: list[ReceivedSpan], root_parent: str = "") -> list[str]:
    """What keeps ``spans`` from being one tree: every span's parent is in the trace, except one
    root whose parent is ``root_parent`` (the client's span id, or "" for none)."""
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if s.parent_span_id not in ids]
    problems = []
    if len({s.trace_id for s in spans}) > 1:
        problems.append("more than one trace id")
    if len(roots) != 1:
        problems.append(f"{len(roots)} roots: {[(r.name, r.parent_span_id) for r in roots]}")
    elif roots[0].parent_span_id != root_parent:
        problems.append(f"the root {roots[0].name} has parent {roots[0].parent_span_id!r}, not {root_parent!r}")
    return problems


def describe(spans: list[ReceivedSpan]) -> str:
    """The trace as an indented tree: process, span name, duration (docs/operations.md prints one)."""
    children: dict[str, list[ReceivedSpan]] = {}
    ids = {s.span_id for s in spans}
    for span in sorted(spans, key=lambda s: s.start_ns):
        children.setdefault(span.parent_span_id if span.parent_span_id in ids else "", []).append(span)
    lines = []

    def walk(parent: str, depth: int) -> None:
        for span in children.get(parent, []):
            lines.append(f"{'  ' * depth}{span.name}  [{span.process or span.service}]  "
                         f"{(span.end_ns - span.start_ns) / 1e6:.2f} ms")
            walk(span.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)
