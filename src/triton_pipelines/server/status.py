"""What the public ``/metrics`` and ``/v2/health/*`` answer: the launcher's status server and its
own metrics.

- ``LauncherMetrics``: counters of stub repairs, server, nginx and screen restarts, and a gauge of
  each model's readiness, in Prometheus text format (``launcher_*``).
- ``StatusServer``: a loopback HTTP server that nginx routes ``/metrics`` (Triton's metrics plus
  ours) and ``/v2/health/ready|live`` to. Ready means some replica is in service and healthy:
  Triton ready AND no stub dead AND not restarting (``ReplicaSet.not_ready_reasons``), so a load
  balancer or a Kubernetes probe sees what Triton's own readiness does not. With the control key,
  ``POST /v2/replicas/<n>/retire`` (never routed from the public ports).
- ``merge_metrics``: the Prometheus text of several replicas as one, with a ``replica`` label.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from triton_pipelines.server.control import CONTROL_HEADER
from triton_pipelines.prometheus_text import escape_label


class LauncherMetrics:
    """The launcher's counters and gauges (``replica``: which tritonserver, "0" unless --replicas)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.server_restarts: Counter[str] = Counter()
        self.proxy_restarts = 0
        self.screen_restarts = 0
        self.stub_restarts: Counter[str] = Counter()
        self.model_ready: dict[tuple[str, str, str], int] = {}  # (replica, model, version) → 0|1

    def set_ready(self, replica: str, ready: dict[tuple[str, str], int]) -> None:
        with self.lock:
            self.model_ready = {k: v for k, v in self.model_ready.items() if k[0] != replica}
            self.model_ready.update({(replica, model, version): state for (model, version), state in ready.items()})

    def render(self, replicas: list[str]) -> str:
        with self.lock:
            lines = [
                "# HELP launcher_tritonserver_restarts_total tritonserver processes restarted by the launcher "
                "after an unexpected exit",
                "# TYPE launcher_tritonserver_restarts_total counter",
            ]
            lines += [f'launcher_tritonserver_restarts_total{{replica="{r}"}} {self.server_restarts.get(r, 0)}'
                      for r in replicas]
            lines += [
                "# HELP launcher_proxy_restarts_total nginx (the public front) restarted after an unexpected exit",
                "# TYPE launcher_proxy_restarts_total counter",
                f"launcher_proxy_restarts_total {self.proxy_restarts}",
                "# HELP launcher_screen_restarts_total request screens (screen_server.py) restarted after an "
                "unexpected exit",
                "# TYPE launcher_screen_restarts_total counter",
                f"launcher_screen_restarts_total {self.screen_restarts}",
                "# HELP launcher_stub_restarts_total Models reloaded because one of their Python-backend stub "
                "processes died",
                "# TYPE launcher_stub_restarts_total counter",
            ]
            # Every model from the start (at 0): a counter first seen at 1 hides that first restart
            # from rate() and increase().
            models = set(self.stub_restarts) | {model for _, model, _ in self.model_ready}
            lines += [f'launcher_stub_restarts_total{{model="{escape_label(m)}"}} {self.stub_restarts.get(m, 0)}'
                      for m in sorted(models)]
            lines += ["# HELP launcher_model_ready 1 when the model version is READY and all its Python stubs "
                      "are alive, else 0",
                      "# TYPE launcher_model_ready gauge"]
            lines += [f'launcher_model_ready{{replica="{r}",model="{escape_label(m)}",version="{escape_label(v)}"}} {state}'
                      for (r, m, v), state in sorted(self.model_ready.items())]
        return "\n".join(lines) + "\n"


class StatusServer:
    """Loopback HTTP server for nginx: ``/metrics`` and ``/v2/health/ready|live``; and, for our
    tools with the control key, ``POST /v2/replicas/<n>/retire`` (never routed from the public ports)."""

    def __init__(self, sources: Callable[[], list[tuple[str, str]]], live: Callable[[], bool],
                 not_ready: Callable[[], list[str]], metrics: Callable[[], str],
                 retire: Callable[[int], str] | None = None, key: str = "", label_replicas: bool = False):
        status = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self.reply(200, status.metrics_text(), "text/plain; version=0.0.4; charset=utf-8")
                elif path == "/v2/health/live":
                    ok = live()
                    self.reply(200 if ok else 503, b"" if ok else json.dumps(
                        {"error": "the launcher is stopping"}).encode())
                elif path == "/v2/health/ready":
                    reasons = not_ready()
                    self.reply(503 if reasons else 200,
                               json.dumps({"error": "not ready: " + "; ".join(reasons)}).encode() if reasons else b"")
                else:
                    self.reply(404, b'{"error":"not found"}')

            do_HEAD = do_GET

            def do_POST(self):
                parts = self.path.strip("/").split("/")
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if retire is None or len(parts) != 4 or parts[:2] != ["v2", "replicas"] or parts[3] != "retire":
                    return self.reply(404, b'{"error":"not found"}')
                if not key or self.headers.get(CONTROL_HEADER) != key:
                    return self.reply(403, json.dumps({"error": f"this API needs the header '{CONTROL_HEADER}'"}).encode())
                try:
                    self.reply(200, json.dumps({"retired": retire(int(parts[2]))}).encode())
                except (ValueError, IndexError) as error:
                    self.reply(400, json.dumps({"error": str(error)}).encode())

            def reply(self, code: int, body: bytes, content_type: str = "application/json"):
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):  # a caller that hung up: nothing to say
                pass

        self.sources = sources  # → [(replica label, host:port of its Triton metrics)]
        self.label_replicas = label_replicas
        self.metrics = metrics
        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="status-server", daemon=True)
        self.thread.start()

    def metrics_text(self) -> bytes:
        sources = self.sources()
        texts = []
        for replica, address in sources:
            try:
                with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
                    texts.append((replica, response.read().decode(errors="replace")))
            except (urllib.error.URLError, OSError):
                pass
        if not self.label_replicas:  # one tritonserver: its metrics exactly as Triton writes them
            triton = texts[0][1] if texts else ""
        else:
            triton = merge_metrics(texts)
        return (triton + self.metrics()).encode()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def merge_metrics(texts: list[tuple[str, str]], label: str = "replica") -> str:
    """Prometheus text of several tritonservers as one: every sample gains ``label``, each family's
    HELP/TYPE appears once with all its samples after it (the exposition format wants families whole)."""
    families: dict[str, list[str]] = {}
    headers: dict[str, list[str]] = {}
    for value, text in texts:
        family = ""
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                known = headers.setdefault(family, [])
                if line not in known and len(known) < 2:
                    known.append(line)
                families.setdefault(family, [])
            elif line and not line.startswith("#"):
                name, _, rest = line.partition("{")
                if rest:
                    sample = f'{name}{{{label}="{value}",{rest}'
                else:
                    metric, _, number = line.partition(" ")
                    sample = f'{metric}{{{label}="{value}"}} {number}'
                families.setdefault(family or name, []).append(sample)
    lines = []
    for family, samples in families.items():
        lines += headers.get(family, []) + samples
    return "\n".join(lines) + "\n"
