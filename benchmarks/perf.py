"""perf_analyzer runs and the Markdown they become."""

from __future__ import annotations

import csv
import glob
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1] / ".bench"


def perf_analyzer_env() -> dict[str, str]:
    """perf_analyzer links libcudart.so.12; on a CPU-only host it comes from nvidia-cuda-runtime-cu12."""
    env = dict(os.environ)
    libs = glob.glob(str(Path(sys.prefix) / "lib" / "python*" / "site-packages" / "nvidia" / "cuda_runtime" / "lib"))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")])
    return env


@dataclass
class PerfRow:
    concurrency: int
    throughput: float  # inferences/s
    p50_ms: float
    p95_ms: float
    p99_ms: float
    server_queue_ms: float
    server_compute_ms: float


def perf_analyzer(model: str, url: str, concurrency: int, input_data: Path | str | None = None,
                  protocol: str = "grpc", batch_size: int = 1, measurement_ms: int = 4000,
                  extra: list[str] | None = None) -> PerfRow:
    """One perf_analyzer measurement at a fixed concurrency (`-i grpc` by default)."""
    BENCH_DIR.mkdir(exist_ok=True)
    with tempfile.NamedTemporaryFile(suffix=".csv", dir=BENCH_DIR, delete=False) as handle:
        report = Path(handle.name)
    command = [str(Path(sys.prefix) / "bin" / "perf_analyzer"), "-m", model, "-u", url, "-i", protocol,
               "-b", str(batch_size), "--concurrency-range", f"{concurrency}:{concurrency}",
               "--percentile", "50", "-f", str(report)]
    if input_data:
        command += ["--input-data", str(input_data)]
    command += extra or []
    # Shared 2-core machines are noisy: accept a looser stability criterion before giving up, and
    # say in the report which one a number was measured with.
    try:
        # Mixed-length traffic varies window to window by nature: the last try accepts any spread.
        for stability, window in ((25, measurement_ms), (60, measurement_ms * 2), (1000, measurement_ms * 2)):
            completed = subprocess.run(
                command + ["-p", str(window), "--max-trials", "8", "--stability-percentage", str(stability)],
                env=perf_analyzer_env(), capture_output=True, text=True)
            if completed.returncode == 0 and report.stat().st_size:
                break
        else:
            raise RuntimeError(f"perf_analyzer failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}")
        with open(report) as handle:
            row = next(csv.DictReader(handle))
    finally:
        report.unlink(missing_ok=True)
    us = lambda key: float(row.get(key) or 0) / 1000.0  # noqa: E731 - perf_analyzer reports µs
    return PerfRow(
        concurrency=concurrency,
        throughput=float(row["Inferences/Second"]),
        p50_ms=us("p50 latency"), p95_ms=us("p95 latency"), p99_ms=us("p99 latency"),
        server_queue_ms=us("Server Queue"),
        server_compute_ms=us("Server Compute Input") + us("Server Compute Infer") + us("Server Compute Output"),
    )


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def cell(value):
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
