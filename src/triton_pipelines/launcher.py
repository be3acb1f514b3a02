"""Run ``tritonserver`` 2.51 on a model repository, behind nginx, supervised, in the foreground.

Embedded (default; no Docker, no GPU): the binary shipped in ``nvidia-pytriton``, with a backend
directory laid out from the wheel's Python backend and the stub built for this interpreter.

    python -m triton_pipelines.launcher --model-repository model_repository

Container: the NGC image's own server and backends (docker-compose.yml runs exactly this), so both
ways run with the same flags, the same proxy, the same supervision and the same drain.

    python3 -m triton_pipelines.launcher --tritonserver /opt/tritonserver/bin/tritonserver \\
        --backend-dir /opt/tritonserver/backends --model-repository /models --listen-address 0.0.0.0

What runs:

- ``tritonserver`` on loopback ports of its own, with the control APIs restricted by a key
  (``control.py``), explicit model control and every model loaded at start;
- nginx on the public ports (``proxy.py``): body limits before Triton reads anything, control APIs
  refused; it listens on 127.0.0.1 unless ``--listen-address`` / ``$TRITON_LISTEN_ADDRESS`` says
  otherwise;
- the supervisor (``supervisor.py``): a dead Python stub gets its model reloaded; if tritonserver
  itself dies, its orphaned stubs and shared memory are removed and it is started again; nginx too.

Ctrl-C / SIGTERM drain the server first (models are unloaded top-down, so requests in flight,
ensembles included, finish: see ``drain.py``), then SIGTERM stops it (``--exit-timeout-secs``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .backends import models_to_load
from .control import (STATE_ENV, ControlClient, private_dir, resolve_key, restricted_api_flags,
                      write_private)
from .drain import drain
from .layout import PYTHON_BACKEND_SHM_CONFIG, BuiltManifest
from .openai_process import FrontendProcess
from .processes import free_ports, remove_leftovers, shm_capacity, spawn
from .api_keys import KEY_ID_PARAMETER
from .spend_ledger import DATABASE_ENV, database_url
from .proxy import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_JSON_BYTES, ProxyConfig, ProxyProcess,
                    default_worker_user)
from .supervisor import LauncherMetrics, StatusServer, StubWatchdog

__all__ = ["Launcher", "ServerOptions", "start_on_free_ports", "free_ports"]

DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 8001
DEFAULT_METRICS_PORT = 8002
# Python-backend shared memory per stub (layout.PYTHON_SHM_*: the planner sizes /dev/shm with them).
PYTHON_BACKEND_CONFIG = PYTHON_BACKEND_SHM_CONFIG
# Latency summaries (nv_inference_{request,queue,compute_infer}_summary_us, quantiles 0.5 to 0.999):
# 2.51 has no latency histograms for non-decoupled models, and p99 queue time needs one or the other.
METRICS_CONFIG = ("summary_latencies=true",)
LOOPBACK = "127.0.0.1"
# How long the start-up load may take before the launcher gives up (and the container restarts).
# The one source of this value: docker-compose.yml's healthcheck start_period and the Kubernetes
# startup probe are at least this long (tests/test_images.py, tests/test_deploy_k8s.py). Whisper
# large-v3 on the gpu target plus ONNX Runtime's TensorRT engine builds on first start can take
# well over 5 minutes. Override: TRITON_READY_TIMEOUT_S.
READY_TIMEOUT_S = 1200
READY_TIMEOUT_ENV = "TRITON_READY_TIMEOUT_S"


def ready_timeout_s() -> float:
    return float(os.environ.get(READY_TIMEOUT_ENV) or READY_TIMEOUT_S)


def pytriton_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-pytriton is not installed: run `make install`")
    return Path(list(spec.submodule_search_locations)[0]) / "tritonserver"


def prepare_backend_dir(target: Path) -> Path:
    """Copy the Python backend and this interpreter's stub into ``target/python``."""
    triton_dir = pytriton_dir()
    python_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = triton_dir / "python_backend_stubs" / python_version / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"nvidia-pytriton ships no Python backend stub for Python {python_version}")
    backend = target / "python"
    if backend.exists():
        shutil.rmtree(backend)
    shutil.copytree(triton_dir / "backends" / "python", backend)
    shutil.copy2(stub, backend / "triton_python_backend_stub")
    return target


@dataclass
class ServerOptions:
    model_repository: Path
    # Public ports (nginx).
    http_port: int = DEFAULT_HTTP_PORT
    grpc_port: int = DEFAULT_GRPC_PORT
    metrics_port: int = DEFAULT_METRICS_PORT
    listen_address: str = LOOPBACK
    # None: a private temporary folder, removed on stop (lets several servers run side by side).
    backend_dir: Path | None = None
    # None: the embedded binary from nvidia-pytriton; else this server (the container's), with
    # backend_dir naming its backends.
    tritonserver: Path | None = None
    # Control key, internal ports, nginx files. None: a temporary folder, removed on stop.
    state_dir: Path | None = None
    exit_timeout_secs: int = 30
    log_verbose: int = 0
    # Models loaded at start; None loads every model in the repository (--load-model=*).
    models: list[str] | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    # None: half of max_inflight; 0: no per-client share (see proxy.ProxyConfig).
    max_inflight_per_client: int | None = None
    # Inference on the public ports for the pipelines and the router only (the builder's
    # public_models in .built); True: every model, internal steps included (benchmarks of one model).
    expose_internal_models: bool = False
    supervise_interval_s: float = 1.0
    # tritonservers behind the one nginx (round robin): scale-out on one machine.
    replicas: int = 1
    # One request through every loaded ensemble before the server is announced ready (warmup.py).
    warm_pipelines: bool = False
    extra_args: list[str] = field(default_factory=list)
    # The gateway's spend ledger (SPEND_DATABASE_URL wins; the launcher sets sqlite in the state folder).
    spend_database_url: str | None = None


@dataclass(frozen=True)
class InternalPorts:
    """tritonserver's own ports, on loopback only."""
    http: int
    grpc: int
    metrics: int


def server_command(options: ServerOptions, internal: InternalPorts, key: str, shm_prefix: str) -> list[str]:
    command = [
        str(options.tritonserver or pytriton_dir() / "bin" / "tritonserver"),
        f"--model-repository={options.model_repository.resolve()}",
        f"--backend-directory={options.backend_dir.resolve()}",
        "--model-control-mode=explicit",
        *[f"--load-model={name}" for name in (options.models or ["*"])],
        f"--http-address={LOOPBACK}",
        f"--http-port={internal.http}",
        f"--grpc-address={LOOPBACK}",
        f"--grpc-port={internal.grpc}",
        f"--metrics-address={LOOPBACK}",
        f"--metrics-port={internal.metrics}",
        f"--exit-timeout-secs={options.exit_timeout_secs}",
        f"--log-verbose={options.log_verbose}",
        *restricted_api_flags(key),
        # the API key id the request screen resolved reaches the router as a request parameter
        f"--http-header-forward-pattern=^{KEY_ID_PARAMETER}$",
        f"--grpc-header-forward-pattern=^{KEY_ID_PARAMETER}$",
    ]
    backend_config = (*PYTHON_BACKEND_CONFIG, f"shm-region-prefix-name={shm_prefix}")
    command += [f"--backend-config=python,{setting}" for setting in backend_config]
    command += [f"--metrics-config={setting}" for setting in METRICS_CONFIG]
    return command + list(options.extra_args)


def server_environment() -> dict[str, str]:
    """PATH leads with this interpreter's bin dir so the stub's embedded Python finds our venv."""
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    libs = pytriton_dir().parent.parent / "nvidia_pytriton.libs"
    # The stub links libpython3.X.so.1.0: it must be THIS interpreter's (a system libpython of another
    # patch release breaks extension modules of our stdlib, e.g. `import ssl` fails with an undefined
    # symbol, so the openai/httpx clients cannot load).
    python_libdir = sysconfig.get_config_var("LIBDIR") or ""
    own_libpython = python_libdir and (Path(python_libdir) / sysconfig.get_config_var("INSTSONAME")).exists()
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (python_libdir if own_libpython else "", str(libs), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


class Replica:
    """One tritonserver on loopback ports of its own: process, control client, stub watchdog and
    restart after a crash. ``--replicas N`` runs N of them behind the one nginx."""

    def __init__(self, index: int, options: ServerOptions, key: str, metrics: LauncherMetrics, log,
                 stdout=None, stderr=None, public_models: Path | None = None):
        self.index, self.label = index, str(index)
        self.options, self.key, self.metrics, self.log = options, key, metrics, log
        self.stdout, self.stderr = stdout, stderr
        self.public_models = public_models
        self.internal = InternalPorts(*free_ports(3))
        self.screen_ports = tuple(free_ports(2))  # (HTTP, gRPC) of this replica's request screen
        self.shm_prefix = f"triton_pipelines_{os.getpid()}_{self.internal.http}_"
        self.control = ControlClient(f"{LOOPBACK}:{self.internal.http}", key)
        self.watchdog = StubWatchdog(self.control, lambda: self.process.pid, metrics, log, replica=self.label)
        self.restarting = False
        self.retired = False
        self.quick_crashes = 0
        self.started_at = time.monotonic()
        self.process = self._start()
        self.screen = self._start_screen()

    def _start_screen(self) -> subprocess.Popen:
        """This replica's request screen (screen_server.py): nginx sends it every inference request."""
        command = [sys.executable, "-m", "triton_pipelines.screen_server",
                   f"--http-port={self.screen_ports[0]}", f"--grpc-port={self.screen_ports[1]}",
                   f"--triton-http={LOOPBACK}:{self.internal.http}", f"--triton-grpc={LOOPBACK}:{self.internal.grpc}",
                   f"--max-body-bytes={self.options.max_body_bytes}"]
        if self.public_models is not None:
            command.append(f"--public-models-file={self.public_models}")
        return spawn(command, stdout=self.stdout, stderr=self.stderr, start_new_session=True)

    def screen_alive(self) -> bool:
        return self.screen.poll() is None

    def restart_screen(self) -> None:
        self.log(f"the request screen{self._which()} exited with code {self.screen.returncode}; restarting it")
        with self.metrics.lock:
            self.metrics.screen_restarts += 1
        self.screen = self._start_screen()

    def _which(self) -> str:
        return f" (replica {self.label})" if self.options.replicas > 1 else ""

    def _start(self) -> subprocess.Popen:
        embedded = self.options.tritonserver is None
        self.started_at = time.monotonic()
        # Its own session: a terminal's Ctrl-C reaches the launcher (which drains, then stops the
        # server) rather than tritonserver directly (whose own shutdown fails in-flight ensembles).
        env = server_environment() if embedded else dict(os.environ)
        if self.options.spend_database_url:
            env[DATABASE_ENV] = self.options.spend_database_url
        return spawn(
            server_command(self.options, self.internal, self.key, self.shm_prefix),
            env=env, stdout=self.stdout, stderr=self.stderr,
            start_new_session=True)

    def alive(self) -> bool:
        return self.process.poll() is None

    def triton_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.control.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def healthy(self) -> bool:
        """Fit to be sent requests: running, ready, every Python stub alive (as of now, not only as of
        the watchdog's last pass)."""
        return (not self.retired and not self.restarting and self.alive() and self.screen_alive()
                and not self.watchdog.dead and not self.watchdog.missing_now() and self.triton_ready())

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} before it was ready")
            if self.triton_ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver was not ready after {timeout_s:.0f} s")

    def restart(self, stopping: threading.Event) -> None:
        """After an unexpected exit: remove what it left, start it again (with backoff if it keeps dying)."""
        code = self.process.returncode
        how = f"signal {-code}" if code < 0 else f"code {code}"
        killed, freed = remove_leftovers(self.process.pid, self.shm_prefix)
        self.quick_crashes = self.quick_crashes + 1 if time.monotonic() - self.started_at < 60 else 1
        with self.metrics.lock:
            self.metrics.server_restarts[self.label] += 1
            restarts = self.metrics.server_restarts[self.label]
        backoff = min(30.0, 2.0 ** (self.quick_crashes - 1)) if self.quick_crashes > 1 else 0.0
        replica = f" (replica {self.label})" if self.options.replicas > 1 else ""
        self.log(f"tritonserver{replica} exited unexpectedly ({how}); removed {killed} orphaned stub(s) and "
                 f"{freed / 2**20:.0f} MiB of /dev/shm; restarting it (restart {restarts}"
                 + (f", after {backoff:.0f} s" if backoff else "") + ")")
        self.restarting = True
        self.watchdog.reset()
        if stopping.wait(backoff):
            return
        self.process = self._start()
        try:
            self.wait_ready(timeout_s=ready_timeout_s())
            self.log(f"tritonserver{replica} is ready again")
        except (RuntimeError, TimeoutError) as error:
            self.log(f"restarted tritonserver{replica} did not become ready: {error}")
        finally:
            self.restarting = False

    def stop(self, timeout_s: float | None = None) -> None:
        """Drain (unload models top-down, in-flight requests finish), then SIGTERM."""
        if self.alive():
            leaked = set(self.watchdog.leaked)
            try:
                drain(self.control, timeout_s=self.options.exit_timeout_secs, never_unloads=leaked)
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, RuntimeError) as error:
                self.log(f"drain skipped: {error}")
            # Nothing is routed here any more: the screen's idle keep-alive connections would only
            # make Triton wait out its exit timeout for them ("Found 1 HTTP service connections").
            self._stop_screen()
            self.process.send_signal(signal.SIGTERM)
            # Drained, nothing is in flight: Triton would only wait its exit timeout for an instance
            # it never releases (a model whose stub died), so that wait is cut short.
            wait_s = 5 if leaked else (timeout_s or self.options.exit_timeout_secs + 30)
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                if leaked:
                    self.log(f"stopping without waiting for the dead-stub instances of {sorted(leaked)}")
                self.process.kill()
                self.process.wait()
        remove_leftovers(self.process.pid, self.shm_prefix)
        self._stop_screen()

    def _stop_screen(self) -> None:
        if self.screen_alive():
            self.screen.terminate()
            try:
                self.screen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.screen.kill()
                self.screen.wait()


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
    if options.max_inflight_per_client is None:
        return max(1, options.max_inflight // 2)
    return options.max_inflight_per_client


class Launcher:
    """nginx + tritonserver (``options.replicas`` of them) + supervisor; use as a context manager or
    call ``stop()``.

    ``http_url`` / ``grpc_url`` / ``metrics_url`` are the public (proxied) endpoints; ``control`` is
    the model-repository API on (the first) Triton's loopback port with the key."""

    def __init__(self, options: ServerOptions, stdout=None, stderr=None):
        self.options = options
        self.stdout, self.stderr = stdout, stderr
        # Our log lines go where the server's do (a log file in tests, the terminal otherwise).
        self._log_fd = stderr.fileno() if hasattr(stderr, "fileno") else sys.stderr.fileno()
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
        write_private(self.state_dir / "control.key", self.key + "\n")
        options.spend_database_url = options.spend_database_url or database_url(self.state_dir)  # spend.db here
        self.metrics = LauncherMetrics()
        self.stopping, self._stopped = threading.Event(), threading.Event()
        self.replicas: list[Replica] = []
        self.routed: tuple[int, ...] = ()
        self._routing = threading.Lock()  # the supervisor and a retire request both reroute
        self.status = StatusServer(
            sources=lambda: [(r.label, f"{LOOPBACK}:{r.internal.metrics}") for r in self.replicas if not r.retired],
            # Live while the launcher supervises, restarts included: restarting the container would not
            # do better than the supervisor (readiness says when it cannot serve).
            live=lambda: bool(self.replicas) and not self.stopping.is_set(),
            not_ready=self.not_ready_reasons,
            metrics=lambda: self.metrics.render([r.label for r in self.replicas if not r.retired])
            + (self.openai.metrics_text() if self.openai else ""),
            retire=self.retire, key=self.key, label_replicas=options.replicas > 1)
        self.gate_port = free_ports(1)[0]  # the proxy's in-flight gate, kept across reconfigurations
        self.openai: FrontendProcess | None = None  # the OpenAI-compatible frontend behind /v1/ (issue 23)
        try:
            public_models = public_models_file(options, self.state_dir)
            self.replicas = [Replica(i, options, self.key, self.metrics, self.log, stdout, stderr, public_models)
                             for i in range(options.replicas)]
            self.routed = tuple(range(options.replicas))
            self.openai = FrontendProcess(options.model_repository,
                                          [f"{LOOPBACK}:{r.internal.grpc}" for r in self.replicas], self.log,
                                          stdout, stderr, spend_database_url=options.spend_database_url)
            self.openai.start()
            self.proxy = ProxyProcess(self._proxy_config(self.routed), stdout=stdout, stderr=stderr)
        except Exception:
            for replica in self.replicas:
                replica.process.kill()
                replica.screen.kill()
            if self.openai is not None and self.openai.alive():
                self.openai.process.kill()
            self.status.close()
            raise
        first = self.replicas[0]
        write_private(self.state_dir / "server.json", json.dumps({
            "launcher_pid": os.getpid(), "triton_http": first.control.http_url,
            "triton_grpc": f"{LOOPBACK}:{first.internal.grpc}", "triton_metrics": f"{LOOPBACK}:{first.internal.metrics}",
            "replicas": [{"triton_http": r.control.http_url, "triton_grpc": f"{LOOPBACK}:{r.internal.grpc}"}
                         for r in self.replicas],
            "status": f"{LOOPBACK}:{self.status.port}",
            "http_port": options.http_port, "grpc_port": options.grpc_port, "metrics_port": options.metrics_port,
            "listen_address": options.listen_address, "model_repository": str(options.model_repository.resolve()),
            "shm_prefix": first.shm_prefix}, indent=2))
        self.supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)

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
            gate_port=self.gate_port,
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
        active = [r for r in self.replicas if not r.retired]
        if any(r.healthy() for r in active):
            return []
        reasons = []
        for replica in active:
            prefix = f"replica {replica.label}: " if len(self.replicas) > 1 else ""
            if replica.restarting or not replica.alive():
                reasons.append(prefix + "tritonserver is not running (restarting)")
            else:
                reasons += [prefix + problem for problem in replica.watchdog.problems()]
                if not replica.triton_ready():
                    reasons.append(prefix + "tritonserver is not ready (models loading or unloading)")
        return reasons or ["no replica in service"]

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until every replica is ready and the public port answers; then supervise."""
        timeout_s = ready_timeout_s() if timeout_s is None else timeout_s
        for replica in self.replicas:
            replica.wait_ready(timeout_s)
        deadline = time.monotonic() + 30
        url = f"http://{self.http_url}/v2/health/ready"
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the public port {self.http_url} does not answer: {error}") from None
                if not self.proxy.alive():
                    raise RuntimeError(f"nginx exited with code {self.proxy.process.returncode}")
            time.sleep(0.1)
        if self.options.warm_pipelines:
            try:
                self.warm_pipelines()
            except Exception as error:  # noqa: BLE001 - warm-up is an optimisation, never a reason to die
                self.log(f"pipeline warm-up failed, serving without it: {type(error).__name__}: {error}")
        if not self.supervisor.is_alive() and not self.stopping.is_set():
            self.supervisor.start()

    def warm_pipelines(self) -> list:
        """One request through every loaded ensemble of every replica (model_warmup warms compute
        models at load; an ensemble and the Python steps behind it have no warm-up by config)."""
        from .client import TritonClient
        from .warmup import warm_pipelines

        warmed = []
        for replica in [r for r in self.replicas if not r.retired]:
            control = replica.control
            ensembles = [entry["name"] for entry in control.index(ready_only=True)
                         if control.config(entry["name"]).get("platform") == "ensemble"]
            client = TritonClient("http", control.http_url)
            try:
                warmed += warm_pipelines(client, control, sorted(set(ensembles)), on_error=lambda name, error:
                                         self.log(f"warm-up request through {name} failed: {error}"))
            finally:
                client.close()
        self.log(f"warmed {len(warmed)} pipelines end to end in {sum(w.seconds for w in warmed):.1f} s")
        return warmed

    # ------------------------------------------------------------------------- supervision
    def _route(self) -> None:
        """Send requests only to healthy replicas (all of them if none is)."""
        with self._routing:
            active = [r for r in self.replicas if not r.retired]
            healthy = tuple(r.index for r in active if r.healthy()) or tuple(r.index for r in active)
            if healthy and healthy != self.routed:
                self.proxy.reconfigure(self._proxy_config(healthy))
                if len(self.replicas) > 1:
                    self.log(f"routing to replica(s) {', '.join(str(i) for i in healthy)}")
                self.routed = healthy

    def _supervise(self) -> None:
        while not self.stopping.wait(self.options.supervise_interval_s):
            if not self.proxy.alive() and not self.stopping.is_set():
                self.log(f"nginx exited with code {self.proxy.process.returncode}; restarting it")
                with self.metrics.lock:
                    self.metrics.proxy_restarts += 1
                self.proxy.restart()
            if not self.stopping.is_set() and self.openai is not None:
                self.openai.ensure_running()
            for replica in [r for r in self.replicas if not r.retired]:
                if not replica.screen_alive() and not self.stopping.is_set():
                    replica.restart_screen()
                if not replica.alive() and not self.stopping.is_set():
                    replica.restart(self.stopping)
                    continue
                try:
                    replica.watchdog.detect()
                except (urllib.error.URLError, OSError, ValueError) as error:
                    if not self.stopping.is_set() and replica.alive():
                        self.log(f"watchdog check failed: {error}")
            if not self.stopping.is_set():
                self._route()  # route around a dead stub before repairing it
            for replica in [r for r in self.replicas if not r.retired and r.watchdog.dead]:
                if not self.stopping.is_set():
                    replica.watchdog.repair()

    def retire(self, index: int) -> str:
        """Take replica ``index`` out of service without failing a request: nginx stops sending it
        requests (graceful reload), then it drains and stops."""
        if not 0 <= index < len(self.replicas) or self.replicas[index].retired:
            raise ValueError(f"no replica {index} in service")
        if all(r.retired for r in self.replicas if r.index != index):
            raise ValueError("the last replica in service cannot be retired: stop the launcher instead")
        replica = self.replicas[index]
        with self._routing:
            replica.retired = True
            self.routed = tuple(i for i in self.routed if i != index) or tuple(
                r.index for r in self.replicas if not r.retired)
            self.proxy.reconfigure(self._proxy_config(self.routed))
        self.log(f"replica {index} retired from service; draining it")
        replica.stop()
        self.metrics.set_ready(replica.label, {})
        self.log(f"replica {index} stopped")
        return str(index)

    def stop(self, timeout_s: float | None = None) -> int:
        """Close the public ports gracefully (requests in flight finish), drain every replica
        (models unloaded top-down), SIGTERM them."""
        if self._stopped.is_set():
            return self.process.returncode
        self.stopping.set()
        if self.supervisor.is_alive() and threading.current_thread() is not self.supervisor:
            self.supervisor.join(timeout=self.options.exit_timeout_secs + 60)
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
            for name in ("control.key", "server.json"):
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
        self.state = state = json.loads((self.state_dir / "server.json").read_text())
        self.control = ControlClient.from_state(self.state_dir)
        self.key = self.control.key
        host = state["listen_address"] if state["listen_address"] not in ("0.0.0.0", "::") else "localhost"
        self.http_url, self.grpc_url = f"{host}:{state['http_port']}", f"{host}:{state['grpc_port']}"
        self.metrics_url = f"http://{host}:{state['metrics_port']}/metrics"
        self.shm_prefix = state["shm_prefix"]
        self.options = ServerOptions(model_repository=Path(state["model_repository"]), http_port=state["http_port"],
                                     grpc_port=state["grpc_port"], metrics_port=state["metrics_port"])

    def url(self, protocol: str) -> str:
        return self.http_url if protocol == "http" else self.grpc_url

    def internal_url(self, protocol: str) -> str:
        return self.state["triton_http"] if protocol == "http" else self.state["triton_grpc"]

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


def _optional_int(text: str | None) -> int | None:
    return int(text) if text not in (None, "") else None


def _port(flag_value: int | None, env_name: str, default: int) -> int:
    if flag_value is not None:
        return flag_value
    return int(os.environ.get(env_name, default))


def shm_shortfall(model_repository: Path, replicas: int = 1, shm: str = "/dev/shm") -> str | None:
    """A warning when /dev/shm is smaller than what the repository's Python-backend stubs may hold
    at full batches (the builder records it in ``.built``): past that, a request fails with the
    stub unable to grow its region instead of being served."""
    try:
        needed = (BuiltManifest.read(model_repository).shm_bytes or 0) * replicas
        size = shm_capacity(shm)
    except (OSError, ValueError):
        return None
    if needed <= size:
        return None
    return (f"WARNING: {shm} holds {size / 2**30:.1f} GiB; the Python-backend stubs may need up to "
            f"{needed / 2**30:.1f} GiB at full batches ({replicas} replica(s); `python -m repo_builder plan --shm` "
            f"itemizes it). Raise it: docker compose TRITON_SHM_SIZE, Kubernetes the dshm volume's sizeLimit, "
            f"docker run --shm-size")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--http-port", type=int, help=f"default $TRITON_HTTP_PORT or {DEFAULT_HTTP_PORT}")
    parser.add_argument("--grpc-port", type=int, help=f"default $TRITON_GRPC_PORT or {DEFAULT_GRPC_PORT}")
    parser.add_argument("--metrics-port", type=int, help=f"default $TRITON_METRICS_PORT or {DEFAULT_METRICS_PORT}")
    parser.add_argument("--listen-address", default=os.environ.get("TRITON_LISTEN_ADDRESS", LOOPBACK),
                        help="address of the public ports (default $TRITON_LISTEN_ADDRESS or 127.0.0.1; "
                             "0.0.0.0 for every interface)")
    parser.add_argument("--state-dir", type=Path,
                        help=f"control key and internal ports for our tools (default ${STATE_ENV} or .triton/<http port>)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request accepted on the public ports (HTTP body or gRPC message)")
    parser.add_argument("--max-json-bytes", type=int, default=DEFAULT_MAX_JSON_BYTES,
                        help="largest JSON part of an HTTP request (Triton 2.51 crashes on large JSON)")
    parser.add_argument("--max-inflight", type=int, default=int(os.environ.get("TRITON_MAX_INFLIGHT", DEFAULT_MAX_INFLIGHT)),
                        help="inference requests in flight on the public ports together; more are refused at once "
                             f"with 503 / UNAVAILABLE (default $TRITON_MAX_INFLIGHT or {DEFAULT_MAX_INFLIGHT})")
    parser.add_argument("--max-inflight-per-client", type=int,
                        default=_optional_int(os.environ.get("TRITON_MAX_INFLIGHT_PER_CLIENT")),
                        help="one client address's share of --max-inflight; more from it are refused first "
                             "(default $TRITON_MAX_INFLIGHT_PER_CLIENT or half of --max-inflight; 0: no share). "
                             "Behind a load balancer or NAT every client has its address: raise it or use 0")
    parser.add_argument("--expose-internal-models", action="store_true",
                        help="serve inference for every model on the public ports, not only the pipelines and "
                             "the router (e.g. to measure one compute model with perf_analyzer)")
    parser.add_argument("--tritonserver", type=Path, metavar="PATH",
                        help="run this tritonserver (e.g. the container's) instead of the embedded one")
    parser.add_argument("--backend-dir", type=Path,
                        help="the server's backends; default (embedded): a temporary folder laid out from the wheel")
    parser.add_argument("--exit-timeout-secs", type=int, default=30)
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=int(os.environ.get("TRITON_REPLICAS", 1)),
                        help="tritonserver processes behind the one public front, round robin "
                             "(default $TRITON_REPLICAS or 1)")
    parser.add_argument("--load-model", action="append", dest="models", metavar="NAME",
                        help="load only these models at start (repeatable); default: every model")
    parser.add_argument("--no-pipeline-warmup", action="store_true",
                        help="do not send one request through every ensemble before announcing ready")
    parser.add_argument("extra_args", nargs="*", help="passed to tritonserver after `--`")
    args = parser.parse_args(argv)
    if not (args.model_repository / ".built").exists():
        parser.error(f"{args.model_repository} is not built: run `make repository` (or `make serve`)")
    if args.max_json_bytes > DEFAULT_MAX_JSON_BYTES:
        parser.error(f"--max-json-bytes above {DEFAULT_MAX_JSON_BYTES} lets a deeply nested JSON request "
                     f"crash tritonserver 2.51")
    if args.max_inflight < 1:
        parser.error("--max-inflight must be at least 1")
    if args.max_inflight_per_client is not None and args.max_inflight_per_client < 0:
        parser.error("--max-inflight-per-client must be 0 (no share) or more")
    http_port = _port(args.http_port, "TRITON_HTTP_PORT", DEFAULT_HTTP_PORT)
    options = ServerOptions(
        model_repository=args.model_repository,
        http_port=http_port,
        grpc_port=_port(args.grpc_port, "TRITON_GRPC_PORT", DEFAULT_GRPC_PORT),
        metrics_port=_port(args.metrics_port, "TRITON_METRICS_PORT", DEFAULT_METRICS_PORT),
        listen_address=args.listen_address,
        state_dir=args.state_dir or Path(os.environ.get(STATE_ENV) or Path(".triton") / str(http_port)),
        max_body_bytes=args.max_body_bytes,
        max_json_bytes=args.max_json_bytes,
        max_inflight=args.max_inflight,
        max_inflight_per_client=args.max_inflight_per_client,
        expose_internal_models=args.expose_internal_models,
        backend_dir=args.backend_dir,
        tritonserver=args.tritonserver,
        exit_timeout_secs=args.exit_timeout_secs,
        log_verbose=args.log_verbose,
        models=args.models,
        replicas=args.replicas,
        warm_pipelines=not args.no_pipeline_warmup,
        extra_args=args.extra_args,
    )
    if options.models is None and options.backend_dir is not None:
        options.models = models_to_load(options.model_repository, options.backend_dir)  # backends.py
    server = Launcher(options)
    shortfall = shm_shortfall(args.model_repository, args.replicas)
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
