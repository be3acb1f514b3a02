"""text_embedding through Triton (perf_analyzer, gRPC) next to the same work in-process, the
length-batching strategies, and the full-size bert-base encoder."""

from __future__ import annotations

import copy
import json
import statistics
import time
from pathlib import Path

import numpy as np

from triton_pipelines.pipelines.onnx_runner import LengthGrouping, OnnxBatchRunner
from triton_pipelines.pipelines.text import LENGTH_BUCKETS, TextTokenizer

from .perf import BENCH_DIR, markdown_table, perf_analyzer

CONCURRENCY = (1, 2, 4, 8, 16, 32)
PAIRS = 3
THREADS = 2  # the embedded text_encoder's intra_op_threads; the in-process baseline uses the same
WORDS = ("order refund password shipping delivery account invoice subscription update error "
         "crash login package tracking charge card cancel support help question").split()


def corpus(count: int = 64, seed: int = 0) -> list[str]:
    """Support-desk-like texts, 3 to 120 words (a long tail, like real traffic)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=2.8, sigma=0.8, size=count), 3, 120).astype(int)
    return [" ".join(rng.choice(WORDS, size=n)) for n in lengths]


def mixed_corpus(count: int = 64, seed: int = 1) -> list[str]:
    """Mixed lengths over the whole range the encoder takes: 1 to ~300 words, log-uniform, so 3 to
    256 tokens (truncated there) with as many short texts as long ones (docs/benchmarks.md)."""
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(0, np.log(300), size=count)).astype(int).clip(1, 300)
    return [" ".join(rng.choice(WORDS, size=n)) for n in lengths]


TRAFFIC = {"bench": corpus, "mixed": mixed_corpus}  # name → texts: every comparison runs on both


def in_process(repository: Path, texts: list[str], batch_size: int, seconds: float = 6.0):
    """Tokenize + ONNX Runtime (pooling in the graph) in one process, as the served path does it:
    the served tokenizer's padding, and batches of more than one text grouped by row length with
    the served encoder's ``LengthGrouping`` (embedded target). (texts/s, p50 ms per batch)."""
    tokenizer = TextTokenizer.served(repository / "text_tokenizer")
    runner = OnnxBatchRunner(repository / "text_encoder" / "1" / "model.onnx", intra_op_threads=THREADS,
                             output_names=["embedding"], length_grouping=LengthGrouping.served(repository / "text_encoder"))
    batches = [texts[i:i + batch_size] for i in range(0, len(texts), batch_size)]
    latencies, done, started = [], 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for batch in batches:
            t0 = time.perf_counter()
            tokens = tokenizer.encode(batch)
            runner.run([{"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}])
            latencies.append(time.perf_counter() - t0)
            done += len(batch)
    return done / (time.perf_counter() - started), statistics.median(latencies) * 1000


def text_input_data(texts: list[str], name: str = "bench") -> Path:
    path = BENCH_DIR / f"text_inputs_{name}.json"
    BENCH_DIR.mkdir(exist_ok=True)
    path.write_text(json.dumps({"data": [{"text": {"content": [t], "shape": [1]}} for t in texts]}))
    return path


def full_length_tokens(repository: Path, texts: list[str], length: int):
    """Each text repeated until it fills ``length`` tokens (truncated there): sequences of exactly
    ``length`` real tokens, no padding. A padded sequence would measure less than it says on the
    embedded target, whose encoders skip each row's padding (ragged batching, length grouping)."""
    tokenizer = TextTokenizer(repository / "text_tokenizer" / "1" / "tokenizer.json", buckets=(length,),
                              max_length=length)
    tokens = tokenizer.encode([" ".join([text] * (length // max(len(text.split()), 1) + 1)) for text in texts])
    assert tokens.attention_mask.all(), "a sequence is shorter than the length asked for"
    return tokens


def token_input_data(repository: Path, texts: list[str], length: int) -> Path:
    tokens = full_length_tokens(repository, texts, length)
    path = BENCH_DIR / f"tokens_{length}.json"
    path.write_text(json.dumps({"data": [
        {"input_ids": {"content": ids.tolist(), "shape": [length]},
         "attention_mask": {"content": mask.tolist(), "shape": [length]}}
        for ids, mask in zip(tokens.input_ids, tokens.attention_mask)]}))
    return path


def length_strategies(server, data: dict[str, Path]) -> list[list]:
    """Same traffic at concurrency 16 under three ways to batch mixed lengths, each loaded by a
    config override (Triton's model-load API); the served configs are loaded back afterwards."""
    control = server.control
    tokenizer, encoder = control.config("text_tokenizer"), control.config("text_encoder")

    def with_buckets(value):
        config = copy.deepcopy(tokenizer)
        config["parameters"]["length_buckets"]["string_value"] = value
        return config

    equal_shapes = copy.deepcopy(encoder)  # what the native onnxruntime backend (gpu target) does
    for tensor in equal_shapes["input"]:
        tensor["allow_ragged_batch"] = False

    def load(tokenizer_config, encoder_config):
        # A load without a config would keep an earlier override: always name the config.
        control.load("text_tokenizer", config=tokenizer_config)
        control.load("text_encoder", config=encoder_config)
        control.load("text_embedding")

    buckets = ",".join(str(b) for b in LENGTH_BUCKETS)
    strategies = [
        ("ragged batches, rows grouped by length (served on the embedded target)", tokenizer, encoder),
        (f"length buckets ({buckets}), equal shapes per batch (the gpu target's way)",
         with_buckets(buckets), equal_shapes),
        ("pad every request to 256", with_buckets("256"), equal_shapes),
    ]
    rows = []
    try:
        for label, tokenizer_config, encoder_config in strategies:
            load(tokenizer_config, encoder_config)
            for traffic, path in data.items():
                row = perf_analyzer("text_embedding", server.grpc_url, 16, input_data=path)
                rows.append([label, traffic, row.throughput, row.p50_ms, row.p99_ms])
    finally:
        load(tokenizer, encoder)
    return rows


STEPS = ("text_tokenizer", "text_encoder")  # text_embedding's steps
PARTS = ("queue", "compute_input", "compute_infer", "compute_output")


def step_totals(client, model: str) -> dict[str, float]:
    """Cumulative per-model statistics: requests, executions and ns in each part."""
    stats = client.statistics(model)["model_stats"][0]["inference_stats"]
    totals = {part: float(stats[part]["ns"]) for part in PARTS}
    totals["requests"] = float(stats["success"]["count"])
    return totals | {"executions": float(client.statistics(model)["model_stats"][0]["execution_count"])}


def where_time_goes(server, measure) -> tuple[object, list[list]]:
    """Run ``measure()`` and split each step's time per request from Triton's own statistics:
    queue, compute_input (the requests into the stub's shared memory), compute_infer (until the
    stub's whole response batch is back: the model.py execute and the stub writing its outputs),
    compute_output (everything after: python_backend r24.10 ``ProcessRequests`` loads each response
    from shared memory and calls ``TRITONBACKEND_ResponseSend``, and that call runs the ensemble's
    next hop in place: ``EnsembleContext::ResponseComplete`` → ``ScheduleSteps`` → ``InferAsync``
    into the next model's batcher, or for the last step the client's response completion)."""
    from triton_pipelines.client import TritonClient

    client = TritonClient("http", server.http_url)
    try:
        before = {model: step_totals(client, model) for model in STEPS}
        result = measure()
        after = {model: step_totals(client, model) for model in STEPS}
    finally:
        client.close()
    rows = []
    for model in STEPS:
        delta = {key: after[model][key] - before[model][key] for key in after[model]}
        requests = max(delta["requests"], 1)
        rows.append([model, int(delta["executions"]), delta["requests"] / max(delta["executions"], 1)]
                    + [delta[part] / requests / 1e6 for part in PARTS])
    return result, rows


def traffic_section(server, repository: Path, name: str, texts: list[str]) -> tuple[list[str], dict]:
    """One traffic: Triton's curve, the in-process sweep, back-to-back pairs and the two ratios."""
    data = text_input_data(texts, name)
    baseline = {b: in_process(repository, texts, b) for b in (1, 4, 8, 16, 32)}
    best_batch = max(baseline, key=lambda b: baseline[b][0])
    concurrency = CONCURRENCY if name == "bench" else (1, 4, 16)
    rows, split = [], []
    for c in concurrency:
        if c == 16:
            row, split = where_time_goes(server, lambda: perf_analyzer("text_embedding", server.grpc_url, c,
                                                                       input_data=data))
        else:
            row = perf_analyzer("text_embedding", server.grpc_url, c, input_data=data)
        rows.append(row)
    peak = max(rows, key=lambda r: r.throughput)
    # The shared machine drifts between tables: the targets are judged on back-to-back pairs
    # (in-process, then Triton, measured together), median of PAIRS.
    saturation_pairs = [(in_process(repository, texts, best_batch)[0],
                         perf_analyzer("text_embedding", server.grpc_url, peak.concurrency, input_data=data).throughput)
                        for _ in range(PAIRS)]
    latency_pairs = [(in_process(repository, texts, 1)[1],
                      perf_analyzer("text_embedding", server.grpc_url, 1, input_data=data).p50_ms)
                     for _ in range(PAIRS)]
    ratio = statistics.median(served / local for local, served in saturation_pairs)
    added_p50 = statistics.median(served - local for local, served in latency_pairs)
    tokens = TextTokenizer.served(repository / "text_tokenizer").encode(texts).attention_mask.sum(axis=1)
    lines = [
        f"### {name} traffic: {len(texts)} texts of {int(tokens.min())}–{int(tokens.max())} tokens "
        f"(median {int(np.median(tokens))}), cycled",
        "",
        markdown_table(["concurrency", "texts/s", "p50 ms", "p95 ms", "p99 ms", "server queue ms", "server compute ms"],
                       [[r.concurrency, r.throughput, r.p50_ms, r.p95_ms, r.p99_ms, r.server_queue_ms,
                         r.server_compute_ms] for r in rows]),
        "",
        "Where the time goes at concurrency 16 (Triton's per-model statistics, ms per request; each request "
        "counts the whole execution it was part of, so its share of compute is that over the average batch; "
        "compute_output is not the stub's: it is Triton handing each response on, the ensemble's next hop "
        "or the client's response included, see `where_time_goes`):",
        "",
        markdown_table(["step", "executions", "avg requests per execution", "queue", "compute_input",
                        "compute_infer", "compute_output"], split),
        "",
        markdown_table(["in-process batch size", "texts/s", "p50 ms per batch"],
                       [[b, t, p] for b, (t, p) in baseline.items()]),
        "",
        f"Back-to-back pairs (in-process batch {best_batch} then Triton at concurrency {peak.concurrency}; "
        "in-process batch 1 p50 then Triton concurrency 1 p50):",
        "",
        markdown_table(["pair", "in-process texts/s", "Triton texts/s", "ratio", "in-process p50 ms",
                        "Triton p50 ms", "added p50 ms"],
                       [[i + 1, local, served, f"{served / local:.0%}", local_ms, served_ms, served_ms - local_ms]
                        for i, ((local, served), (local_ms, served_ms))
                        in enumerate(zip(saturation_pairs, latency_pairs))]),
        "",
        f"**Ratio at saturation (median of {PAIRS} pairs): {ratio:.0%}** (target ≥ 95%: "
        f"**{'met' if ratio >= 0.95 else 'missed'}**).",
        f"**Added p50 at concurrency 1 (median of {PAIRS} pairs): {added_p50:+.2f} ms** (target ≤ 1.5 ms: "
        f"**{'met' if added_p50 <= 1.5 else 'missed'}**).",
        "",
    ]
    return lines, {"data": data, "best": baseline[best_batch][0]}


def run(server) -> str:
    repository = Path(server.options.model_repository)
    lines = [
        "## text_embedding (all-MiniLM-L6-v2) — Triton ensemble vs in-process",
        "",
        "perf_analyzer over gRPC. In-process: the served tokenizer (its padding), the same ONNX file (pooling "
        f"in the graph), ONNX Runtime with {THREADS} threads (the embedded text_encoder's setting), batches "
        "grouped by row length as the served encoder groups them. Two traffics (`benchmarks/bench_text.py`): "
        "the bench's support-desk texts (3–120 words, log-normal) and mixed lengths over the encoder's "
        "whole range (1–300 words, log-uniform, truncated at 256 tokens).",
        "",
    ]
    data = {}
    for name, make in TRAFFIC.items():
        section, facts = traffic_section(server, repository, name, make())
        lines += section
        data[name] = facts["data"]
        if name == "bench":
            best_throughput = facts["best"]
    # The throughput latency class (router `batch`): same weights, preferred batches, queue delay.
    batch_rows = ([perf_analyzer("text_embedding_batch", server.grpc_url, c, input_data=data["bench"])
                   for c in (16, 32)] if (repository / "text_embedding_batch").exists() else [])
    if batch_rows:
        batch_peak = max(batch_rows, key=lambda r: r.throughput)
        lines += [
            "Throughput class (`text_embedding_batch`: the same weights with preferred batch sizes 16/32 and "
            "a 20 ms queue delay, what the router's `batch` latency class serves), bench traffic:",
            "",
            markdown_table(["concurrency", "texts/s", "p50 ms", "p99 ms"],
                           [[r.concurrency, r.throughput, r.p50_ms, r.p99_ms] for r in batch_rows]),
            "",
            f"Throughput class at its peak: {batch_peak.throughput:.1f} texts/s, "
            f"{batch_peak.throughput / best_throughput:.0%} of the in-process sweep's best ({best_throughput:.1f}).",
            "",
        ]
    lines += [
        "### Batching mixed lengths (concurrency 16, both traffics)",
        "",
        markdown_table(["strategy", "traffic", "texts/s", "p50 ms", "p99 ms"], length_strategies(server, data)),
    ]
    if (repository / "bert_base_encoder").exists():
        lines += ["", bert_base_section(server, repository, corpus())]
    return "\n".join(lines)


def bert_base_section(server, repository: Path, texts: list[str], length: int = 128) -> str:
    data = token_input_data(repository, texts, length)
    runner = OnnxBatchRunner(repository / "bert_base_encoder" / "1" / "model.onnx", intra_op_threads=THREADS)
    tokens = TextTokenizer(repository / "text_tokenizer" / "1" / "tokenizer.json", buckets=(length,),
                           max_length=length).encode(texts[:8])
    in_process_rows = []
    for batch in (1, 8):
        feed = {"input_ids": tokens.input_ids[:batch], "attention_mask": tokens.attention_mask[:batch]}
        runner.run([feed])
        started, n = time.perf_counter(), 0
        while time.perf_counter() - started < 6:
            runner.run([feed])
            n += batch
        in_process_rows.append([batch, n / (time.perf_counter() - started)])
    rows = [perf_analyzer("bert_base_encoder", server.grpc_url, c, input_data=data) for c in (1, 4, 8)]
    return "\n".join([
        f"## bert_base_encoder (bert-base-uncased architecture, 110M parameters, random weights) at {length} tokens",
        "",
        markdown_table(["concurrency", "sequences/s", "p50 ms", "p99 ms"],
                       [[r.concurrency, r.throughput, r.p50_ms, r.p99_ms] for r in rows]),
        "",
        markdown_table(["in-process batch size", "sequences/s"], in_process_rows),
    ])
