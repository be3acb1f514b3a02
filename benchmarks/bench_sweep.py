"""The tutorial's finding as a sweep, and a config search like Triton Model Analyzer's.

Each compute model is loaded (Triton's model-load API with a config override) with instance count
{1, 2, 4} x max batch {1, 4, 8, 16} x queue delay, and driven directly with one-item requests at
concurrency 16 by the same load generator as the peers. "Max batch B" is the dynamic batcher's
``preferred_batch_size: [B]``: with more requests waiting than B, Triton 2.51 forms batches of B
(the largest preferred size), so B caps the executed batch while ``max_batch_size``, which the
ensembles are validated against, stays as described. The executed batch size is read back from
Triton's statistics. On this 2-core CPU the instances share the cores: each instance gets
``2 // instances`` ONNX Runtime threads (at least 1), so 4 instances means 4 single-threaded sessions.

Config search: per model, the configuration with the highest throughput whose p95 stays within
``--p95-ms``; ``--write-back`` records it in data/compute_tuning.json, which the repository builder
applies to the model's description (build/repo_builder/tuning.py)."""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import asdict
from pathlib import Path


from triton_pipelines.client import TritonClient

from . import settings as bench_settings
from .loadgen import Target, measure, triton_check, triton_request
from .perf import markdown_table
from .report import SweepPoint, best_config, instances_vs_batching, parse_budgets

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TUNING_FILE = ROOT / "data" / "compute_tuning.json"
CORES = os.cpu_count() or 2
# p95 budgets at concurrency 16 (``--p95-ms`` / BENCH_P95_MS override them): about twice the p95
# of the served configuration on 2 cores.
DEFAULT_BUDGETS = {"text_encoder": 250.0, "resnet50": 1500.0, "whisper_encoder": 3000.0}
# Requests in flight per model: 16 (the tutorial's and the targets' concurrency), except the Whisper
# encoder: 16 of its ~0.3 s calls in flight is ~5 s per call on 2 cores, and whisper_decode sends it
# one batch of windows at a time anyway.
CONCURRENCY = {"text_encoder": 16, "resnet50": 16, "whisper_encoder": 4}


def requests_for(model: str, repository: Path):
    """One-item requests for a compute model: the tensors its pipeline would send it."""
    if model == "text_encoder":
        from .bench_text import corpus, full_length_tokens

        tokens = full_length_tokens(repository, corpus()[:16], 32)
        return [triton_request([("input_ids", "INT64", tokens.input_ids[i:i + 1]),
                                ("attention_mask", "INT64", tokens.attention_mask[i:i + 1])], ["embedding"])
                for i in range(len(tokens.input_ids))], "32-token sequences"
    if model == "resnet50":
        from triton_pipelines.pipelines.vision import preprocess_image

        from .bench_vision import jpeg_payloads

        return [triton_request([("pixel_values", "FP32", preprocess_image(p)[None])], ["logits"])
                for p in jpeg_payloads(4)], "preprocessed 224x224 images"
    if model == "whisper_encoder":
        from triton_pipelines.pipelines.speech.features import audio_to_features, load_mel_filters

        from .speech_work import clip

        filters = load_mel_filters(repository / "audio_features" / "1" / "mel_filters.npz", 80)
        features = audio_to_features(clip(), filters)[:1]
        # Only one of its outputs comes back over HTTP: the model computes all of them either way.
        return [triton_request([("input_features", "FP32", features)], ["cross_key_0"])], "30 s log-mel windows"
    raise ValueError(model)


def sweep_config(original: dict, instances: int, batch: int, delay_us: int) -> dict:
    config = copy.deepcopy(original)
    groups = config.get("instance_group") or [{"kind": "KIND_CPU"}]
    config["instance_group"] = [{"kind": groups[0].get("kind", "KIND_CPU"), "count": instances}]
    config.setdefault("parameters", {})["intra_op_threads"] = {"string_value": str(max(1, CORES // instances))}
    batching = config.setdefault("dynamic_batching", {})
    batching["preferred_batch_size"] = [batch]
    batching["max_queue_delay_microseconds"] = delay_us
    return config


def executions(client: TritonClient, model: str) -> tuple[int, int]:
    """(inferences, executions) of version 1, the one the pipelines pin (text_encoder also has a canary)."""
    stats = next(s for s in client.statistics(model)["model_stats"] if s["version"] == "1")
    return int(stats["inference_count"]), int(stats["execution_count"])


def sweep_model(server, model: str, s: bench_settings.Settings) -> tuple[list[SweepPoint], str]:
    repository = Path(server.options.model_repository)
    control = server.control
    original = control.config(model)
    max_batch = int(original["max_batch_size"])
    requests, payload = requests_for(model, repository)
    target = Target(model, f"http://{server.http_url}/v2/models/{model}/versions/1/infer", requests, triton_check)
    concurrency = CONCURRENCY.get(model, s.sweep_concurrency)
    client = TritonClient("http", server.control.http_url)
    points = []
    try:
        for delay in s.sweep_delays_us:
            for instances in s.sweep_instances:
                for batch in s.sweep_batches:
                    if batch > max_batch:
                        continue
                    control.load(model, config=sweep_config(original, instances, batch, delay))
                    before = executions(client, model)
                    load = measure(target, concurrency, seconds=s.sweep_seconds, warmup_s=1.0,
                                   min_requests=2 * concurrency)
                    after = executions(client, model)
                    runs = after[1] - before[1]
                    point = SweepPoint(model, instances, batch, delay, max(1, CORES // instances), load.throughput,
                                       load.p95, (after[0] - before[0]) / runs if runs else float("nan"), load.errors)
                    points.append(point)
                    print(f"  sweep {model} i={instances} b={batch} d={delay}: {load.throughput:.1f}/s "
                          f"p95 {load.p95:.0f} ms avg batch {point.avg_batch:.1f} errors {load.errors}", flush=True)
    finally:
        control.load(model, config=original)
        client.close()
    return points, payload


def why(points: list[SweepPoint]) -> str:
    """The claim split into its two factors, measured: batching alone and instances alone."""
    def find(instances, batch):
        return next((p for p in points if (p.instances, p.max_batch, p.queue_delay_us) == (instances, batch, 0)), None)

    one, batched, many = find(1, 1), find(1, 4), find(4, 1)
    if not (one and batched and many and one.throughput):
        return ""
    return (f"Why: batching alone (1 instance, batch 1 → 4) changes throughput by "
            f"{batched.throughput / one.throughput - 1:+.0%}, instances alone (1 → 4 at batch 1, 2 threads → 4 "
            f"single-threaded sessions on 2 cores) by {many.throughput / one.throughput - 1:+.0%}. On a GPU, "
            "extra instances fill the device while another instance waits on copies and launches; on a CPU "
            "there is no idle device to fill: instances only trade ONNX Runtime's intra-op parallelism "
            "(synchronization inside every operator) for parallelism across requests, and batching only "
            "amortizes per-call overhead and small-matrix inefficiency, so both effects are smaller and "
            "depend on the model's operator sizes.")


def write_back(chosen: dict[str, SweepPoint], budgets: dict[str, float], path: Path = TUNING_FILE) -> None:
    document = {"_comment": "Written by `python -m benchmarks bench_sweep --p95-ms ... --write-back` (config "
                            "search); read by build/repo_builder/tuning.py. Embedded target only."}
    for model, point in sorted(chosen.items()):
        document[model] = {"instances": point.instances, "intra_op_threads": point.threads,
                           "preferred_batch_sizes": [point.max_batch] if point.max_batch > 1 else [],
                           "max_queue_delay_microseconds": point.queue_delay_us,
                           "measured": {"concurrency": CONCURRENCY.get(model, 16), "throughput": round(point.throughput, 2),
                                        "p95_ms": round(point.p95_ms, 1), "p95_budget_ms": budgets[model]}}
    path.write_text(json.dumps(document, indent=2) + "\n")


def run(server) -> str:
    from . import plots

    s = bench_settings.current()
    # ``python -m benchmarks --p95-ms ... --write-back`` sets these (so does make bench BENCH_P95_MS=...).
    budgets = parse_budgets(os.environ.get("BENCH_P95_MS", ""), DEFAULT_BUDGETS)
    write_requested = os.environ.get("BENCH_WRITE_BACK") == "1"
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    all_points: dict[str, list[SweepPoint]] = {}
    payloads = {}
    for model in DEFAULT_BUDGETS:
        all_points[model], payloads[model] = sweep_model(server, model, s)
    (ROOT / ".bench").mkdir(exist_ok=True)
    (ROOT / ".bench" / "sweep.json").write_text(json.dumps(
        {m: [asdict(p) for p in points] for m, points in all_points.items()}, indent=1))
    chosen = {}
    lines = [
        "## The tutorial's finding as a sweep, and the config search",
        "",
        f"Mode **{s.mode}** ({(time.monotonic() - started) / 60:.1f} min). 1-minute load average "
        f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after, on {CORES} cores. Each compute model "
        f"alone, one-item requests at concurrency {s.sweep_concurrency}, {s.sweep_seconds:.0f} s windows, "
        "`benchmarks/loadgen.py` on Triton's public HTTP port. Max batch = the batcher's "
        "`preferred_batch_size` (the executed average is Triton's own count); instances split the 2 cores "
        "(ONNX Runtime threads per instance = 2 // instances, at least 1).",
        "",
    ]
    for model, points in all_points.items():
        image = plots.heatmaps(model, points, DOCS / f"bench_sweep_{model}.png")
        chosen_point = best_config(points, budgets[model])
        if chosen_point is not None:
            chosen[model] = chosen_point
        lines += [f"### {model} ({payloads[model]})", "", f"![{model} sweep]({image.name})", "",
                  markdown_table(["instances", "threads each", "max batch", "queue delay µs", "inferences/s",
                                  "p95 ms", "executed avg batch", "errors"],
                                 [[p.instances, p.threads, p.max_batch, p.queue_delay_us, p.throughput, p.p95_ms,
                                   p.avg_batch, p.errors] for p in points]), ""]
        if CONCURRENCY.get(model, s.sweep_concurrency) != s.sweep_concurrency:
            lines += [f"({model}: {CONCURRENCY[model]} requests in flight, see CONCURRENCY in bench_sweep.py.)", ""]
        pair = instances_vs_batching(points)
        if pair:
            many, batched = pair
            gain = many.throughput / batched.throughput - 1
            lines.append(f"Tutorial's claim (\"batch 1 with 4 instances beats batch 4 by 40%\"): here 4 instances "
                         f"at batch 1 give {many.throughput:.1f}/s against {batched.throughput:.1f}/s for one "
                         f"instance at batch 4: **{gain:+.0%}**, so the claim "
                         f"**{'holds' if gain >= 0.4 else 'does not hold'}** for {model} on this CPU. "
                         + why(points))
        lines.append("")
    lines += ["### Config search (highest throughput with p95 within the budget, at the sweep's concurrency)", ""]
    rows = []
    for model, points in all_points.items():
        point = chosen.get(model)
        # The served configuration's nearest point: one instance, the largest batch swept, no delay.
        served = max((p for p in points if p.instances == 1 and p.queue_delay_us == 0),
                     key=lambda p: p.max_batch, default=None)
        rows.append([model, budgets[model],
                     f"{point.instances} x {point.threads} threads, batch {point.max_batch}, delay {point.queue_delay_us} µs"
                     if point else "none within budget",
                     point.throughput if point else "—", point.p95_ms if point else "—",
                     served.throughput if served else "—"])
    lines.append(markdown_table(["model", "p95 budget ms", "chosen", "inferences/s", "p95 ms",
                                 "served (1 instance, largest batch, no delay): inferences/s"], rows))
    if write_requested and chosen:
        write_back(chosen, budgets)
        lines += ["", f"Written back to `{TUNING_FILE.relative_to(ROOT)}` (`--write-back`): the next `make "
                      "repository` / `make bench` builds these models with it."]
    else:
        lines += ["", "Not written back (run `python -m benchmarks bench_sweep --p95-ms MODEL=MS,... "
                      "--write-back`, or `make bench BENCH_P95_MS=... BENCH_WRITE_BACK=1`, to record the choice "
                      "in data/compute_tuning.json for the builder)."]
    return "\n".join(lines)
