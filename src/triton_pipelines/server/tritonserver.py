"""How one ``tritonserver`` is started: the launcher's options, the command line (loopback ports,
explicit model control, control APIs behind the key, Python-backend shared memory), the environment
and backend folder of the embedded binary, and how long its start-up load may take."""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from triton_pipelines.limits import (CLIENT_CANCEL_PARAMETER, CLIENT_DEADLINE_PARAMETER, DEFAULT_MAX_INFLIGHT_BYTES,
                                    DEFAULT_RESPONSE_CACHE_BYTES, LOOPBACK)
from triton_pipelines.gateway.keys import KEY_ID_PARAMETER
from triton_pipelines.server.control import restricted_api_flags
from triton_pipelines.repository.contract import PYTHON_BACKEND_SHM_CONFIG
from triton_pipelines.front.nginx_config import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_JSON_BYTES
from triton_pipelines.server.state import DEFAULT_HTTP_PORT
from triton_pipelines.telemetry.tracing import TraceSettings

DEFAULT_GRPC_PORT = 8001
DEFAULT_METRICS_PORT = 8002
# Python-backend shared memory per stub (repository.contract.PYTHON_SHM_*: the planner sizes /dev/shm with them).
PYTHON_BACKEND_CONFIG = PYTHON_BACKEND_SHM_CONFIG
# Latency summaries (nv_inference_{request,queue,compute_infer}_summary_us, quantiles 0.5 to 0.999):
# 2.51 has no latency histograms for non-decoupled models, and p99 queue time needs one or the other.
METRICS_CONFIG = ("summary_latencies=true",)
# How long the start-up load may take before the launcher gives up (and the container restarts).
# The one source of this value: docker-compose.yml's healthcheck start_period and the Kubernetes
# startup probe are at least this long (tests/unit/deploy/test_images.py, tests/unit/deploy/test_k8s.py). Whisper
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
    # Request bytes in flight (limits.DEFAULT_MAX_INFLIGHT_BYTES): the native ports' screens together,
    # and the /v1 frontend on its own; None: half of it per client; 0: no per-client share.
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    max_inflight_bytes_per_client: int | None = None
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
    # Triton's local response cache, bytes of host memory per tritonserver; 0: off (response_cache_flags).
    response_cache_bytes: int = DEFAULT_RESPONSE_CACHE_BYTES


def request_bytes_flags(options: ServerOptions) -> list[str]:
    """The request bytes in flight, as the screens' and the /v1 frontend's flags."""
    flags = [f"--max-inflight-bytes={options.max_inflight_bytes}"]
    if options.max_inflight_bytes_per_client is not None:
        flags.append(f"--max-inflight-bytes-per-client={options.max_inflight_bytes_per_client}")
    return flags


@dataclass(frozen=True)
class InternalPorts:
    """tritonserver's own ports, on loopback only."""
    http: int
    grpc: int
    metrics: int


# tritonserver's --grpc-infer-allocation-pool-size (above): none kept for reuse.
GRPC_ALLOCATION_POOL_SIZE = 0


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
        # the API key id the request screen resolved reaches the router as a request parameter, a
        # gRPC client's deadline the models (limits.CLIENT_DEADLINE_PARAMETER), and every request's
        # id on the cancel board (limits.CLIENT_CANCEL_PARAMETER)
        f"--http-header-forward-pattern=^({KEY_ID_PARAMETER}|{CLIENT_CANCEL_PARAMETER})$",
        f"--grpc-header-forward-pattern=^({KEY_ID_PARAMETER}|{CLIENT_DEADLINE_PARAMETER}|{CLIENT_CANCEL_PARAMETER})$",
        # Triton's gRPC frontend keeps up to 8 request/response objects (default) for reuse, each
        # holding the last message it carried: 8 large requests stayed resident for good (measured:
        # 24+24 requests of 48 MiB, 4 in flight, tritonserver RSS 40 MB -> 862 MB and never less;
        # with 0, 345 MB; glibc tunables, tcmalloc and jemalloc changed nothing). One allocation per
        # request instead costs nothing measurable (1 KiB requests at 8 in flight: within noise).
        f"--grpc-infer-allocation-pool-size={GRPC_ALLOCATION_POOL_SIZE}",
    ]
    backend_config = (*PYTHON_BACKEND_CONFIG, f"shm-region-prefix-name={shm_prefix}")
    command += [f"--backend-config=python,{setting}" for setting in backend_config]
    command += [f"--metrics-config={setting}" for setting in METRICS_CONFIG]
    command += response_cache_flags(options)
    command += trace_flags()
    return command + list(options.extra_args)


def trace_flags() -> list[str]:
    """tritonserver's OpenTelemetry mode when ``$OTEL_EXPORTER_OTLP_ENDPOINT`` is set (``telemetry/tracing.py``:
    it traces the requests the front passes a context, and the stubs' BLS calls within them); none else."""
    settings = TraceSettings.from_environment()
    return [] if settings is None else settings.triton_flags()


def response_cache_flags(options: ServerOptions) -> list[str]:
    """Triton's ``local`` cache of ``options.response_cache_bytes`` (none at 0). Only models whose
    config says ``response_cache { enable: true }`` use it (the builder's choice: docs/operations.md).
    The embedded binary's cache library is in the wheel (``tritonserver/caches/local``), not in
    tritonserver's default ``/opt/tritonserver/caches``, where the container's is."""
    if not options.response_cache_bytes:
        return []
    flags = [f"--cache-config=local,size={options.response_cache_bytes}"]
    if options.tritonserver is None:
        flags.append(f"--cache-directory={pytriton_dir() / 'caches'}")
    return flags


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
