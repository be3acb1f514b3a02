"""Model instances on GPUs under the 85/10/5 budget: first fit, largest first; fewer instances; the
smallest fleet; the ``instance_group`` text of a placement."""

from __future__ import annotations

from dataclasses import dataclass

from .estimates import Instance
from .sizes import BUDGET, CUDA_CONTEXT_BYTES


@dataclass
class GpuPlan:
    memory: int
    gpus: int
    placement: dict[str, list[int]]  # model → the GPU of each of its instances (all its versions go together)
    used: list[dict[str, int]]  # per GPU: models, batching, runtime bytes
    fits: bool
    unplaced: list[str]

    def limits(self) -> dict[str, int]:
        return {bucket: int(share * self.memory) for bucket, share in BUDGET.items()}


def _units(instances: list[Instance]) -> dict[str, tuple[int, int, int]]:
    """model → (instance count, static bytes, activation bytes) of one instance of every loaded
    version together: an instance_group is the model's, so its versions share the placement."""
    units: dict[str, list[int]] = {}
    for i in instances:
        if i.kind == "gpu":
            unit = units.setdefault(i.model, [i.count, 0, 0])
            unit[1] += i.weights + i.overhead
            unit[2] += i.activations
    return {model: tuple(unit) for model, unit in units.items()}


def place(instances: list[Instance], memory: int, gpus: int) -> GpuPlan:
    """First fit, largest first: each model instance (all its versions) on the first GPU whose models
    and batching budgets still hold it. Every GPU pays the runtime (the CUDA context)."""
    limits = {bucket: share * memory for bucket, share in BUDGET.items()}
    used = [{"models": 0, "batching": 0, "runtime": CUDA_CONTEXT_BYTES} for _ in range(gpus)]
    placement: dict[str, list[int]] = {}
    unplaced = []
    units = [(model, static, active) for model, (count, static, active) in _units(instances).items()
             for _ in range(count)]
    units.sort(key=lambda unit: -(unit[1] + unit[2]))
    for model, static, active in units:
        for index, gpu in enumerate(used):
            if gpu["models"] + static <= limits["models"] and gpu["batching"] + active <= limits["batching"]:
                gpu["models"] += static
                gpu["batching"] += active
                placement.setdefault(model, []).append(index)
                break
        else:
            unplaced.append(model)
    fits = not unplaced and all(gpu["runtime"] <= limits["runtime"] for gpu in used)
    return GpuPlan(memory, gpus, placement, used, fits, unplaced)


def smallest_fleet(instances: list[Instance], memory: int, most: int = 16) -> int | None:
    for gpus in range(1, most + 1):
        if place(instances, memory, gpus).fits:
            return gpus
    return None


def reduced_counts(instances: list[Instance], memory: int, gpus: int) -> dict[str, int] | None:
    """Instance counts (at least 1 each) that fit, taking instances from the largest models first;
    None when even one instance of each does not fit."""
    trial = [Instance(**i.__dict__) for i in instances]
    original = {i.model: i.count for i in instances if i.kind == "gpu"}
    while not place(trial, memory, gpus).fits:
        units = _units(trial)
        candidates = [model for model, (count, _, _) in units.items() if count > 1]
        if not candidates:
            return None
        biggest = max(candidates, key=lambda model: units[model][1] + units[model][2])
        for i in trial:
            if i.model == biggest:
                i.count -= 1
    return {i.model: i.count for i in trial if i.kind == "gpu" and i.count != original[i.model]}


def instance_groups(plan: GpuPlan) -> dict[str, str]:
    """``instance_group`` text per model for the placement (one group per GPU it uses)."""
    groups = {}
    for model, devices in sorted(plan.placement.items()):
        per_gpu = {gpu: devices.count(gpu) for gpu in sorted(set(devices))}
        groups[model] = "instance_group [ " + ", ".join(
            f"{{ count: {count} kind: KIND_GPU gpus: [ {gpu} ] }}" for gpu, count in per_gpu.items()) + " ]"
    return groups
