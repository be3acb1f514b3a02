"""What keeps the server healthy without an operator: the stub watchdog, the launcher's metrics and
the status server behind the public ``/metrics`` and ``/v2/health/*``.

- ``StubWatchdog``: Triton does not restart a Python-backend stub that died (OOM kill, a crash in a
  native library, ``kill -9``): the model stays READY while every request to it fails with "Stub
  process ... is not healthy", and ``load`` is a no-op for it. The watchdog compares the stubs each
  READY model had with the live ones (``/proc``), and reloads a model that lost one with its own
  config plus a new ``watchdog_generation`` parameter: a changed config makes Triton load new
  instances and swap them in (no moment without the model, so ensembles calling it never see it
  missing). Triton 2.51 never releases the old instance once its dead stub has failed a request
  (its unload waits forever): those models are remembered as ``leaked`` so the stop does not
  wait for them.
- ``LauncherMetrics``: counters of those repairs and of server restarts, in Prometheus text format.
- ``StatusServer``: a loopback HTTP server that nginx routes ``/metrics`` (Triton's metrics plus
  ours) and ``/v2/health/ready|live`` to. Ready means Triton is ready AND no stub is dead AND the
  server is not restarting, so a load balancer or a Kubernetes probe sees what Triton's own
  readiness does not.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from .control import CONTROL_HEADER, ControlClient, ControlError
from .processes import Stub, find_stubs


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


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
            lines += [f'launcher_stub_restarts_total{{model="{_escape(m)}"}} {self.stub_restarts.get(m, 0)}'
                      for m in sorted(models)]
            lines += ["# HELP launcher_model_ready 1 when the model version is READY and all its Python stubs "
                      "are alive, else 0",
                      "# TYPE launcher_model_ready gauge"]
            lines += [f'launcher_model_ready{{replica="{r}",model="{_escape(m)}",version="{_escape(v)}"}} {state}'
                      for (r, m, v), state in sorted(self.model_ready.items())]
        return "\n".join(lines) + "\n"


class StubWatchdog:
    """Finds models whose Python stubs died (``detect``) and reloads them (``repair``); the launcher
    calls both periodically, and routes around a replica with a dead stub meanwhile."""

    def __init__(self, control: ControlClient, server_pid: Callable[[], int], metrics: LauncherMetrics,
                 log: Callable[[str], None], replica: str = "0", reload_timeout_s: float = 120.0,
                 confirm_s: float = 1.0):
        self.control = control
        self.server_pid = server_pid
        self.metrics = metrics
        self.log = log
        self.replica = replica
        self.reload_timeout_s = reload_timeout_s
        # A stub missing this long is dead: a reload by someone else (a config change unloads the old
        # instance, then starts the new one's stub) leaves a gap of a fraction of a second.
        self.confirm_s = confirm_s
        # (model, version) → identities of the stubs it had while READY
        self.expected: dict[tuple[str, str], set[tuple[str, str, str]]] = {}
        self.missing_since: dict[tuple[str, str, str], float] = {}
        self.dead: dict[str, list[str]] = {}  # model → dead instance names (until repaired)
        self.leaked: set[str] = set()  # models with an instance Triton will never finish unloading
        self.generation = 0

    def reset(self) -> None:
        """A new server process: nothing is expected of it yet."""
        self.expected.clear()
        self.missing_since.clear()
        self.dead.clear()
        self.leaked.clear()

    def reload(self, model: str) -> None:
        """Load ``model`` again with its config and a new generation: new instances replace the old."""
        config = self.control.config(model)
        self.generation += 1
        config.setdefault("parameters", {})["watchdog_generation"] = {"string_value": str(self.generation)}
        self.control.load(model, config=config, timeout_s=self.reload_timeout_s)

    def _ready_versions(self) -> set[tuple[str, str]]:
        return {(m["name"], str(m.get("version", ""))) for m in self.control.index() if m.get("state") == "READY"}

    def _still_configured(self, model: str, instance: str) -> bool:
        """An instance name ``<model>_<group>_<index>`` is still expected by the model's config
        (a reload with fewer instances is not a death)."""
        try:
            groups = self.control.config(model).get("instance_group", [])
            group, index = (int(part) for part in instance[len(model) + 1:].split("_")[-2:])
        except (ControlError, ValueError, OSError):
            return True
        return group < len(groups) and index < int(groups[group].get("count", 1))

    def detect(self) -> dict[str, list[str]]:
        """Models with a stub missing for ``confirm_s`` while READY → their dead instance names."""
        ready = self._ready_versions()
        stubs: list[Stub] = [stub for stub in find_stubs(self.server_pid()) if stub.serves_requests]
        ready_again = self._ready_versions()  # a model that was reloaded meanwhile is not judged
        alive = {stub.identity for stub in stubs}
        for key in list(self.expected):
            if key not in ready or key not in ready_again:
                del self.expected[key]
        for stub in stubs:
            key = (stub.model, stub.version)
            if key in ready and key in ready_again:
                self.expected.setdefault(key, set()).add(stub.identity)
        now = time.monotonic()
        missing = {identity for identities in self.expected.values() for identity in identities - alive}
        self.missing_since = {i: self.missing_since.get(i, now) for i in missing}
        dead: dict[str, list[str]] = {}
        for identity, since in self.missing_since.items():
            if now - since < self.confirm_s:
                continue
            if self._still_configured(identity[0], identity[2]):
                dead.setdefault(identity[0], []).append(identity[2])
            else:
                self.expected.get(identity[:2], set()).discard(identity)
        self.metrics.set_ready(self.replica, {key: int(key[0] not in dead) for key in ready})
        self.dead = dead
        return dead

    def repair(self) -> list[str]:
        """Reload every model found dead; returns those reloaded."""
        repaired = []
        for model, instances in sorted(self.dead.items()):
            self.log(f"watchdog: Python stub(s) {', '.join(sorted(instances))} of model '{model}' died; "
                     f"reloading '{model}'")
            started = time.monotonic()
            self.leaked.add(model)
            try:
                self.reload(model)
            except (ControlError, OSError, urllib.error.URLError) as error:
                self.log(f"watchdog: reloading '{model}' failed: {error}; will retry")
                continue
            for key in [k for k in self.expected if k[0] == model]:
                del self.expected[key]
            self.missing_since = {i: t for i, t in self.missing_since.items() if i[0] != model}
            with self.metrics.lock:
                self.metrics.stub_restarts[model] += 1
            self.dead.pop(model, None)
            repaired.append(model)
            self.log(f"watchdog: '{model}' reloaded in {time.monotonic() - started:.1f} s")
        return repaired

    def missing_now(self) -> dict[str, list[str]]:
        """Models with a stub that was running at the last pass and is gone now (one /proc scan, no
        control call, nothing changed): readiness says so at once, before ``detect`` confirms it."""
        expected = [identity for identities in list(self.expected.values()) for identity in identities]
        if not expected:
            return {}
        alive = {stub.identity for stub in find_stubs(self.server_pid()) if stub.serves_requests}
        missing: dict[str, list[str]] = {}
        for identity in expected:
            if identity not in alive:
                missing.setdefault(identity[0], []).append(identity[2])
        return missing

    def problems(self) -> list[str]:
        dead = self.dead or self.missing_now()
        return [f"model '{m}': Python stub(s) {', '.join(sorted(i))} died (reloading)"
                for m, i in sorted(dead.items())]


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
