"""matplotlib PNGs for docs/: throughput–latency curves with every peer on the same axes, and the
sweep's heat maps."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .report import grid  # noqa: E402

COLORS = {"Triton": "#76b900", "FastAPI": "#009688", "Infinity": "#7e57c2"}


def curves(result, path: Path) -> Path:
    """p95 latency against throughput, one line per system (a point per concurrency), and the
    in-process limit's throughput as a vertical line."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    for system in sorted({p.system for p in result.points}, key=lambda n: (n != "Triton", n)):
        points = sorted((p for p in result.points if p.system == system), key=lambda p: p.concurrency)
        ax.plot([p.throughput for p in points], [p.p95_ms for p in points], marker="o",
                color=COLORS.get(system), label=system)
        for p in points:
            ax.annotate(str(p.concurrency), (p.throughput, p.p95_ms), textcoords="offset points", xytext=(4, 3),
                        fontsize=7, color=COLORS.get(system, "black"))
    if result.limit_throughput:
        ax.axvline(result.limit_throughput, color="grey", linestyle="--",
                   label=f"in-process limit (batch {result.limit_batch})")
    ax.set_yscale("log")
    ax.set_xlabel(f"throughput ({result.unit}/s)")
    ax.set_ylabel("p95 latency (ms, log)")
    ax.set_title(f"{result.pipeline}: p95 vs throughput (labels: concurrency)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def heatmaps(model: str, points, path: Path) -> Path:
    """Throughput and p95 over instances x max batch, one row of panels per queue delay."""
    delays = sorted({p.queue_delay_us for p in points})
    fig, axes = plt.subplots(len(delays), 2, figsize=(8.4, 2.9 * len(delays)), dpi=100, squeeze=False)
    for row, delay in enumerate(delays):
        for col, (metric, label, cmap) in enumerate((("throughput", "inferences/s", "viridis"),
                                                     ("p95_ms", "p95 ms", "magma_r"))):
            instances, batches, values = grid(points, delay, metric)
            ax = axes[row][col]
            image = ax.imshow(values, cmap=cmap, aspect="auto")
            ax.set_xticks(range(len(batches)), [str(b) for b in batches])
            ax.set_yticks(range(len(instances)), [str(i) for i in instances])
            ax.set_xlabel("max batch")
            ax.set_ylabel("instances")
            ax.set_title(f"{model}: {label}, queue delay {delay} µs", fontsize=9)
            for i, line in enumerate(values):
                for j, value in enumerate(line):
                    if not math.isnan(value):
                        r, g, b, _ = image.cmap(image.norm(value))
                        ink = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"
                        ax.text(j, i, f"{value:.0f}" if value >= 10 else f"{value:.1f}", ha="center", va="center",
                                fontsize=8, color=ink)
            fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
