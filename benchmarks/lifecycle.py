"""make lifecycle: load time and first-request latency of each compute model and each pipeline,
without and with warm-up, on the embedded server → docs/lifecycle.md.

    python -m benchmarks.lifecycle [--rounds 3] [--report docs/lifecycle.md]

Compute models: the model is loaded with new instances (a config parameter changes), once with the
generated ``model_warmup`` removed ("cold") and once with it ("warmed by config"); measured: the
``load`` call, the first request after it and the median of the next five (batch 1, a typical
shape). Pipelines: every model of the pipeline is loaded with new instances (compute models keep
their ``model_warmup``), then the first request is timed either at once ("compute models warmed
by config") or after ``warmup.warm_pipelines`` sent one request through the ensemble ("warmed end
to end"); "cold" also strips the compute models' ``model_warmup``. Each figure is the median of
``--rounds`` rounds. Then the whole repository's launch-to-ready time with
``--model-load-thread-count`` 1 and 4 (Triton's default).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from triton_pipelines.client import TritonClient, text_tensor
from triton_pipelines.server.drain import dependencies
from triton_pipelines.server.launcher import start_on_free_ports
from triton_pipelines.server.warmup import warm_pipelines

from .perf import markdown_table

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


def image_classifier(repository: Path) -> str:
    """The compute model image_classification runs, its nested image_logits' second step (named for
    --image-model: efficientnet_lite0 by default)."""
    from repo_builder.files import read_config
    from triton_pipelines.repository.ensemble_graph import ensemble_steps

    return ensemble_steps(read_config(repository / "image_logits" / "config.pbtxt"))[1].model


def compute_inputs(classifier: str, arch_layers: int = 4) -> dict[str, dict[str, np.ndarray]]:
    """Batch-1 requests of a typical shape for each compute model (``classifier``: the image classifier's name)."""
    rng = np.random.default_rng(0)
    decoder = {"input_ids": np.array([[50258, 50259, 50359, 50363]], np.int64),
               "past_self_kv": np.zeros((1, 2 * arch_layers, 6, 0, 64), np.float32)}
    for i in range(arch_layers):
        decoder[f"cross_key_{i}"] = rng.standard_normal((1, 6, 64, 1500), dtype=np.float32)
        decoder[f"cross_value_{i}"] = rng.standard_normal((1, 6, 1500, 64), dtype=np.float32)
    return {
        "text_encoder": {"input_ids": np.full((1, 16), 2000, np.int64), "attention_mask": np.ones((1, 16), np.int64)},
        classifier: {"pixel_values": rng.standard_normal((1, 3, 224, 224), dtype=np.float32)},
        "whisper_encoder": {"input_features": rng.standard_normal((1, 80, 3000), dtype=np.float32)},
        "whisper_decoder": decoder,
    }


PIPELINES = {
    "text_embedding": lambda: {"text": text_tensor(["I was charged twice this month"])},
    "text_classification": lambda: {"text": text_tensor(["I was charged twice this month"])},
    "image_classification": lambda: {"image": text_tensor([(DATA / "scene.jpg").read_bytes()])},
    "speech_recognition": lambda: {"audio": text_tensor([(DATA / "speech_hello.wav").read_bytes()]),
                                   "max_new_tokens": np.array([[16]], np.int32)},
}


class Bench:
    def __init__(self, server):
        self.server = server
        self.control = server.control
        self.client = TritonClient("grpc", server.grpc_url)
        self.generation = 0
        self.built = {}  # model → its config as first served (with the generated model_warmup)

    def reload(self, model: str, warmup: bool) -> float:
        """Load ``model`` with new instances (a changed parameter), with or without its model_warmup."""
        config = copy.deepcopy(self.built.setdefault(model, self.control.config(model)))
        self.generation += 1
        config.setdefault("parameters", {})["benchmark_generation"] = {"string_value": str(self.generation)}
        if not warmup:
            config.pop("model_warmup", None)
        started = time.perf_counter()
        self.control.load(model, config=config)
        return time.perf_counter() - started

    def timed(self, model: str, inputs: dict) -> float:
        started = time.perf_counter()
        self.client.infer(model, inputs)
        return time.perf_counter() - started

    def compute_round(self, model: str, inputs: dict, warmup: bool) -> tuple[float, float, float]:
        load = self.reload(model, warmup)
        first = self.timed(model, inputs)
        steady = statistics.median(self.timed(model, inputs) for _ in range(5))
        return load, first, steady

    def steps(self, model: str) -> list[str]:
        """Every model a pipeline runs: ensemble steps, nested ensembles' steps, BLS callees."""
        config = self.control.config(model)
        found = [] if config.get("platform") == "ensemble" else [model]
        for name in sorted(dependencies(config) - {"*"}):
            found += [m for m in self.steps(name) if m not in found]
        return found

    def pipeline_round(self, pipeline: str, mode: str) -> tuple[float, float]:
        """(first user request, the next one) after reloading every step of the pipeline."""
        for model in self.steps(pipeline):
            self.reload(model, warmup=mode != "cold")
        if mode == "end to end":
            warm_pipelines(self.client, self.control, [pipeline])
        inputs = PIPELINES[pipeline]()
        return self.timed(pipeline, inputs), self.timed(pipeline, inputs)


def ms(values) -> str:
    return f"{statistics.median(values) * 1e3:.0f}"


def start_times(repository: Path, thread_counts: tuple[int, ...]) -> str:
    """Time from launch to ready of the whole repository, by ``--model-load-thread-count``."""
    rows = []
    for count in thread_counts:
        started = time.perf_counter()
        server = start_on_free_ports(repository, ROOT / ".bench" / f"lifecycle-threads-{count}.log",
                                     extra_args=[f"--model-load-thread-count={count}"])
        ready = time.perf_counter() - started
        server.stop()
        rows.append([count, f"{ready:.1f}"])
        print("--model-load-thread-count", count, f"ready in {ready:.1f} s", flush=True)
    return markdown_table(["--model-load-thread-count", "launch to ready (s)"], rows)


def run(server, rounds: int, threads_table: str) -> str:
    bench = Bench(server)
    rows = []
    for model, inputs in compute_inputs(image_classifier(Path(server.options.model_repository))).items():
        results = {True: [], False: []}
        for _ in range(rounds):
            for warmup in (False, True):
                results[warmup].append(bench.compute_round(model, inputs, warmup))
                print(model, "warm-up" if warmup else "cold", [f"{v * 1e3:.0f}" for v in results[warmup][-1]],
                      flush=True)
        for warmup in (False, True):
            load, first, steady = zip(*results[warmup])
            rows.append([f"`{model}`", "model_warmup (batch 1)" if warmup else "none", ms(load), ms(first),
                         ms(steady)])
    compute_table = markdown_table(["model", "warm-up", "load (ms)", "first request (ms)", "steady (ms)"], rows)
    rows = []
    modes = ("cold", "by config", "end to end")
    for pipeline in PIPELINES:
        results = {mode: [] for mode in modes}
        for _ in range(rounds):
            for mode in modes:
                results[mode].append(bench.pipeline_round(pipeline, mode))
                print(pipeline, mode, [f"{v * 1e3:.0f}" for v in results[mode][-1]], flush=True)
        for mode in modes:
            first, second = zip(*results[mode])
            rows.append([f"`{pipeline}`", {"cold": "none", "by config": "compute models by config",
                                           "end to end": "by config + one request through the ensemble"}[mode],
                         ms(first), ms(second)])
    pipeline_table = markdown_table(["pipeline", "warm-up", "first request (ms)", "second request (ms)"], rows)
    load = os.getloadavg()
    return "\n".join([
        "# Load time and first-request latency",
        "",
        "Written by `make lifecycle` (`python -m benchmarks.lifecycle`): the embedded server, CPU only, "
        f"median of {rounds} rounds. See [operations.md](operations.md#model-lifecycle) for what each warm-up is.",
        "",
        "## Compute models: a load with new instances, then batch-1 requests",
        "",
        compute_table,
        "",
        "## Pipelines: every step loaded with new instances, then the first user request",
        "",
        pipeline_table,
        "",
        "## Start of the whole repository by load threads (one start each)",
        "",
        threads_table,
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, shared with other jobs (load average "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end of the run), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--report", type=Path, default=ROOT / "docs" / "lifecycle.md")
    args = parser.parse_args(argv)
    repository = Path(os.environ.get("BENCH_MODEL_REPOSITORY", ROOT / "model_repository"))
    threads_table = start_times(repository, (1, 4))
    # First-request latency of every model, compute models included: they are not public by default.
    # (the response cache off: a later round's first request must not be an earlier round's hit)
    server = start_on_free_ports(repository, ROOT / ".bench" / "lifecycle-server.log", expose_internal_models=True,
                                 response_cache_bytes=0)
    try:
        report = run(server, args.rounds, threads_table)
    finally:
        server.stop()
    args.report.write_text(report)
    print(f"wrote {args.report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
