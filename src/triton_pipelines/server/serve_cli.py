"""Run ``tritonserver`` 2.51 on a model repository, behind nginx, supervised, in the foreground.

The flags of ``python -m triton_pipelines serve`` (``launcher.main``): the parser, the checks of
their values, the ports from flags, then ``$TRITON_*``, then the defaults, and the
``ServerOptions`` they make.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from triton_pipelines.errors import ConfigError
from triton_pipelines.limits import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_INFLIGHT, DEFAULT_MAX_INFLIGHT_BYTES,
                                     DEFAULT_MAX_JSON_BYTES, DEFAULT_RESPONSE_CACHE_BYTES, MIN_RESPONSE_CACHE_BYTES, RESPONSE_CACHE_ENV)
from triton_pipelines.repository.backends import models_to_load
from triton_pipelines.repository.routes import RouteTable
from triton_pipelines.server.state import STATE_ENV, resolve_state_dir
from triton_pipelines.server.tritonserver import (DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_METRICS_PORT, LOOPBACK,
                                                  ServerOptions)


def _env_int(name: str, default: int | None) -> int | None:
    """``$name`` as a whole number, ``default`` when unset or empty; ConfigError naming it otherwise."""
    text = os.environ.get(name, "")
    if text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"${name}={text!r} must be a whole number") from None


def _port(flag_value: int | None, env_name: str, default: int) -> int:
    if flag_value is not None:
        return flag_value
    return _env_int(env_name, default)


def check_repository(repository: Path, models: list[str] | None) -> None:
    """What the server would otherwise fail on after starting: a ``--load-model`` name the repository
    lacks, and the router's route table (the /v1 frontend reads it too)."""
    if models:
        missing = sorted(name for name in models if not (repository / name / "config.pbtxt").is_file())
        if missing:
            known = sorted(p.parent.name for p in repository.glob("*/config.pbtxt"))
            raise ConfigError(f"--load-model {', '.join(missing)}: not in {repository} (its models: {', '.join(known)})")
    routes = repository / "router" / "1" / "routes.yaml"
    if routes.is_file() and (models is None or "router" in models):
        RouteTable.load(routes)


def build_parser() -> argparse.ArgumentParser:
    """The flags; their defaults read the environment now (``$TRITON_*``)."""
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
    parser.add_argument("--max-inflight", type=int, default=_env_int("TRITON_MAX_INFLIGHT", DEFAULT_MAX_INFLIGHT),
                        help="inference requests in flight on the public ports together; more are refused at once "
                             f"with 503 / UNAVAILABLE (default $TRITON_MAX_INFLIGHT or {DEFAULT_MAX_INFLIGHT})")
    parser.add_argument("--max-inflight-per-client", type=int,
                        default=_env_int("TRITON_MAX_INFLIGHT_PER_CLIENT", None),
                        help="one client address's share of --max-inflight; more from it are refused first "
                             "(default $TRITON_MAX_INFLIGHT_PER_CLIENT or half of --max-inflight; 0: no share). "
                             "Behind a load balancer or NAT every client has its address: raise it or use 0")
    parser.add_argument("--max-inflight-bytes", type=int,
                        default=_env_int("TRITON_MAX_INFLIGHT_BYTES", DEFAULT_MAX_INFLIGHT_BYTES),
                        help="request bytes in flight beside the count: the native ports together, and /v1 on its "
                             "own; a request that does not fit is refused with 503 / UNAVAILABLE (default "
                             f"$TRITON_MAX_INFLIGHT_BYTES or {DEFAULT_MAX_INFLIGHT_BYTES >> 20} MiB; at least "
                             "--max-body-bytes)")
    parser.add_argument("--max-inflight-bytes-per-client", type=int,
                        default=_env_int("TRITON_MAX_INFLIGHT_BYTES_PER_CLIENT", None),
                        help="one client address's share of --max-inflight-bytes (default "
                             "$TRITON_MAX_INFLIGHT_BYTES_PER_CLIENT or half of it; 0: no share; else at least "
                             "--max-body-bytes)")
    parser.add_argument("--expose-internal-models", action="store_true",
                        help="serve inference for every model on the public ports, not only the pipelines and "
                             "the router (e.g. to measure one compute model with perf_analyzer)")
    parser.add_argument("--tritonserver", type=Path, metavar="PATH",
                        help="run this tritonserver (e.g. the container's) instead of the embedded one")
    parser.add_argument("--backend-dir", type=Path,
                        help="the server's backends; default (embedded): a temporary folder laid out from the wheel")
    parser.add_argument("--exit-timeout-secs", type=int, default=30)
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=_env_int("TRITON_REPLICAS", 1),
                        help="tritonserver processes behind the one public front, round robin "
                             "(default $TRITON_REPLICAS or 1)")
    parser.add_argument("--load-model", action="append", dest="models", metavar="NAME",
                        help="load only these models at start (repeatable); default: every model")
    parser.add_argument("--response-cache-bytes", type=int,
                        default=_env_int(RESPONSE_CACHE_ENV, DEFAULT_RESPONSE_CACHE_BYTES),
                        help="host memory of Triton's response cache per replica, for the models built with "
                             f"response_cache enabled (default ${RESPONSE_CACHE_ENV} or "
                             f"{DEFAULT_RESPONSE_CACHE_BYTES >> 20} MiB; 0: off)")
    parser.add_argument("--no-pipeline-warmup", action="store_true",
                        help="do not send one request through every ensemble before announcing ready")
    parser.add_argument("extra_args", nargs="*", help="passed to tritonserver after `--`")
    return parser


def parse_options(argv: list[str] | None = None) -> ServerOptions:
    """The flags as the launcher's ``ServerOptions``; exits with the usage (argparse) when one is wrong."""
    parser = build_parser()
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
    for flag, value in (("--max-inflight-bytes", args.max_inflight_bytes),
                        ("--max-inflight-bytes-per-client", args.max_inflight_bytes_per_client)):
        if value is not None and value < args.max_body_bytes and not (value == 0 and flag.endswith("client")):
            parser.error(f"{flag} ({value}) must be at least --max-body-bytes ({args.max_body_bytes}): "
                         "the largest legal request must fit" + (" (0: no share)" if flag.endswith("client") else ""))
    if args.response_cache_bytes and not MIN_RESPONSE_CACHE_BYTES <= args.response_cache_bytes:
        parser.error(f"--response-cache-bytes must be 0 (off) or at least {MIN_RESPONSE_CACHE_BYTES} "
                     f"({MIN_RESPONSE_CACHE_BYTES >> 20} MiB)")
    http_port = _port(args.http_port, "TRITON_HTTP_PORT", DEFAULT_HTTP_PORT)
    options = ServerOptions(
        model_repository=args.model_repository,
        http_port=http_port,
        grpc_port=_port(args.grpc_port, "TRITON_GRPC_PORT", DEFAULT_GRPC_PORT),
        metrics_port=_port(args.metrics_port, "TRITON_METRICS_PORT", DEFAULT_METRICS_PORT),
        listen_address=args.listen_address,
        state_dir=resolve_state_dir(args.state_dir, http_port),
        max_body_bytes=args.max_body_bytes,
        max_json_bytes=args.max_json_bytes,
        max_inflight=args.max_inflight,
        max_inflight_per_client=args.max_inflight_per_client,
        max_inflight_bytes=args.max_inflight_bytes,
        max_inflight_bytes_per_client=args.max_inflight_bytes_per_client,
        expose_internal_models=args.expose_internal_models,
        backend_dir=args.backend_dir,
        tritonserver=args.tritonserver,
        exit_timeout_secs=args.exit_timeout_secs,
        log_verbose=args.log_verbose,
        models=args.models,
        replicas=args.replicas,
        warm_pipelines=not args.no_pipeline_warmup,
        extra_args=args.extra_args,
        response_cache_bytes=args.response_cache_bytes,
    )
    check_repository(options.model_repository, options.models)
    if options.models is None and options.backend_dir is not None:
        options.models = models_to_load(options.model_repository, options.backend_dir)  # backends.py
    return options
