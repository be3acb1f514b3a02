"""The launcher's side of the OpenAI-compatible frontend (``openai_api/server.py``): start it, see that it
is alive, restart it, stop it with a drain, and read its metrics for the public ``:8002/metrics``.

The launcher calls ``start()`` once, ``ensure_running()`` on every supervision pass, appends
``metrics_text()`` to its own metrics, and ``stop()`` after nginx has stopped (so no new request
arrives and the ones in flight finish against Triton) and before the replicas drain.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from triton_pipelines.limits import LOOPBACK
from triton_pipelines.gateway.keys import keys_from_environment
from triton_pipelines.server.processes import free_ports, spawn
from triton_pipelines.gateway.ledger_db import DATABASE_ENV



class FrontendProcess:
    def __init__(self, model_repository: Path, triton_grpc: list[str], log: Callable[[str], None],
                 stdout=None, stderr=None, port: int | None = None, spend_database_url: str | None = None,
                 triton_http: list[str] | None = None, limit_flags: list[str] | None = None):
        self.model_repository = model_repository
        self.triton_grpc = list(triton_grpc)
        # Each replica's loopback HTTP port, in the order of triton_grpc (optional): /v1/embeddings then
        # calls Triton over HTTP, ~0.55 ms less CPU per request than gRPC (docs/openai.md).
        self.triton_http = list(triton_http or [])
        if self.triton_http and len(self.triton_http) != len(self.triton_grpc):
            raise ValueError("triton_http needs one address per replica, like triton_grpc")
        self.limit_flags = list(limit_flags or [])  # e.g. the request bytes in flight
        self.log = log
        self.stdout, self.stderr = stdout, stderr
        self.port = port or free_ports(1)[0]
        self.restarts = 0
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        # The environment of the first start (keys file, gateway variables), for every restart too.
        self.environment = dict(os.environ)
        if spend_database_url:  # the router's ledger: one budget per key on every path to the gateway
            self.environment[DATABASE_ENV] = spend_database_url
        # A keys file that is named but missing or malformed stops the launcher's start here (the
        # frontend would refuse to start, again and again), never serving /v1 open by accident.
        keys_from_environment(self.environment)
        self.started_at = 0.0
        self.quick_exits = 0
        self.next_start = 0.0

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "triton_pipelines", "frontend", f"--port={self.port}",
                f"--model-repository={self.model_repository.resolve()}",
                *[f"--triton-grpc={address}" for address in self.triton_grpc],
                *[f"--triton-http={address}" for address in self.triton_http], *self.limit_flags]

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.process = spawn(self.command(), env=self.environment, stdout=self.stdout, stderr=self.stderr,
                             start_new_session=True)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ensure_running(self) -> bool:
        """Restart it if it died; True when it was restarted."""
        if self.process is None or self.alive() or time.monotonic() < self.next_start:
            return False
        if self.next_start == 0.0:  # first seen dead: back off when it keeps dying at once
            self.quick_exits = self.quick_exits + 1 if time.monotonic() - self.started_at < 10 else 1
            backoff = min(30.0, 2.0 ** (self.quick_exits - 1)) if self.quick_exits > 1 else 0.0
            self.log(f"the OpenAI-compatible frontend exited with code {self.process.returncode}; restarting it"
                     + (f" in {backoff:.0f} s" if backoff else ""))
            if backoff:
                self.next_start = time.monotonic() + backoff
                return False
        self.next_start = 0.0
        with self.lock:
            self.restarts += 1
        self.start()
        return True

    def metrics_text(self) -> str:
        lines = ["# HELP launcher_openai_frontend_restarts_total the OpenAI-compatible frontend (openai_server.py) "
                 "restarted after an unexpected exit", "# TYPE launcher_openai_frontend_restarts_total counter",
                 f"launcher_openai_frontend_restarts_total {self.restarts}"]
        text = "\n".join(lines) + "\n"
        if not self.alive():
            return text
        try:
            with urllib.request.urlopen(f"http://{self.address}/metrics", timeout=2) as response:
                return text + response.read().decode(errors="replace")
        except (urllib.error.URLError, OSError):
            return text

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM: it stops accepting, finishes what is in flight, exits; killed after ``timeout_s``."""
        if not self.alive():
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
