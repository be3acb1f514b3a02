"""The arithmetic of the peers report, the sweep and the config search, kept apart from the
measuring so that it is unit-tested (tests/unit/tools/test_bench_report.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Point:
    """One closed-loop measurement of one system at one concurrency."""
    system: str
    concurrency: int
    throughput: float
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    errors: int = 0

    @classmethod
    def from_result(cls, system: str, result) -> "Point":
        return cls(system, result.concurrency, result.throughput, result.mean, result.p50, result.p95, result.p99,
                   result.errors)


def at(points: Iterable[Point], system: str, concurrency: int) -> Point | None:
    return next((p for p in points if p.system == system and p.concurrency == concurrency), None)


@dataclass(frozen=True)
class Versus:
    peer: str
    throughput_ratio: float  # ours / theirs
    p95_ours: float
    p95_theirs: float

    @property
    def p95_no_worse(self) -> bool:
        return self.p95_ours <= self.p95_theirs

    def meets(self, ratio: float) -> bool:
        return self.throughput_ratio >= ratio and self.p95_no_worse


def versus(points: Sequence[Point], ours: str, peer: str, concurrency: int) -> Versus | None:
    mine, theirs = at(points, ours, concurrency), at(points, peer, concurrency)
    if mine is None or theirs is None or not theirs.throughput:
        return None
    return Versus(peer, mine.throughput / theirs.throughput, mine.p95_ms, theirs.p95_ms)


@dataclass(frozen=True)
class SweepPoint:
    """A compute model under one configuration, loaded at the sweep's concurrency."""
    model: str
    instances: int
    max_batch: int
    queue_delay_us: int
    threads: int
    throughput: float
    p95_ms: float
    avg_batch: float = float("nan")  # executed batch size from Triton's statistics
    errors: int = 0


def best_config(points: Sequence[SweepPoint], p95_budget_ms: float) -> SweepPoint | None:
    """Model Analyzer's choice: the highest throughput whose p95 is within the budget (ties: fewer
    instances, then smaller batches, then shorter queue delay: the cheaper configuration)."""
    feasible = [p for p in points if p.errors == 0 and p.p95_ms <= p95_budget_ms and p.throughput > 0]
    if not feasible:
        return None
    return max(feasible, key=lambda p: (round(p.throughput, 6), -p.instances, -p.max_batch, -p.queue_delay_us))


def grid(points: Sequence[SweepPoint], delay_us: int, metric: str) -> tuple[list[int], list[int], list[list[float]]]:
    """(instances, max batches, values[instance row][batch column]) for one queue delay; NaN where
    a combination was not measured."""
    chosen = [p for p in points if p.queue_delay_us == delay_us]
    instances = sorted({p.instances for p in chosen})
    batches = sorted({p.max_batch for p in chosen})
    values = [[math.nan] * len(batches) for _ in instances]
    for p in chosen:
        values[instances.index(p.instances)][batches.index(p.max_batch)] = getattr(p, metric)
    return instances, batches, values


def instances_vs_batching(points: Sequence[SweepPoint], delay_us: int = 0) -> tuple[SweepPoint, SweepPoint] | None:
    """The tutorial's comparison: batch 1 with 4 instances against batch 4 with 1 instance."""
    many = next((p for p in points if (p.instances, p.max_batch, p.queue_delay_us) == (4, 1, delay_us)), None)
    batched = next((p for p in points if (p.instances, p.max_batch, p.queue_delay_us) == (1, 4, delay_us)), None)
    return (many, batched) if many and batched else None


def parse_budgets(text: str, defaults: dict[str, float]) -> dict[str, float]:
    """``--p95-ms``: one number for every model, or ``model=ms`` pairs separated by commas (models not
    named keep their default)."""
    budgets = dict(defaults)
    text = (text or "").strip()
    if not text:
        return budgets
    if "=" not in text:
        value = float(text)
        return {model: value for model in budgets}
    for part in text.split(","):
        model, _, value = part.partition("=")
        if model.strip() not in budgets:
            raise ValueError(f"--p95-ms names {model.strip()!r}; the swept models are {sorted(budgets)}")
        budgets[model.strip()] = float(value)
    return budgets


def pct(value: float) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.0%}"
