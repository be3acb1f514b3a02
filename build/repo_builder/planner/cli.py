"""python -m repo_builder plan: will the built repository fit, and how to place it if not.

    python -m repo_builder plan --gpu A100-40GB                 # one GPU of a known size
    python -m repo_builder plan --gpu-memory 24GiB --gpus 2     # two GPUs of 24 GiB
    python -m repo_builder plan --host                          # the embedded target: host memory
    python -m repo_builder plan --check                         # what `make serve` runs first

The estimates: repo_builder/planner/estimates.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from triton_pipelines.limits import DEFAULT_RESPONSE_CACHE_BYTES, RESPONSE_CACHE_ENV
from triton_pipelines.repository.contract import BuiltManifest, ShmCheck

from .estimates import Repository
from .report import gpu_report, host_report
from .shm import shm_report
from .sizes import GiB, GPUS, parse_bytes


def host_memory(field_name: str = "MemTotal") -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field_name} in /proc/meminfo")


def parse_sequence(values: list[str]) -> dict[str, dict[str, int]]:
    """``MODEL=N`` (every variable dim) or ``MODEL.INPUT=N`` (one input's)."""
    overrides: dict[str, dict[str, int]] = {}
    for value in values:
        key, _, number = value.partition("=")
        model, _, tensor = key.partition(".")
        if not number.isdigit() or not model:
            raise argparse.ArgumentTypeError(f"--sequence-length wants MODEL=N or MODEL.INPUT=N, got {value!r}")
        overrides.setdefault(model, {})[tensor] = int(number)
    return overrides


def response_cache_bytes(flag: int | None) -> int:
    """The flag, else what ``serve`` would take: ``$TRITON_RESPONSE_CACHE_BYTES``, else the default."""
    if flag is not None:
        return max(flag, 0)
    text = os.environ.get(RESPONSE_CACHE_ENV, "")
    if not text.strip().isdigit():
        if text:
            raise SystemExit(f"${RESPONSE_CACHE_ENV}={text!r} must be a whole number of bytes")
        return DEFAULT_RESPONSE_CACHE_BYTES
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m repo_builder plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--gpu-memory", type=parse_bytes, help="memory of one GPU, e.g. 40GiB")
    size.add_argument("--gpu", choices=sorted(GPUS), help="a GPU by name")
    size.add_argument("--host", action="store_true", help="the embedded target: host memory (default without a GPU)")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs of that size (default 1)")
    parser.add_argument("--host-memory", type=parse_bytes, help="host memory for --host (default: the machine's, "
                                                                 "MemTotal)")
    parser.add_argument("--sequence-length", action="append", default=[], metavar="MODEL[.INPUT]=N",
                        help="bound of a model's variable dims where its description declares none")
    parser.add_argument("--response-cache-bytes", type=int,
                        help="the server's response cache, host memory (default: what `serve` uses, "
                             f"${RESPONSE_CACHE_ENV} or {DEFAULT_RESPONSE_CACHE_BYTES >> 20} MiB)")
    parser.add_argument("--check", action="store_true", help="print the verdict only; exit 1 when it does not fit "
                                                             "(make serve runs this)")
    parser.add_argument("--json", action="store_true", help="the per-instance estimates as JSON")
    parser.add_argument("--shm", action="store_true", help="the /dev/shm the Python-backend stubs may hold at full "
                                                            "batches, per model (compose's TRITON_SHM_SIZE)")
    args = parser.parse_args(argv)
    if not BuiltManifest.exists(args.repository):
        parser.error(f"{args.repository} is not built: run `make repository`")
    repository = Repository(args.repository, parse_sequence(args.sequence_length))
    if args.shm:
        print(shm_report(repository.shm_needs()))
        return 0
    instances = repository.instances()
    if args.json:
        print(json.dumps([{**i.__dict__} for i in instances], indent=2))
        return 0
    cache = response_cache_bytes(args.response_cache_bytes)
    memory = args.gpu_memory or (GPUS[args.gpu] * GiB if args.gpu else None)
    if memory:
        report, fits = gpu_report(repository, instances, memory, args.gpus, cache)
    else:
        report, fits = host_report(repository, instances, args.host_memory or host_memory(), cache)
    if args.check:
        report = "\n".join(line for line in report.splitlines() if line.startswith(("FITS", "DOES NOT FIT", "note:", "  ")))
        report += "\n" + ShmCheck.measure(sum(repository.shm_needs().values())).note()
        report = "[plan] " + report.replace("\n", "\n[plan] ")
    print(report)
    return 0 if fits or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
