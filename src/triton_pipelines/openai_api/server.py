"""The OpenAI-compatible frontend: ``/v1`` on the public HTTP port (nginx routes ``/v1/`` here).

    python -m triton_pipelines frontend --port P --triton-grpc 127.0.0.1:G [--triton-grpc ...] \\
        --model-repository model_repository

One aiohttp process, started, supervised, restarted and drained by the launcher
(``server.frontend_process.FrontendProcess``). It talks to Triton over each replica's loopback gRPC port
with ``tritonclient.grpc.aio`` (round robin, a refused replica skipped), through Triton's own
batching: ``/v1/embeddings`` sends at most the pipeline's max batch (64) strings per request, so a
list of 64 strings is one ``text_embedding`` request. Audio goes to ``speech_recognition_stream``
(decoupled, gRPC ModelStreamInfer): its partial transcripts become the SSE ``transcript.text.delta``
events; without ``stream`` only its final response is asked for. Chat goes through
``gateway.service.GatewayService`` on this process's event loop (``acomplete``/``astream``), as the
native router's gateway tasks do: the key's model allow-list, budget, rpm and tpm, fallbacks,
cooldowns and the spend ledger (``$SPEND_DATABASE_URL``, which the launcher sets to the ledger the
replicas' routers use, so both paths spend one budget).

What a request may be and what it gets back is ``protocol.py``; the application, its keys and
middleware ``app.py``; the endpoints ``models.py``, ``embeddings.py``, ``audio.py`` (with
``multipart.py``), ``chat.py``; Triton's clients ``triton_grpc.py`` and ``triton_http.py``; the
metrics ``metrics.py``. This module starts the process and stops it.
Keys (``$TRITON_API_KEYS_FILE``, ``gateway/keys.py``; the gateway service's key ring): every ``/v1``
request needs a known bearer key when the file is set; the key found is ``request["api_key"]``.
Keys never reach logs, metrics, responses or the ledger (a hash and the name).
Metrics: ``GET /metrics`` on the loopback port (``metrics.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path

from triton_pipelines.front.places import byte_budget
from triton_pipelines.gateway.keys import keys_from_environment
from triton_pipelines.openai_api import protocol as proto
from triton_pipelines.openai_api.app import Frontend
from triton_pipelines.openai_api.triton_grpc import Triton
from triton_pipelines.openai_api.triton_http import TritonHttp
from triton_pipelines.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_INFLIGHT_BYTES
from triton_pipelines.repository.contract import BuiltManifest


def token_counter(model_repository: Path):
    """Real token counts (no padding) of texts as the served ``text_tokenizer`` tokenizes them: its
    own ``tokenizer.json`` and ``max_sequence_length`` (truncation), from the repository."""
    from triton_pipelines.pipelines.text import TextTokenizer

    folder = model_repository / "text_tokenizer"
    if not (folder / "1" / "tokenizer.json").exists():
        return lambda texts: 0
    tokenizer = TextTokenizer.served(folder)  # padding (buckets or not) is not in the mask's sum
    return lambda texts: int(tokenizer.encode(list(texts)).attention_mask.sum())


def route_table(model_repository: Path):
    from triton_pipelines.repository.routes import RouteTable

    for path in (model_repository / "router" / "1" / "routes.yaml", Path("data/routes.yaml")):
        if path.exists():
            return RouteTable.load(path)
    return None


async def serve(args: argparse.Namespace) -> None:
    import warnings

    from aiohttp import multipart, web

    # aiohttp warns of each malformed Content-Disposition it reads (a line per distinct header, a
    # client's to choose); multipart.py answers each with a 400 saying what is wrong.
    for category in (multipart.BadContentDispositionHeader, multipart.BadContentDispositionParam):
        warnings.filterwarnings("ignore", category=category)

    from triton_pipelines.pipelines.speech.config import LANGUAGE_CODES

    try:
        built = BuiltManifest.read(args.model_repository)
    except (OSError, ValueError):
        built = None
    table = route_table(args.model_repository)
    catalog = proto.ModelCatalog.build(
        built.public_models if built else None, table.prices if table else (), created=int(time.time()),
        provenance={name: built.provenance_of(name) for name in proto.SELF_HOSTED_MODELS} if built else None)
    gateway = None
    if table is not None:
        from triton_pipelines.gateway.service import GatewayService

        # Keys from $TRITON_API_KEYS_FILE, the ledger from $SPEND_DATABASE_URL (the launcher's, shared
        # with the routers), the gateway from $LLM_GATEWAY_*: the router's service, in this process.
        gateway = GatewayService.from_environment(
            table, log=lambda line: print(f"[openai] {line}", file=sys.stderr, flush=True))
    keys = gateway.keys if gateway is not None else keys_from_environment()
    triton = Triton(args.triton_grpc)
    triton_http = TritonHttp(args.triton_http, triton.grpcclient) if args.triton_http else None
    frontend = Frontend(triton, catalog, keys, token_counter(args.model_repository), gateway, LANGUAGE_CODES,
                        triton_http=triton_http,
                        request_bytes=byte_budget(args.max_inflight_bytes, args.max_inflight_bytes_per_client,
                                                  DEFAULT_MAX_BODY_BYTES))
    if gateway is not None:
        gateway.recorder = frontend.metrics  # spend, budgets, fallbacks, cooldowns, refusals of /v1 chat
        gateway.publish_budgets()
    runner = web.AppRunner(frontend.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, args.listen, args.port, backlog=1024)
    await site.start()
    print(f"[openai] serving /v1 on {args.listen}:{args.port} ({len(catalog.entries())} models, keys "
          f"{'required' if keys else 'off'})", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    # Drain: no new connections, requests in flight finish (up to the grace period).
    frontend.draining = True
    await site.stop()
    await runner.shutdown()
    await runner.cleanup()
    await triton.close()
    if triton_http is not None:
        await triton_http.close()
    if gateway is not None:
        await frontend.chat.finish_chat_calls(timeout_s=table.gateway.deadline_s)
        await gateway.client.close()
        if gateway.ledger is not None:
            gateway.ledger.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--listen", default="127.0.0.1")
    parser.add_argument("--triton-grpc", action="append", required=True, help="host:port of a replica's gRPC port")
    parser.add_argument("--triton-http", action="append", default=[],
                        help="host:port of a replica's loopback HTTP port (optional): /v1/embeddings then calls "
                             "Triton over HTTP (less CPU and latency per call than gRPC); audio stays on gRPC")
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    # /v1's request bytes in flight and one client's share (serve --max-inflight-bytes)
    parser.add_argument("--max-inflight-bytes", type=int, default=DEFAULT_MAX_INFLIGHT_BYTES)
    parser.add_argument("--max-inflight-bytes-per-client", type=int, default=None)
    args = parser.parse_args(argv)
    if args.triton_http and len(args.triton_http) != len(args.triton_grpc):
        parser.error("--triton-http: one per replica, in the order of --triton-grpc")
    event_loop_runner()(serve(args))
    return 0


def event_loop_runner():
    """uvloop's runner (requirements-serving.txt; ~0.14 ms less CPU per /v1/embeddings request than
    asyncio's loop on the 2-core machine), or asyncio's where uvloop is not installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


if __name__ == "__main__":
    sys.exit(main())
