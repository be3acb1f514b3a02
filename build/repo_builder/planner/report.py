"""The planner's reports: the GPU plan (per instance, per GPU, the verdict and what would fit) and the
host plan of the embedded target."""

from __future__ import annotations

from triton_pipelines.limits import RESPONSE_CACHE_ENV

from .estimates import Instance, Repository
from .placement import instance_groups, place, reduced_counts, smallest_fleet
from .sizes import SERVER_PROCESS_BYTES, gib


def gpu_report(repository: Repository, instances: list[Instance], memory: int, gpus: int,
               response_cache: int = 0) -> tuple[str, bool]:
    plan = place(instances, memory, gpus)
    limits = plan.limits()
    lines = [f"GPU plan for {repository.path} ({repository.target} target build; its compute models on GPU): "
             f"{gpus} x {gib(memory)} GiB; per GPU: models <= {gib(limits['models'])} GiB (85%), batching "
             f"headroom <= {gib(limits['batching'])} GiB (10%), runtime <= {gib(limits['runtime'])} GiB (5%)", "",
             "| model | version | instances | weights | activations at | activations | overhead | per instance GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for i in instances:
        if i.kind == "gpu":
            lines.append(f"| {i.model} | {i.version} | {i.count} | {gib(i.weights)} | {i.shape} | {gib(i.activations)} | "
                         f"{gib(i.overhead)} | {gib(i.device_bytes)} |")
    lines.append("")
    for index, used in enumerate(plan.used):
        lines.append(f"GPU {index}: models {gib(used['models'])} GiB, batching {gib(used['batching'])} GiB, "
                     f"runtime {gib(used['runtime'])} GiB")
    notes = sorted({f"{i.model}: {note}" for i in instances for note in i.notes})
    lines += [f"note: {note}" for note in notes]
    lines.append(f"note: {response_cache_line(response_cache)}, not GPU memory")
    if plan.fits:
        lines.append(f"FITS on {gpus} GPU(s).")
        if gpus > 1:
            lines.append("Placement (instance_group per model):")
            lines += [f"  {model}: {group}" for model, group in instance_groups(plan).items()]
    else:
        lines.append(f"DOES NOT FIT on {gpus} GPU(s) of {gib(memory)} GiB: "
                     + (f"no room for {', '.join(plan.unplaced)}" if plan.unplaced
                        else "the runtime exceeds its 5%"))
        fewer = reduced_counts(instances, memory, gpus)
        if fewer:
            lines.append(f"  fits with fewer instances: {fewer}")
        fleet = smallest_fleet(instances, memory)
        if fleet:
            lines.append(f"  fits on {fleet} GPUs of this size, placed as:")
            lines += [f"    {model}: {group}" for model, group in instance_groups(place(instances, memory, fleet)).items()]
        else:
            largest = max((i for i in instances if i.kind == "gpu"), key=lambda i: i.device_bytes, default=None)
            if largest:
                lines.append(f"  no number of GPUs of this size holds {largest.model} (its activations at the max "
                             f"batch exceed one GPU's batching headroom): lower its max batch size or sequence length")
    lines.append("Triton places `count` instances on EVERY GPU when an instance_group names no `gpus`.")
    return "\n".join(lines), plan.fits


def response_cache_line(response_cache: int) -> str:
    """The response cache's host memory (``serve --response-cache-bytes``), one tritonserver's."""
    if not response_cache:
        return "response cache: off"
    return (f"response cache: {gib(response_cache)} GiB of host memory per tritonserver (--response-cache-bytes / "
            f"${RESPONSE_CACHE_ENV}; 0: off)")


def host_report(repository: Repository, instances: list[Instance], memory: int,
                response_cache: int = 0) -> tuple[str, bool]:
    stubs = sum(i.host * i.count for i in instances)
    shm = sum(i.shm * i.count for i in instances)
    total = stubs + SERVER_PROCESS_BYTES + response_cache
    lines = [f"Host plan for {repository.path} on the embedded target (every model a Python-backend stub on the "
             f"CPU): {gib(memory)} GiB available", "",
             "| model | version | instances | at | stub RSS GiB | of it /dev/shm GiB |", "|---|---|---|---|---|---|"]
    for i in instances:
        lines.append(f"| {i.model} | {i.version} | {i.count} | {i.shape or 'idle'} | {gib(i.host)} | {gib(i.shm)} |")
    lines.append(f"\nstubs {gib(stubs)} GiB (shared memory regions {gib(shm)} GiB of it) + tritonserver "
                 f"{gib(SERVER_PROCESS_BYTES)} GiB + response cache {gib(response_cache)} GiB = {gib(total)} GiB")
    lines.append(f"note: {response_cache_line(response_cache)}")
    lines += [f"note: {note}" for note in sorted({f'{i.model}: {n}' for i in instances for n in i.notes})]
    fits = total <= memory
    lines.append(("FITS" if fits else "DOES NOT FIT") + f": {gib(total)} of {gib(memory)} GiB"
                 + ("" if fits else ": lower max batch sizes, instance counts or the loaded versions"))
    return "\n".join(lines), fits
