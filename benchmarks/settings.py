"""Quick and full modes of the comparison with peers and of the configuration sweep
(``BENCH_MODE=quick|full``; ``make bench`` is full, ``make bench-quick`` quick)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    mode: str
    concurrency: tuple[int, ...]  # text and vision curves
    speech_concurrency: tuple[int, ...]
    seconds: float  # measurement window per point (text, vision)
    speech_seconds: float
    min_requests: int
    limit_seconds: float  # in-process limit runs
    pairs: int  # back-to-back pairs for the in-process ratios
    table_requests: int  # tutorial table: requests per row (one batch each)
    sweep_instances: tuple[int, ...]
    sweep_batches: tuple[int, ...]
    sweep_delays_us: tuple[int, ...]
    sweep_seconds: float
    sweep_concurrency: int = 16


QUICK = Settings("quick", concurrency=(1, 4, 16), speech_concurrency=(1, 4, 16), seconds=3.0, speech_seconds=4.0,
                 min_requests=16, limit_seconds=3.0, pairs=1, table_requests=4,
                 sweep_instances=(1, 2, 4), sweep_batches=(1, 4, 8, 16), sweep_delays_us=(0,), sweep_seconds=2.0)
FULL = Settings("full", concurrency=(1, 2, 4, 8, 16, 32), speech_concurrency=(1, 2, 4, 8, 16), seconds=8.0,
                speech_seconds=20.0, min_requests=40, limit_seconds=6.0, pairs=3, table_requests=12,
                sweep_instances=(1, 2, 4), sweep_batches=(1, 4, 8, 16), sweep_delays_us=(0, 5000),
                sweep_seconds=5.0)


def current() -> Settings:
    mode = os.environ.get("BENCH_MODE", "full")
    if mode not in ("quick", "full"):
        raise ValueError(f"BENCH_MODE={mode!r}: quick or full")
    return QUICK if mode == "quick" else FULL
