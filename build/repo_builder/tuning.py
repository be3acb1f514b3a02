"""The config search's choice (``python -m benchmarks bench_sweep --p95-ms ... --write-back``),
applied to a compute model's description: ``data/compute_tuning.json`` maps a model name to its
embedded-target instance count, ONNX Runtime threads per instance, preferred batch sizes and queue
delay. Models it does not name, and every model when the file is absent, keep their description."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .compute import ComputeModel

TUNING_FILE = Path("data") / "compute_tuning.json"  # in the project
FIELDS = {"instances": "embedded_instances", "intra_op_threads": "embedded_cpu_threads",
          "preferred_batch_sizes": "preferred_batch_sizes",
          "max_queue_delay_microseconds": "max_queue_delay_microseconds"}


def apply_tuning(model: ComputeModel, root: Path) -> ComputeModel:
    path = root / TUNING_FILE
    if not path.exists():
        return model
    entry = json.loads(path.read_text()).get(model.name)
    if not entry:
        return model
    changes = {FIELDS[key]: tuple(value) if isinstance(value, list) else int(value)
               for key, value in entry.items() if key in FIELDS}
    if any(size > model.max_batch_size for size in changes.get("preferred_batch_sizes", ())):
        raise ValueError(f"{path}: {model.name}'s preferred batch sizes exceed its max_batch_size {model.max_batch_size}")
    return dataclasses.replace(model, **changes)
