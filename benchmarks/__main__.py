"""python -m benchmarks [NAME ...]: run the named benchmarks (default: all) against one embedded
server and rewrite their sections of docs/benchmarks.md (other sections are kept). The server
serves $BENCH_MODEL_REPOSITORY (``make bench``: .bench/model_repository), else model_repository/."""

from __future__ import annotations

import importlib
import os
import platform
import re
import sys
import time
from pathlib import Path

from triton_pipelines.launcher import start_on_free_ports

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/gpu.sh writes docs/benchmarks-gpu.md instead.
REPORT = ROOT / os.environ.get("BENCH_REPORT", "docs/benchmarks.md")
# Module name under benchmarks/ → its section in the report, in report order.
BENCHMARKS = ["bench_text", "bench_vision", "bench_speech", "bench_router", "bench_proxy"]

HEADER = """# Benchmarks

Written by `make bench` (`python -m benchmarks`); every number in a section comes from one run on
one machine, so compare ratios within a section rather than across sections or machines.
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
    names = argv or BENCHMARKS
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        print(f"unknown benchmarks {unknown}; known: {BENCHMARKS}", file=sys.stderr)
        return 2
    repository = Path(os.environ.get("BENCH_MODEL_REPOSITORY", ROOT / "model_repository"))
    server = start_on_free_ports(repository, ROOT / ".bench" / "server.log")
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
