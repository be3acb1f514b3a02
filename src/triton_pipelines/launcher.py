"""Run ``tritonserver`` 2.51 on a model repository, in the foreground, with our flags.

Embedded (default; no Docker, no GPU): the binary shipped in ``nvidia-pytriton``, with a backend
directory laid out from the wheel's Python backend and the stub built for this interpreter.

    python -m triton_pipelines.launcher --model-repository model_repository

Container: the NGC image's own server and backends (docker-compose.yml runs exactly this), so both
ways run with the same flags (explicit model control, every model loaded at start) and the same drain.

    python3 -m triton_pipelines.launcher --tritonserver /opt/tritonserver/bin/tritonserver \
        --backend-dir /opt/tritonserver/backends --model-repository /models

Ctrl-C / SIGTERM drain the server first (models are unloaded top-down, so requests in flight,
ensembles included, finish: see ``drain.py``), then SIGTERM stops it (``--exit-timeout-secs``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
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

from .drain import drain

DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 8001
DEFAULT_METRICS_PORT = 8002
# Python-backend shared memory: start at 16 MiB per stub and grow by 16 MiB, so an image batch
# does not pay for many small region growths.
PYTHON_BACKEND_CONFIG = ("shm-default-byte-size=16777216", "shm-growth-byte-size=16777216")
# Latency summaries (nv_inference_{request,queue,compute_infer}_summary_us, quantiles 0.5 to 0.999):
# 2.51 has no latency histograms for non-decoupled models, and p99 queue time needs one or the other.
METRICS_CONFIG = ("summary_latencies=true",)


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
    http_port: int = DEFAULT_HTTP_PORT
    grpc_port: int = DEFAULT_GRPC_PORT
    metrics_port: int = DEFAULT_METRICS_PORT
    # None: a private temporary folder, removed on stop (lets several servers run side by side).
    backend_dir: Path | None = None
    # None: the embedded binary from nvidia-pytriton; else this server (the container's), with
    # backend_dir naming its backends.
    tritonserver: Path | None = None
    exit_timeout_secs: int = 30
    log_verbose: int = 0
    # Models loaded at start; None loads every model in the repository (--load-model=*).
    models: list[str] | None = None
    extra_args: list[str] = field(default_factory=list)


def server_command(options: ServerOptions) -> list[str]:
    command = [
        str(options.tritonserver or pytriton_dir() / "bin" / "tritonserver"),
        f"--model-repository={options.model_repository.resolve()}",
        f"--backend-directory={options.backend_dir.resolve()}",
        "--model-control-mode=explicit",
        *[f"--load-model={name}" for name in (options.models or ["*"])],
        f"--http-port={options.http_port}",
        f"--grpc-port={options.grpc_port}",
        f"--metrics-port={options.metrics_port}",
        f"--exit-timeout-secs={options.exit_timeout_secs}",
        f"--log-verbose={options.log_verbose}",
    ]
    command += [f"--backend-config=python,{setting}" for setting in PYTHON_BACKEND_CONFIG]
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


def _terminate_with_parent() -> None:
    """In the child before exec: SIGTERM it if the launcher dies without stopping it (Linux)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class TritonProcess:
    """A running ``tritonserver`` process; use as a context manager or call ``stop()``."""

    def __init__(self, options: ServerOptions, stdout=None, stderr=None):
        self.options = options
        embedded = options.tritonserver is None
        if not embedded and options.backend_dir is None:
            raise ValueError("--tritonserver needs --backend-dir (the server's own backends)")
        self._temporary_backend_dir = options.backend_dir is None
        if options.backend_dir is None:
            options.backend_dir = Path(tempfile.mkdtemp(prefix="triton-backends-"))
        if embedded:
            prepare_backend_dir(options.backend_dir)
        # Its own session: a terminal's Ctrl-C reaches this launcher (which drains, then stops the
        # server) rather than tritonserver directly (whose own shutdown fails in-flight ensembles).
        self.process = subprocess.Popen(
            server_command(options), env=server_environment() if embedded else None, stdout=stdout, stderr=stderr,
            start_new_session=True, preexec_fn=_terminate_with_parent,
        )

    @property
    def http_url(self) -> str:
        return f"localhost:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.options.grpc_port}"

    def url(self, protocol: str) -> str:
        """The endpoint for a client of ``protocol`` ("http" or "grpc")."""
        return self.http_url if protocol == "http" else self.grpc_url

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.options.metrics_port}/metrics"

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until ``/v2/health/ready`` answers 200 (every loaded model is ready)."""
        deadline = time.monotonic() + timeout_s
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} before it was ready")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver was not ready after {timeout_s:.0f} s")

    def stop(self, timeout_s: float | None = None) -> int:
        """Drain (unload models top-down, in-flight requests finish), then SIGTERM."""
        if self.process.poll() is None:
            try:
                drain(self.http_url, timeout_s=self.options.exit_timeout_secs)
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
                print(f"drain skipped: {error}", file=sys.stderr)
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s or self.options.exit_timeout_secs + 30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._temporary_backend_dir:
            shutil.rmtree(self.options.backend_dir, ignore_errors=True)
        return self.process.returncode

    def __enter__(self) -> "TritonProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def free_ports(count: int) -> list[int]:
    """Ports the OS reports free right now (bound then released together)."""
    sockets = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def start_on_free_ports(model_repository: Path, log_path: Path, extra_args: list[str] | None = None,
                        timeout_s: float = 600, models: list[str] | None = None) -> TritonProcess:
    """A ready server on free ports, logging to ``log_path`` (tests and benchmarks use this)."""
    http, grpc, metrics = free_ports(3)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "wb")
    options = ServerOptions(model_repository=model_repository, http_port=http, grpc_port=grpc,
                            metrics_port=metrics, models=models, extra_args=extra_args or [])
    server = TritonProcess(options, stdout=log, stderr=log)
    try:
        server.wait_ready(timeout_s=timeout_s)
    except Exception:
        server.stop()
        sys.stderr.write(log_path.read_text(errors="replace")[-5000:])
        raise
    return server


def _port(flag_value: int | None, env_name: str, default: int) -> int:
    if flag_value is not None:
        return flag_value
    return int(os.environ.get(env_name, default))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--http-port", type=int, help=f"default $TRITON_HTTP_PORT or {DEFAULT_HTTP_PORT}")
    parser.add_argument("--grpc-port", type=int, help=f"default $TRITON_GRPC_PORT or {DEFAULT_GRPC_PORT}")
    parser.add_argument("--metrics-port", type=int, help=f"default $TRITON_METRICS_PORT or {DEFAULT_METRICS_PORT}")
    parser.add_argument("--tritonserver", type=Path, metavar="PATH",
                        help="run this tritonserver (e.g. the container's) instead of the embedded one")
    parser.add_argument("--backend-dir", type=Path,
                        help="the server's backends; default (embedded): a temporary folder laid out from the wheel")
    parser.add_argument("--exit-timeout-secs", type=int, default=30)
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--load-model", action="append", dest="models", metavar="NAME",
                        help="load only these models at start (repeatable); default: every model")
    parser.add_argument("extra_args", nargs="*", help="passed to tritonserver after `--`")
    args = parser.parse_args(argv)
    if not (args.model_repository / ".built").exists():
        parser.error(f"{args.model_repository} is not built: run `make repository` (or `make serve`)")
    options = ServerOptions(
        model_repository=args.model_repository,
        http_port=_port(args.http_port, "TRITON_HTTP_PORT", DEFAULT_HTTP_PORT),
        grpc_port=_port(args.grpc_port, "TRITON_GRPC_PORT", DEFAULT_GRPC_PORT),
        metrics_port=_port(args.metrics_port, "TRITON_METRICS_PORT", DEFAULT_METRICS_PORT),
        backend_dir=args.backend_dir,
        tritonserver=args.tritonserver,
        exit_timeout_secs=args.exit_timeout_secs,
        log_verbose=args.log_verbose,
        models=args.models,
        extra_args=args.extra_args,
    )
    server = TritonProcess(options)
    stopping = threading.Event()

    def on_signal(*_):
        # Drain in a thread: the main thread keeps waiting on the server process.
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=server.stop, daemon=True).start()

    # The server logs to this terminal; we forward Ctrl-C/SIGTERM as a drain, then SIGTERM.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    try:
        server.wait_ready()
        print(
            f"\nTriton is ready: HTTP {options.http_port}, gRPC {options.grpc_port}, "
            f"metrics {options.metrics_port}. Ctrl-C stops it.\n",
            flush=True,
        )
    except (RuntimeError, TimeoutError) as error:
        if stopping.is_set():  # Ctrl-C before it was ready
            return server.process.wait()
        print(f"error: {error}", file=sys.stderr)
        server.stop()
        return 1
    code = server.process.wait()
    server.stop()
    return code


if __name__ == "__main__":
    sys.exit(main())
