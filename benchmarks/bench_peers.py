"""Triton against what a user would pick instead, on the same machine, back to back:

- FastAPI + uvicorn + ONNX Runtime per pipeline (``benchmarks/peers/``: binary bodies, an asyncio
  micro-batcher, the same ONNX files, pre/post-processing code and thread settings);
- Infinity (``infinity-emb``, optimum/ONNX Runtime on the CPU) for ``text_embedding``;
- the in-process limit: the same work in one Python process, batch after batch (no server).

One load generator (``loadgen.py``: closed loop, aiohttp, prepared binary bodies) drives Triton's
public HTTP port and every peer with the same payload bytes at the same concurrency; at each
concurrency the systems are measured one right after the other. perf_analyzer measures Triton once
more at concurrency 16 to show that the two generators agree.

Also the tutorial's table (BERT-base batch 16, ResNet-50 batch 32, Whisper batch 4 per request)."""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from triton_pipelines.server.processes import find_stubs

from . import settings as bench_settings
from .loadgen import Request, Target, bytes_tensor, measure, triton_check, triton_request
from .perf import markdown_table, perf_analyzer
from .report import Point, at, pct, versus

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = ROOT / ".bench" / "peers.json"
TARGET_CONCURRENCY = 16
THREADS = 2  # ONNX Runtime intra-op threads of the in-process limits (the embedded compute models' setting)
# Real Whisper base stops at <|endoftext|>: the clip is transcribed whole (the pipeline's default budget).
MAX_NEW_TOKENS = 224
OCTET = {"Content-Type": "application/octet-stream"}
PIPELINE_MODELS = {
    "text_embedding": ("text_tokenizer", "text_encoder"),
    "image_classification": ("image_preprocess", "resnet50", "classification_postprocess"),
    "speech_recognition": ("audio_features", "whisper_encoder", "whisper_decoder", "whisper_decode"),
}


@dataclass
class PipelineResult:
    pipeline: str
    unit: str
    points: list[Point] = field(default_factory=list)
    limit_throughput: float = 0.0  # in-process, best batch
    limit_batch: int = 1
    limit_p50_ms: float = 0.0  # in-process, one request alone
    memory_mb: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    added_p50_pairs: list[tuple[float, float]] = field(default_factory=list)  # (in-process, Triton) c=1
    saturation_pairs: list[tuple[float, float]] = field(default_factory=list)  # (in-process, Triton peak)


# --- payloads ------------------------------------------------------------------------------------

def text_payloads() -> list[str]:
    from .bench_text import corpus

    return corpus()


def image_payloads() -> list[bytes]:
    from .bench_vision import jpeg_payloads

    return jpeg_payloads()


def speech_payload() -> bytes:
    from .speech_work import clip

    return clip()


def speech_limit(repository: Path, wav: bytes, batch: int, seconds: float) -> tuple[float, float]:
    """In-process: features + the same greedy batch decode, ``batch`` clips at a time, one batch
    after the other: (clips/s, p50 ms per batch)."""
    from .speech_work import Whisper

    whisper = Whisper(repository, THREADS)
    latencies, done, started = [], 0, time.perf_counter()
    while time.perf_counter() - started < seconds or done == 0:
        t0 = time.perf_counter()
        whisper.transcribe([whisper.features(wav) for _ in range(batch)], [MAX_NEW_TOKENS] * batch)
        latencies.append(time.perf_counter() - t0)
        done += batch
    return done / (time.perf_counter() - started), statistics.median(latencies) * 1000


def triton_url(server, model: str) -> str:
    return f"http://{server.http_url}/v2/models/{model}/infer"


def text_targets(server, texts: list[str]) -> dict[str, Target]:
    encoded = [t.encode() for t in texts]
    triton = [triton_request([("text", "BYTES", np.array([[t]], dtype=object))], ["embedding"]) for t in encoded]

    def check_embedding(status: int, body: bytes) -> None:
        if status != 200:
            raise RuntimeError(f"{status}: {body[:300]!r}")
        vector = np.frombuffer(body, "<f4")
        if vector.size != 384 or abs(float(np.linalg.norm(vector)) - 1) > 1e-3:
            raise RuntimeError(f"not a unit 384-d embedding ({vector.size} values)")

    return {"Triton": Target("Triton", triton_url(server, "text_embedding"), triton, triton_check),
            "FastAPI": Target("FastAPI", "/embed", [Request(bytes_tensor([t]), OCTET) for t in encoded],
                              check_embedding)}


def image_targets(server, images: list[bytes], per_request: int = 1) -> dict[str, Target]:
    groups = [[images[(i + j) % len(images)] for j in range(per_request)] for i in range(len(images))]
    triton = [triton_request([("image", "BYTES", np.array([[g] for g in group], dtype=object))],
                             ["labels", "scores", "class_ids"]) for group in groups]
    peer = [Request(bytes_tensor(group), OCTET, items=len(group)) for group in groups]
    return {"Triton": Target("Triton", triton_url(server, "image_classification"), triton, triton_check),
            "FastAPI": Target("FastAPI", "/classify", peer, _json_ok)}


def speech_targets(server, wav: bytes, per_request: int = 1) -> dict[str, Target]:
    triton = [triton_request([("audio", "BYTES", np.array([[wav]] * per_request, dtype=object)),
                              ("max_new_tokens", "INT32", np.full((per_request, 1), MAX_NEW_TOKENS, np.int32))],
                             ["transcript", "token_ids"])]
    peer = [Request(bytes_tensor([wav] * per_request), OCTET, items=per_request)]
    return {"Triton": Target("Triton", triton_url(server, "speech_recognition"), triton, triton_check),
            "FastAPI": Target("FastAPI", f"/transcribe?max_new_tokens={MAX_NEW_TOKENS}", peer, _json_ok)}


def _json_ok(status: int, body: bytes) -> None:
    if status != 200:
        raise RuntimeError(f"{status}: {body[:300]!r}")
    json.loads(body)


def with_base(target: Target, base_url: str) -> Target:
    return Target(target.name, base_url + target.url, target.requests, target.check)


# --- memory --------------------------------------------------------------------------------------

def pss_mb(pid: int) -> float:
    """Proportional set size of one process, in MB: its private pages plus its share of pages it
    shares with others. Summing RSS over Triton's processes would count every Python-backend stub's
    shared-memory region twice (once in the stub, once in tritonserver): measured here, the
    whisper_decode stub held 972 MB RSS of which 63 MB were its own."""
    import psutil

    try:
        return psutil.Process(pid).memory_full_info().pss / 1e6
    except psutil.NoSuchProcess:
        return 0.0


def stub_pss_mb(server, models) -> dict[str, float]:
    """Memory (PSS) of each model's Python-backend stub processes (all instances), in MB."""
    totals: dict[str, float] = {}
    for stub in find_stubs(server.process.pid):
        if stub.model in models:
            totals[stub.model] = totals.get(stub.model, 0.0) + pss_mb(stub.pid)
    return totals


def triton_memory_mb(server, models) -> dict[str, float]:
    """What a pipeline's Triton holds: ``Triton`` = its stubs plus the tritonserver process (PSS;
    the server is shared by every loaded model, so this over-states one pipeline), then each part."""
    stubs = stub_pss_mb(server, models)
    server_mb = server_pss_mb(server)
    return {"Triton": sum(stubs.values()) + server_mb, "Triton tritonserver": server_mb,
            **{f"Triton {model}": mb for model, mb in stubs.items()}}


def gpu_memory_mb(server) -> float | None:
    """``nv_gpu_memory_used_bytes`` summed over the GPUs (Triton exports it only where it sees one)."""
    import urllib.request

    try:
        text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    except OSError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("nv_gpu_memory_used_bytes")]
    return sum(values) / 1e6 if values else None


def server_pss_mb(server) -> float:
    return pss_mb(server.process.pid)


# --- the comparison ------------------------------------------------------------------------------

def compare(name: str, unit: str, targets: dict[str, Target], peers: dict[str, Callable], concurrency,
            seconds: float, min_requests: int, server, result: PipelineResult) -> None:
    """Start the peers, then at each concurrency measure every system back to back."""
    started = {}
    try:
        for peer_name, start in peers.items():
            try:
                started[peer_name] = start()
            except Exception as error:  # reported, the others go on
                result.notes.append(f"{peer_name} could not start: {str(error).strip()[-600:]}")
        systems = {"Triton": targets["Triton"]}
        for peer_name, process in started.items():
            systems[peer_name] = with_base(targets[peer_name], process.base_url)
        for c in concurrency:
            for system, target in systems.items():
                try:
                    load = measure(target, c, seconds=seconds, min_requests=min(min_requests, 4 * c + 8))
                except Exception as error:
                    result.notes.append(f"{system} at concurrency {c} failed: {str(error)[-400:]}")
                    continue
                if load.errors:
                    result.notes.append(f"{system} at concurrency {c}: {load.errors} errors ({load.first_error})")
                result.points.append(Point.from_result(system, load))
                print(f"  {name} {system:8s} c={c:3d} {load.throughput:8.2f} {unit}/s p50 {load.p50:8.1f} "
                      f"p95 {load.p95:8.1f} ms", flush=True)
        for peer_name, process in started.items():
            result.memory_mb[peer_name] = process.pss_bytes() / 1e6
        result.memory_mb.update(triton_memory_mb(server, PIPELINE_MODELS[name]))
    finally:
        for process in started.values():
            process.stop()


def record_limit(result: PipelineResult, limit, batches) -> None:
    """The in-process limit: ``limit(batch)`` → (throughput, p50 ms) for each batch; the best batch
    is the one the saturation pairs compare with."""
    limits = {b: limit(b) for b in batches}
    result.limit_batch = max(limits, key=lambda b: limits[b][0])
    result.limit_throughput = limits[result.limit_batch][0]
    result.limit_p50_ms = limits[1][1]


def triton_peak(result: PipelineResult) -> int:
    """The concurrency at which Triton's throughput peaked in the comparison."""
    return max((p for p in result.points if p.system == "Triton"), key=lambda p: p.throughput).concurrency


def saturation_pair(result: PipelineResult, limit, served) -> None:
    """One back-to-back pair: the in-process limit at its best batch, then Triton at its peak."""
    result.saturation_pairs.append((limit(result.limit_batch)[0], served(triton_peak(result)).throughput))


def text_section(server, s: bench_settings.Settings, traffic: str = "bench") -> PipelineResult:
    """``traffic``: a ``bench_text.TRAFFIC`` name (the bench's texts, or mixed lengths over 3–256 tokens)."""
    from .bench_text import TRAFFIC, in_process
    from .peers.infinity import embedding_request, start_infinity, unavailable_reason
    from .peers.process import start_fastapi_peer

    repository = Path(server.options.model_repository)
    texts = TRAFFIC[traffic]()
    result = PipelineResult("text_embedding" if traffic == "bench" else f"text_embedding_{traffic}", "texts")
    targets = text_targets(server, texts)
    peers = {"FastAPI": lambda: start_fastapi_peer("text", repository)}
    reason = unavailable_reason()
    if reason is None:
        targets["Infinity"] = Target("Infinity", "/embeddings", [embedding_request(t) for t in texts], _json_ok)
        peers["Infinity"] = lambda: start_infinity(repository)
    else:
        result.notes.append(f"Infinity could not run here: {reason}")
    compare("text_embedding", "texts", targets, peers, s.concurrency, s.seconds, s.min_requests, server, result)
    limit = lambda batch: in_process(repository, texts, batch, seconds=s.limit_seconds)  # noqa: E731
    served = lambda concurrency: measure(targets["Triton"], concurrency, seconds=s.seconds,  # noqa: E731
                                         min_requests=s.min_requests)
    record_limit(result, limit, (1, 8, 32) if s.mode == "full" else (1, 8))
    # Back-to-back pairs: in-process batch 1 p50 then Triton at concurrency 1; in-process best batch
    # then Triton at its peak concurrency.
    for _ in range(s.pairs):
        result.added_p50_pairs.append((limit(1)[1], served(1).p50))
        saturation_pair(result, limit, served)
    return result


def vision_section(server, s: bench_settings.Settings) -> PipelineResult:
    from .bench_vision import in_process
    from .peers.process import start_fastapi_peer

    repository = Path(server.options.model_repository)
    images = image_payloads()
    result = PipelineResult("image_classification", "images")
    compare("image_classification", "images", image_targets(server, images),
            {"FastAPI": lambda: start_fastapi_peer("vision", repository)},
            s.concurrency, s.seconds, s.min_requests, server, result)
    triton = image_targets(server, images)["Triton"]
    limit = lambda batch: in_process(repository, images, batch, seconds=s.limit_seconds)  # noqa: E731
    record_limit(result, limit, (1, 8, 16) if s.mode == "full" else (1, 8))
    for _ in range(s.pairs):
        saturation_pair(result, limit, lambda concurrency: measure(
            triton, concurrency, seconds=s.seconds, min_requests=s.min_requests))
    return result


def speech_section(server, s: bench_settings.Settings) -> PipelineResult:
    from .peers.process import start_fastapi_peer

    repository = Path(server.options.model_repository)
    wav = speech_payload()
    result = PipelineResult("speech_recognition", "clips")
    compare("speech_recognition", "clips", speech_targets(server, wav),
            {"FastAPI": lambda: start_fastapi_peer("speech", repository)},
            s.speech_concurrency, s.speech_seconds, max(8, s.min_requests // 2), server, result)
    seconds = max(s.limit_seconds, 6.0)
    triton = speech_targets(server, wav)["Triton"]
    limit = lambda batch: speech_limit(repository, wav, batch, seconds)  # noqa: E731
    record_limit(result, limit, (1, 2, 4) if s.mode == "full" else (1, 2))
    for _ in range(s.pairs):
        saturation_pair(result, limit, lambda concurrency: measure(
            triton, concurrency, seconds=s.speech_seconds, min_requests=min(2 * concurrency, s.min_requests // 2)))
    return result


# --- the tutorial's table ------------------------------------------------------------------------

@dataclass
class TableRow:
    model: str
    batch: int
    system: str
    mean_ms: float
    p95_ms: float
    p99_ms: float
    throughput: float  # inferences/s (sequences, images, clips)
    memory_mb: float


def tutorial_table(server, s: bench_settings.Settings) -> tuple[list[TableRow], dict[str, float], list[str]]:
    """Each model at the tutorial's batch size, one request at a time: Triton, the FastAPI peer
    and the in-process limit (same batch, same payload)."""
    from triton_pipelines.pipelines.onnx_runner import OnnxBatchRunner

    from .bench_text import full_length_tokens
    from .bench_vision import in_process as vision_limit
    from .peers.process import start_fastapi_peer

    repository = Path(server.options.model_repository)
    rows: list[TableRow] = []
    limits: dict[str, float] = {}
    notes: list[str] = []

    def run(model: str, batch: int, targets: dict[str, Target], peer_start, stub_models):
        peer = None
        try:
            peer = peer_start()
            systems = {"Triton": targets["Triton"], "FastAPI": with_base(targets["FastAPI"], peer.base_url)}
            for system, target in systems.items():
                load = measure(target, 1, seconds=1.0, warmup_s=0.0, min_requests=s.table_requests)
                gpu = gpu_memory_mb(server) if system == "Triton" else None
                memory = (gpu if gpu is not None else triton_memory_mb(server, stub_models)["Triton"]
                          if system == "Triton" else peer.pss_bytes() / 1e6)
                rows.append(TableRow(model, batch, system, load.mean, load.p95, load.p99, load.throughput, memory))
                print(f"  table {model} {system} {load.throughput:.2f}/s mean {load.mean:.0f} ms", flush=True)
        except Exception as error:
            notes.append(f"{model}: {str(error)[-400:]}")
        finally:
            if peer is not None:
                peer.stop()

    # BERT-base, 16 sequences of 128 tokens per request.
    if (repository / "bert_base_encoder").exists():
        length, batch = 128, 16
        tokens = full_length_tokens(repository, text_payloads()[:batch], length)
        triton = [triton_request([("input_ids", "INT64", tokens.input_ids),
                                  ("attention_mask", "INT64", tokens.attention_mask)], ["last_hidden_state"])]
        peer = [Request(tokens.input_ids.astype("<i8").tobytes() + tokens.attention_mask.astype("<i8").tobytes(),
                        OCTET, items=batch)]
        run("BERT-base (bert_base_encoder, 128 tokens)", batch,
            {"Triton": Target("Triton", triton_url(server, "bert_base_encoder"), triton, triton_check),
             "FastAPI": Target("FastAPI", f"/encode?batch={batch}&length={length}", peer, _json_free_ok)},
            lambda: start_fastapi_peer("text", repository, env={"PEER_ENCODE_MODEL": "bert_base_encoder"}),
            ("bert_base_encoder",))
        runner = OnnxBatchRunner(repository / "bert_base_encoder" / "1" / "model.onnx", intra_op_threads=THREADS)
        feed = {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}
        runner.run([feed])
        started, done = time.perf_counter(), 0
        while done < s.table_requests:
            runner.run([feed])
            done += 1
        limits["BERT-base"] = done * batch / (time.perf_counter() - started)
        del runner
    # ResNet-50 through the image pipeline, 32 JPEGs per request.
    images = image_payloads()
    run("ResNet-50 (image_classification)", 32, image_targets(server, images, per_request=32),
        lambda: start_fastapi_peer("vision", repository), PIPELINE_MODELS["image_classification"])
    limits["ResNet-50"] = vision_limit(repository, images * 2, 32, seconds=s.limit_seconds)[0]
    # Whisper through the speech pipeline, 4 clips per request.
    wav = speech_payload()
    run("Whisper base (speech_recognition)", 4, speech_targets(server, wav, per_request=4),
        lambda: start_fastapi_peer("speech", repository), PIPELINE_MODELS["speech_recognition"])
    limits["Whisper"] = speech_limit(repository, wav, 4, seconds=s.limit_seconds)[0]
    return rows, limits, notes


def _json_free_ok(status: int, body: bytes) -> None:
    if status != 200:
        raise RuntimeError(f"{status}: {body[:300]!r}")


# --- report --------------------------------------------------------------------------------------

def agreement(server, texts: list[str], s: bench_settings.Settings) -> list[list]:
    """Triton measured by both generators at concurrency 16 (HTTP, binary tensors, public port)."""
    from .bench_text import text_input_data

    ours = measure(text_targets(server, texts)["Triton"], TARGET_CONCURRENCY, seconds=s.seconds,
                   min_requests=s.min_requests)
    theirs = perf_analyzer("text_embedding", server.http_url, TARGET_CONCURRENCY, input_data=text_input_data(texts),
                           protocol="http", measurement_ms=int(s.seconds * 1000))
    return [["loadgen.py (aiohttp, closed loop)", ours.throughput, ours.p50, ours.p95, ours.p99],
            ["perf_analyzer (-i http, binary)", theirs.throughput, theirs.p50_ms, theirs.p95_ms, theirs.p99_ms]]


def curve_table(result: PipelineResult) -> str:
    systems = sorted({p.system for p in result.points}, key=lambda n: (n != "Triton", n))
    rows = []
    for c in sorted({p.concurrency for p in result.points}):
        row = [c]
        for system in systems:
            point = at(result.points, system, c)
            row += [point.throughput, point.p50_ms, point.p95_ms, point.p99_ms] if point else ["—"] * 4
        rows.append(row)
    headers = ["concurrency"] + [f"{system} {col}" for system in systems
                                 for col in (f"{result.unit}/s", "p50 ms", "p95 ms", "p99 ms")]
    return markdown_table(headers, rows)


def summary_lines(result: PipelineResult) -> list[str]:
    lines = []
    for peer in sorted({p.system for p in result.points} - {"Triton"}):
        vs = versus(result.points, "Triton", peer, TARGET_CONCURRENCY)
        if vs is None:
            lines.append(f"- vs {peer}: not measured at concurrency {TARGET_CONCURRENCY}.")
            continue
        wanted = 1.0  # no tax for Triton: at least the peer's throughput at equal or better p95
        lines.append(f"- vs {peer} at concurrency {TARGET_CONCURRENCY}: **{vs.throughput_ratio:.2f}x** the "
                     f"throughput, p95 {vs.p95_ours:.0f} ms against {vs.p95_theirs:.0f} ms "
                     f"(target ≥ {wanted:.1f}x at equal or better p95: **{'met' if vs.meets(wanted) else 'missed'}**).")
    if result.saturation_pairs:
        ratio = statistics.median(served / local for local, served in result.saturation_pairs)
        lines.append(f"- vs the in-process limit (batch {result.limit_batch}, {result.limit_throughput:.1f} "
                     f"{result.unit}/s): **{ratio:.0%}** at saturation (median of {len(result.saturation_pairs)} "
                     f"back-to-back pairs; target ≥ 95%: **{'met' if ratio >= 0.95 else 'missed'}**).")
    if result.added_p50_pairs:
        added = statistics.median(served - local for local, served in result.added_p50_pairs)
        local_p50 = statistics.median(local for local, _ in result.added_p50_pairs)
        # text: at most 1.5 ms; image and speech (tens to hundreds of ms of compute): at most 5%
        allowed, target = ((1.5, "≤ 1.5 ms") if result.pipeline.startswith("text")
                           else (0.05 * local_p50, f"≤ 5% of {local_p50:.0f} ms"))
        lines.append(f"- added p50 at concurrency 1 over in-process: **{added:+.2f} ms** (median of "
                     f"{len(result.added_p50_pairs)} pairs: " + ", ".join(
                         f"{local:.2f} → {served:.2f}" for local, served in result.added_p50_pairs)
                     + f"; target {target}: **{'met' if added <= allowed else 'missed'}**).")
    memory = ", ".join(f"{name} {mb:.0f} MB" for name, mb in result.memory_mb.items())
    if memory:
        lines.append(f"- memory after the runs (PSS: pages shared between processes counted once; Triton = "
                     f"its stubs plus tritonserver, which every loaded model shares): {memory}.")
        peer = result.memory_mb.get("FastAPI")
        if peer:
            ratio = result.memory_mb["Triton"] / peer
            lines.append(f"- memory vs FastAPI: **{ratio:.2f}x** (target ≤ 1.2x: **{'met' if ratio <= 1.2 else 'missed'}**).")
    lines += [f"- note: {note}" for note in result.notes]
    return lines


def table_markdown(rows: list[TableRow], limits: dict[str, float]) -> str:
    out = []
    by_model: dict[str, list[TableRow]] = {}
    for row in rows:
        by_model.setdefault(row.model, []).append(row)
    for model, model_rows in by_model.items():
        triton = next((r for r in model_rows if r.system == "Triton"), None)
        peer = next((r for r in model_rows if r.system == "FastAPI"), None)
        limit = next((v for k, v in limits.items() if model.startswith(k)), float("nan"))
        for row in model_rows:
            out.append([row.model, row.batch, row.system, row.mean_ms, row.p95_ms, row.p99_ms, row.throughput,
                        row.memory_mb, pct(row.throughput / limit) if limit == limit else "n/a",
                        f"{triton.throughput / peer.throughput:.2f}x" if row is triton and peer else ""])
    return markdown_table(["model", "batch", "system", "mean ms", "p95 ms", "p99 ms", "inferences/s",
                           "memory MB", "of in-process limit", "Triton / FastAPI"], out)


def run(server) -> str:
    from . import plots

    s = bench_settings.current()
    load_before = os.getloadavg()
    started = time.monotonic()
    results = [text_section(server, s), text_section(server, s, "mixed"), vision_section(server, s),
               speech_section(server, s)]
    rows, limits, table_notes = tutorial_table(server, s)
    agree = agreement(server, text_payloads(), s)
    load_after = os.getloadavg()
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"results": [asdict(r) for r in results], "table": [asdict(r) for r in rows],
                                   "limits": limits}, indent=1))
    images = [plots.curves(r, DOCS / f"bench_{r.pipeline}.png") for r in results]
    elapsed = time.monotonic() - started
    lines = [
        "## Triton against the alternatives (FastAPI, Infinity, in-process)",
        "",
        f"Mode **{s.mode}** ({elapsed / 60:.1f} min for this section). 1-minute load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after, on {os.cpu_count()} cores.",
        "",
        "Every system runs on this machine with the same ONNX files, the same pre/post-processing code and "
        "ONNX Runtime with 2 intra-op threads. One load generator (`benchmarks/loadgen.py`: closed loop, "
        "aiohttp, bodies prepared once) sends the same payload bytes to each: Triton's binary tensor protocol "
        "on its public HTTP port (through nginx), a raw binary body to the FastAPI peers (the bytes of the "
        "same BYTES tensor), OpenAI-style JSON to Infinity (its API; embeddings back in base64). At each "
        "concurrency the systems are measured one right after the other. Peers: "
        "`benchmarks/peers/` (uvicorn with uvloop and httptools, one worker, an asyncio micro-batcher that "
        "batches whatever waits while the model runs; pre-processing on a thread pool, pipelined with the "
        "model thread); Infinity 0.0.78 with `--engine optimum --device cpu --pooling-method mean` on a "
        "local folder holding the served `text_encoder` ONNX file and MiniLM's tokenizer.",
        "",
        "Do the two load generators agree? Triton `text_embedding` at concurrency 16, same texts, back to back:",
        "",
        markdown_table(["generator", "texts/s", "p50 ms", "p95 ms", "p99 ms"], agree),
        "",
    ]
    for result, image in zip(results, images):
        lines += [f"### {result.pipeline}", "", f"![{result.pipeline}]({image.name})", "", curve_table(result), ""]
        lines += summary_lines(result) + [""]
    lines += [
        "### The tutorial's table",
        "",
        "One request at a time, each carrying the tutorial's batch: BERT-base 16 sequences of 128 tokens "
        "(`bert_base_encoder`, random weights), ResNet-50 32 JPEGs (`image_classification`), Whisper 4 clips "
        "of ~10 s of English speech (`speech_recognition`, real Whisper base weights, transcribed to the end). Memory (PSS, shared pages counted once): Triton's "
        "Python-backend stubs of the model (all instances) plus the tritonserver process, which every loaded model shares "
        f"({server_pss_mb(server):.0f} MB; on a GPU, `nv_gpu_memory_used_bytes` instead), the peer's whole process. The limit is the same batch in-process, "
        "back to back.",
        "",
        table_markdown(rows, limits),
        "",
    ]
    lines += [f"- note: {note}" for note in table_notes]
    return "\n".join(lines).rstrip()
