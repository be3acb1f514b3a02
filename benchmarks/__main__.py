"""python -m benchmarks [--quick] [--p95-ms MS|MODEL=MS,...] [--write-back] [NAME ...]: run the named
benchmarks (default: all; with --quick, the peers and the sweep in quick mode) against one embedded
server and rewrite their sections of docs/benchmarks.md (other sections are kept). The server
serves $BENCH_MODEL_REPOSITORY (``make bench``: .bench/model_repository), else model_repository/.

--p95-ms and --write-back steer bench_sweep's config search (see benchmarks/bench_sweep.py)."""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import re
import sys
import time
from pathlib import Path

from triton_pipelines.server.launcher import start_on_free_ports

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/gpu.sh writes docs/benchmarks-gpu.md instead.
REPORT = ROOT / os.environ.get("BENCH_REPORT", "docs/benchmarks.md")
# Module name under benchmarks/ → its section in the report, in report order.
BENCHMARKS = ["bench_peers", "bench_sweep", "bench_text", "bench_vision", "bench_speech", "bench_router",
              "bench_proxy", "bench_openai", "bench_cache", "bench_tracing"]
QUICK = ["bench_peers", "bench_sweep"]

HEADER = """# Benchmarks

Written by `make bench` (`python -m benchmarks`); every number in a section comes from one run on
one machine, so compare ratios within a section rather than across sections or machines.
Triton's own Model Analyzer against this server (it works in remote mode, with a wrapper for the
control key, on a launcher of its own): [model_analyzer.md](model_analyzer.md).
"""


def section_markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def merge_sections(existing: str, sections: dict[str, str]) -> str:
    kept = {}
    for name in BENCHMARKS:
        start, end = section_markers(name)
        match = re.search(re.escape(start) + r"\n(.*?)\n" + re.escape(end), existing, re.S)
        if match:
            kept[name] = match.group(1)
    kept.update(sections)
    body = [HEADER]
    for name in BENCHMARKS:
        if name in kept:
            start, end = section_markers(name)
            body.append(f"{start}\n{kept[name]}\n{end}\n")
    return "\n".join(body)


def machine_line() -> str:
    note = os.environ.get("BENCH_MACHINE_NOTE", "")
    return (f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}." + (f" {note}." if note else ""))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"among {BENCHMARKS}")
    parser.add_argument("--quick", action="store_true", help="quick mode (BENCH_MODE=quick): about 9 minutes on 2 cores")
    parser.add_argument("--p95-ms", help="config search budget: one p95 in ms for every model, or MODEL=MS,...")
    parser.add_argument("--write-back", action="store_true",
                        help="record the config search's choice in data/compute_tuning.json for the builder")
    args = parser.parse_args(argv)
    if args.quick:
        os.environ["BENCH_MODE"] = "quick"
    if args.p95_ms:
        os.environ["BENCH_P95_MS"] = args.p95_ms
    if args.write_back:
        os.environ["BENCH_WRITE_BACK"] = "1"
    names = args.names or (QUICK if os.environ.get("BENCH_MODE") == "quick" else BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        print(f"unknown benchmarks {unknown}; known: {BENCHMARKS}", file=sys.stderr)
        return 2
    repository = Path(os.environ.get("BENCH_MODEL_REPOSITORY", ROOT / "model_repository"))
    # Sweeps and perf_analyzer runs measure single models (text_encoder, resnet50, ...) too. The
    # response cache is off: the benchmarks' corpora repeat and they measure the computation
    # (bench_cache measures the cache on a server of its own).
    server = start_on_free_ports(repository, ROOT / ".bench" / "server.log", expose_internal_models=True,
                                 response_cache_bytes=0)
    sections = {}
    try:
        for name in names:
            print(f"== {name}", flush=True)
            module = importlib.import_module(f"benchmarks.{name}")
            sections[name] = module.run(server).rstrip() + "\n\n" + machine_line()
            REPORT.parent.mkdir(exist_ok=True)
            REPORT.write_text(merge_sections(REPORT.read_text() if REPORT.exists() else "", sections))
    finally:
        server.stop()
    print(f"wrote {REPORT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
