"""Run ``tritonserver`` 2.51 on a model repository, behind nginx, supervised, in the foreground.

Embedded (default; no Docker, no GPU): the binary shipped in ``nvidia-pytriton``, with a backend
directory laid out from the wheel's Python backend and the stub built for this interpreter.

    python -m triton_pipelines serve --model-repository model_repository

Container: the NGC image's own server and backends (docker-compose.yml runs exactly this), so both
ways run with the same flags, the same proxy, the same supervision and the same drain.

    python3 -m triton_pipelines serve --tritonserver /opt/tritonserver/bin/tritonserver \\
        --backend-dir /opt/tritonserver/backends --model-repository /models --listen-address 0.0.0.0

What runs:

- ``tritonserver`` (``--replicas`` of them) on loopback ports of its own, with the control APIs
  restricted by a key (``control.py``), explicit model control and every model loaded at start
  (``tritonserver.py``), each with its request screen (``screen_server.py``);
- nginx on the public ports (``front/nginx_config.py``, run by ``nginx_process.py``): body limits before Triton reads anything, control APIs
  refused; it listens on 127.0.0.1 unless ``--listen-address`` / ``$TRITON_LISTEN_ADDRESS`` says
  otherwise;
- the status server behind the public ``/metrics`` and ``/v2/health`` (``server/status.py``);
- supervision: a thread calls ``ReplicaSet.reconcile()`` every second (``replicas.py``), one pass
  that never waits: a dead Python stub gets its model reloaded (``stub_watchdog.py``); if
  tritonserver itself dies, its orphaned stubs and shared memory are removed and it is started
  again; a dead screen or nginx too; nginx routes to the healthy replicas.

This module is the wiring: temporary folders, the key and the state file (``server/state.py``), the
status server, the replicas, nginx, warm-up (``warmup.py``), retire and stop; the command's flags are
``serve_cli.py``.

Ctrl-C / SIGTERM drain the server first (models are unloaded top-down, so requests in flight,
ensembles included, finish: see ``drain.py``), then SIGTERM stops it (``--exit-timeout-secs``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from triton_pipelines.cancel_board import CancelBoard
from triton_pipelines.server.control import ControlClient, resolve_key
from triton_pipelines.repository.contract import BuiltManifest
from triton_pipelines.server.frontend_process import FrontendProcess
from triton_pipelines.server.processes import free_ports
from triton_pipelines.front.nginx_config import ProxyConfig, default_worker_user
from triton_pipelines.limits import client_share
from triton_pipelines.server.nginx_process import ProxyProcess
from triton_pipelines.server.replicas import Replica, ReplicaSet, TritonProcesses
from triton_pipelines.server.serve_cli import parse_options
from triton_pipelines.gateway.keys import keys_from_environment
from triton_pipelines.gateway.ledger_db import database_url
from triton_pipelines.server.state import KEY_FILE, STATE_FILE, ServerState, private_dir, write_private
from triton_pipelines.server.status import LauncherMetrics, StatusServer
from triton_pipelines.server.stub_watchdog import StubWatchdog
from triton_pipelines.server.warmup import warm_replica, warm_replicas
from triton_pipelines.errors import ConfigError
from triton_pipelines.telemetry.tracing import TraceSettings
# Re-exported: tests, benchmarks and tools import these from the launcher.
from triton_pipelines.server.tritonserver import (DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT,  # noqa: F401
                           LOOPBACK, METRICS_CONFIG, PYTHON_BACKEND_CONFIG, READY_TIMEOUT_ENV, READY_TIMEOUT_S,
                           InternalPorts, ServerOptions, prepare_backend_dir, pytriton_dir, ready_timeout_s, request_bytes_flags,
                           server_command, server_environment)

__all__ = ["Launcher", "ServerOptions", "start_on_free_ports", "free_ports"]


def public_models_file(options: ServerOptions, state_dir: Path) -> Path | None:
    """The models whose inference the public ports serve, as the builder recorded them in ``.built``
    (``public_models``), written to the state folder for the screens; None: every model."""
    if options.expose_internal_models:
        return None
    try:
        names = BuiltManifest.read(options.model_repository).public_models
    except (OSError, ValueError):
        return None
    if names is None:
        return None
    path = state_dir / "public_models.json"
    path.write_text(json.dumps(names))
    return path


def per_client_share(options: ServerOptions) -> int:
    return client_share(options.max_inflight, options.max_inflight_per_client)


# nginx restarts tolerated while the server starts (after it, the supervisor restarts it as often as it dies).
START_FRONT_RESTARTS = 2


def wait_for_front(address: str, proxy, log: Callable[[str], None], window_s: float = 30) -> None:
    """Until the public port at ``address`` answers ready. nginx that exits meanwhile is restarted, as
    the supervisor does once serving (``replicas.reconcile``); one that keeps dying (a port taken, a
    bad configuration) stops the start, named."""
    deadline = time.monotonic() + window_s
    url = f"http://{address}/v2/health/ready"
    front_restarts = 0
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the public port {address} does not answer: {error}") from None
            if not proxy.alive():
                code = proxy.process.returncode
                if front_restarts == START_FRONT_RESTARTS:
                    raise RuntimeError(f"nginx exited with code {code} ({front_restarts + 1} times while the "
                                       "server started)") from None
                log(f"nginx exited with code {code} while the server started; restarting it")
                proxy.restart()
                front_restarts += 1
                deadline = time.monotonic() + window_s
        time.sleep(0.1)

class Launcher:
    """nginx + tritonserver (``options.replicas`` of them) + supervision; use as a context manager or
    call ``stop()``. The wiring: temporary folders, the key, the state file, the status server,
    the replicas (``replicas.py``) and nginx; the supervision thread calls ``ReplicaSet.reconcile``
    every ``supervise_interval_s``.

    ``http_url`` / ``grpc_url`` / ``metrics_url`` are the public (proxied) endpoints; ``control`` is
    the model-repository API on (the first) Triton's loopback port with the key."""

    def __init__(self, options: ServerOptions, stdout=None, stderr=None):
        self.options = options
        self.stdout, self.stderr = stdout, stderr
        # Our log lines go where the server's do (a log file in tests, the terminal otherwise).
        self._log_fd = stderr.fileno() if hasattr(stderr, "fileno") else sys.stderr.fileno()
        check_tracing()
        embedded = options.tritonserver is None
        if not embedded and options.backend_dir is None:
            raise ValueError("--tritonserver needs --backend-dir (the server's own backends)")
        if options.replicas < 1:
            raise ValueError("--replicas must be at least 1")
        self._temporary_backend_dir = options.backend_dir is None
        if options.backend_dir is None:
            options.backend_dir = Path(tempfile.mkdtemp(prefix="triton-backends-"))
        if embedded:
            prepare_backend_dir(options.backend_dir)
        self._temporary_state_dir = options.state_dir is None
        self.state_dir = private_dir((options.state_dir or Path(tempfile.mkdtemp(prefix="triton-state-"))).resolve())
        self.key = resolve_key()
        write_private(self.state_dir / KEY_FILE, self.key + "\n")
        options.spend_database_url = options.spend_database_url or database_url(self.state_dir)  # spend.db here
        self.metrics = LauncherMetrics()
        self.stopping, self._stopped = threading.Event(), threading.Event()
        self.replicas: list[Replica] = []
        self.replica_set: ReplicaSet | None = None
        self.status = StatusServer(
            sources=lambda: [(r.label, f"{LOOPBACK}:{r.internal.metrics}") for r in self.replicas if not r.retired],
            # Live while the launcher supervises, restarts included: restarting the container would not
            # do better than the supervisor (readiness says when it cannot serve).
            live=lambda: bool(self.replicas) and not self.stopping.is_set(),
            not_ready=self.not_ready_reasons,
            metrics=lambda: self.metrics.render([r.label for r in self.replicas if not r.retired])
            + (self.openai.metrics_text() if self.openai else ""),
            retire=self.retire, key=self.key, label_replicas=options.replicas > 1)
        self.openai: FrontendProcess | None = None  # the OpenAI-compatible frontend behind /v1/
        try:
            # A keys file that is named but missing or malformed stops the start before any process
            # is spawned (one line; the frontend checks it again for its restarts).
            keys_from_environment()
            processes = TritonProcesses(options, self.key, self.metrics, self.log, stdout, stderr,
                                        public_models_file(options, self.state_dir),
                                        CancelBoard(self.state_dir / "cancel").create())
            for index in range(options.replicas):
                self.replicas.append(Replica(index, options, self.key, processes, self.metrics, self.log))
            self.openai = FrontendProcess(options.model_repository,
                                          [f"{LOOPBACK}:{r.internal.grpc}" for r in self.replicas], self.log,
                                          stdout, stderr, spend_database_url=options.spend_database_url,
                                          # /v1/embeddings over loopback HTTP: 0.5 ms less CPU per call than gRPC
                                          triton_http=[f"{LOOPBACK}:{r.internal.http}" for r in self.replicas],
                                          limit_flags=request_bytes_flags(options))
            self.openai.start()
            self.proxy = ProxyProcess(self._proxy_config(tuple(range(options.replicas))), stdout=stdout, stderr=stderr)
        except Exception:
            for replica in self.replicas:
                replica.process.kill()
                replica.screen.kill()
            if self.openai is not None and self.openai.alive():
                self.openai.process.kill()
            self.status.close()
            raise
        self.replica_set = ReplicaSet(self.replicas, self.proxy, self._proxy_config, self.metrics, self.log,
                                      self.stopping,
                                      warm=(lambda replica: warm_replica(replica, self.log)) if options.warm_pipelines
                                      else None,
                                      frontend=self.openai)
        first = self.replicas[0]
        ServerState(
            launcher_pid=os.getpid(), triton_http=first.control.http_url,
            triton_grpc=f"{LOOPBACK}:{first.internal.grpc}", triton_metrics=f"{LOOPBACK}:{first.internal.metrics}",
            replicas=[{"triton_http": r.control.http_url, "triton_grpc": f"{LOOPBACK}:{r.internal.grpc}"}
                      for r in self.replicas],
            status=f"{LOOPBACK}:{self.status.port}",
            http_port=options.http_port, grpc_port=options.grpc_port, metrics_port=options.metrics_port,
            listen_address=options.listen_address, model_repository=str(options.model_repository.resolve()),
            shm_prefix=first.shm_prefix).write(self.state_dir)
        self.supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        log_model_table(options.model_repository, self.log)  # what each compute model serves, from which weights
        log_tracing(self.log)

    def log(self, message: str) -> None:
        os.write(self._log_fd, f"[launcher] {message}\n".encode())

    def _proxy_config(self, routed: tuple[int, ...]) -> ProxyConfig:
        chosen = [self.replicas[i] for i in routed]
        return ProxyConfig(
            listen_address=self.options.listen_address, http_port=self.options.http_port,
            grpc_port=self.options.grpc_port, metrics_port=self.options.metrics_port,
            triton_http_ports=tuple(r.internal.http for r in chosen),
            triton_grpc_ports=tuple(r.internal.grpc for r in chosen),
            screen_http_ports=tuple(r.screen_ports[0] for r in chosen),
            screen_grpc_ports=tuple(r.screen_ports[1] for r in chosen), status_port=self.status.port,
            state_dir=self.state_dir / "proxy", max_body_bytes=self.options.max_body_bytes,
            max_json_bytes=self.options.max_json_bytes, max_inflight=self.options.max_inflight,
            max_inflight_per_client=per_client_share(self.options), run_as=default_worker_user(),
            openai_port=self.openai.port if self.openai else 0)

    # ------------------------------------------------------------------------- the first replica
    @property
    def process(self) -> subprocess.Popen:
        return self.replicas[0].process

    @property
    def internal(self) -> InternalPorts:
        return self.replicas[0].internal

    @property
    def control(self) -> ControlClient:
        return self.replicas[0].control

    @property
    def watchdog(self) -> StubWatchdog:
        return self.replicas[0].watchdog

    @property
    def shm_prefix(self) -> str:
        return self.replicas[0].shm_prefix

    # ------------------------------------------------------------------------- endpoints
    def _public_host(self) -> str:
        address = self.options.listen_address
        if address in ("0.0.0.0", "::", ""):
            return "localhost"
        return f"[{address}]" if ":" in address else address

    @property
    def http_url(self) -> str:
        return f"{self._public_host()}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self._public_host()}:{self.options.grpc_port}"

    def url(self, protocol: str) -> str:
        """The public endpoint for a client of ``protocol`` ("http" or "grpc")."""
        return self.http_url if protocol == "http" else self.grpc_url

    def internal_url(self, protocol: str) -> str:
        """The first tritonserver's own loopback endpoint: every model, no front (tests and tools
        that talk to one internal model, which the public ports do not serve)."""
        return self.control.http_url if protocol == "http" else f"{LOOPBACK}:{self.internal.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._public_host()}:{self.options.metrics_port}/metrics"

    # ------------------------------------------------------------------------- health
    def not_ready_reasons(self) -> list[str]:
        """Why the server cannot serve: empty when some replica in service is healthy."""
        return self.replica_set.not_ready_reasons() if self.replica_set else ["no replica in service"]

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until every replica is ready and the public port answers; then supervise."""
        timeout_s = ready_timeout_s() if timeout_s is None else timeout_s
        for replica in self.replicas:
            replica.wait_ready(timeout_s)
        wait_for_front(self.http_url, self.proxy, self.log)
        if self.options.warm_pipelines:
            try:
                self.warm_pipelines()
            except Exception as error:  # noqa: BLE001 - warm-up is an optimisation, never a reason to die
                self.log(f"pipeline warm-up failed, serving without it: {type(error).__name__}: {error}")
        if not self.supervisor.is_alive() and not self.stopping.is_set():
            self.supervisor.start()

    def warm_pipelines(self) -> list:
        """One request through every loaded ensemble of every replica in service (``warmup.py``)."""
        return warm_replicas(self.replicas, self.log)

    # ------------------------------------------------------------------------- supervision
    @property
    def routed(self) -> tuple[int, ...]:
        """The replicas nginx sends requests to."""
        return self.replica_set.routed if self.replica_set else ()

    def _supervise(self) -> None:
        while not self.stopping.wait(self.options.supervise_interval_s):
            try:
                self.replica_set.reconcile()
            except Exception as error:  # noqa: BLE001 - the next pass tries again; supervision never ends
                if not self.stopping.is_set():
                    self.log(f"supervision pass failed: {type(error).__name__}: {error}")

    def retire(self, index: int) -> str:
        """Take replica ``index`` out of service without failing a request: nginx stops sending it
        requests (graceful reload), then it drains and stops."""
        return self.replica_set.retire(index)

    def stop(self, timeout_s: float | None = None) -> int:
        """Close the public ports gracefully (requests in flight finish), drain every replica
        (models unloaded top-down), SIGTERM them."""
        if self._stopped.is_set():
            return self.process.returncode
        self.stopping.set()
        if self.supervisor.is_alive() and threading.current_thread() is not self.supervisor:
            self.supervisor.join(timeout=self.options.exit_timeout_secs + 60)
        self.replica_set.wait_tasks(self.options.exit_timeout_secs + 60)
        self.proxy.stop(timeout_s=self.options.exit_timeout_secs)
        if self.openai is not None:  # nothing new arrives: its requests in flight finish, then it exits
            self.openai.stop(timeout_s=self.options.exit_timeout_secs)
        threads = [threading.Thread(target=r.stop, args=(timeout_s,)) for r in self.replicas if not r.retired]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.status.close()
        if self._temporary_backend_dir:
            shutil.rmtree(self.options.backend_dir, ignore_errors=True)
        if self._temporary_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        else:
            for name in (KEY_FILE, STATE_FILE):
                (self.state_dir / name).unlink(missing_ok=True)
        self._stopped.set()
        return self.process.returncode

    def __enter__(self) -> "Launcher":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class RunningServer:
    """A launcher started elsewhere (another process, another interpreter), found through its state
    folder: the same endpoints and control client as a ``Launcher``, without owning the processes."""

    def __init__(self, state_dir: Path):
        self.state_dir = Path(state_dir)
        self.state = state = ServerState.read(self.state_dir)
        self.control = ControlClient.from_state(self.state_dir)
        self.key = self.control.key
        host = state.public_host
        self.http_url, self.grpc_url = f"{host}:{state.http_port}", f"{host}:{state.grpc_port}"
        self.metrics_url = f"http://{host}:{state.metrics_port}/metrics"
        self.shm_prefix = state.shm_prefix
        self.options = ServerOptions(model_repository=Path(state.model_repository), http_port=state.http_port,
                                     grpc_port=state.grpc_port, metrics_port=state.metrics_port)

    def url(self, protocol: str) -> str:
        return self.http_url if protocol == "http" else self.grpc_url

    def internal_url(self, protocol: str) -> str:
        return self.state.triton_http if protocol == "http" else self.state.triton_grpc

    def stop(self) -> None:
        """Not ours to stop."""


def start_on_free_ports(model_repository: Path, log_path: Path, extra_args: list[str] | None = None,
                        timeout_s: float = 600, models: list[str] | None = None,
                        **options) -> Launcher:
    """A ready server on free public ports, logging to ``log_path`` (tests and benchmarks use this)."""
    http, grpc, metrics = free_ports(3)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "wb")
    server = Launcher(ServerOptions(model_repository=model_repository, http_port=http, grpc_port=grpc,
                                    metrics_port=metrics, models=models, extra_args=extra_args or [], **options),
                      stdout=log, stderr=log)
    try:
        server.wait_ready(timeout_s=timeout_s)
    except Exception:
        server.stop()
        sys.stderr.write(log_path.read_text(errors="replace")[-5000:])
        raise
    return server


def check_tracing() -> None:
    """A bad OTEL_* variable, named in one line before anything starts (ConfigError)."""
    try:
        TraceSettings.from_environment()
    except ValueError as error:
        raise ConfigError(str(error)) from None


def log_tracing(log) -> None:
    settings = TraceSettings.from_environment()
    if settings is not None:
        log(f"tracing: OTLP/HTTP to {settings.traces_url}, sampler {settings.sampler} (ratio {settings.ratio:g}), "
            f"service {settings.service_name} (docs/operations.md, \"Tracing\")")


def log_model_table(model_repository: Path, log) -> None:
    """The start-up log's model table: what each compute model serves, from which weights
    (``BuiltManifest.weights_log``; a random one says so loudly). Nothing for an unstamped repository."""
    try:
        lines = BuiltManifest.read(model_repository).weights_log()
    except (OSError, ValueError):
        return
    for line in lines:
        log(line)


def shm_shortfall(model_repository: Path, replicas: int = 1, shm: str = "/dev/shm") -> str | None:
    """The warning when /dev/shm is smaller than the stubs may hold: ``repository.contract.shm_shortfall``."""
    from triton_pipelines.repository import contract as layout

    return layout.shm_shortfall(model_repository, replicas, shm)


def main(argv: list[str] | None = None) -> int:
    """``python -m triton_pipelines serve``: the flags (``serve_cli.py``), then serve until a stop."""
    options = parse_options(argv)
    server = Launcher(options)
    shortfall = shm_shortfall(options.model_repository, options.replicas)
    if shortfall:
        server.log(shortfall)
    stopping, stopped = threading.Event(), threading.Event()

    def stop():
        server.stop()
        stopped.set()

    def on_signal(*_):
        # Drain in a thread: the main thread keeps waiting for the stop to finish.
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=stop, daemon=True).start()

    # The server logs to this terminal; we forward Ctrl-C/SIGTERM as a drain, then SIGTERM.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    try:
        server.wait_ready()
        print(
            f"\nTriton is ready: HTTP {options.http_port}, gRPC {options.grpc_port}, "
            f"metrics {options.metrics_port} on {options.listen_address}. Ctrl-C stops it.\n",
            flush=True,
        )
    except (RuntimeError, TimeoutError) as error:
        if stopping.is_set():  # Ctrl-C before it was ready
            stopped.wait()
            return 0
        print(f"error: {error}", file=sys.stderr)
        server.stop()
        return 1
    # The supervisor restarts a crashed tritonserver; we return once a stop was asked for and done.
    while not stopped.wait(1.0):
        pass
    return server.process.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
