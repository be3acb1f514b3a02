"""python -m repo_builder plan: will the built repository fit, and how to place it if not.

    python -m repo_builder plan --gpu A100-40GB                 # one GPU of a known size
    python -m repo_builder plan --gpu-memory 24GiB --gpus 2     # two GPUs of 24 GiB
    python -m repo_builder plan --host                          # the embedded target: host memory
    python -m repo_builder plan --check                         # what `make serve` runs first

For every model instance of the built repository (each loaded version of each model and latency
variant, times its instance count) the planner estimates memory from the files, not from a
running server:

- weights: the ONNX initializers at their stored precision (a TensorRT FP16 plan: FP32 weights at
  half); on the CPU, ONNX Runtime also keeps a pre-packed copy of every GEMM and convolution
  weight (MLAS), so those count twice there;
- activations at the configured max batch size and sequence length: ONNX shape inference at that
  shape gives every intermediate tensor; a walk over the graph in execution order, freeing each
  tensor after its last consumer, gives the live peak; the memory arena holds more than that peak
  (CPU: x ``CPU_ARENA_FACTOR``; GPU: x ``GPU_ARENA_FACTOR``, ONNX Runtime's CUDA arena growing in
  powers of two, the onnxruntime backend's default ``arena_extend_strategy``);
- per-instance runtime overhead (CPU: the Python stub with ONNX Runtime; GPU: the session's
  cuBLAS/cuDNN handles and workspaces) and per-GPU runtime (the server's CUDA context);
- the Python stubs' shared-memory regions (host ``/dev/shm``): ``shm-default-byte-size``, grown
  in ``shm-growth-byte-size`` steps to hold a full batch's inputs and outputs.

The GPU budget is the tutorial's: 85% of the memory for models (weights and per-instance
overhead), 10% as batching headroom (activations at the max batch), 5% for the runtime (CUDA
contexts). The CPU figures are checked against the embedded server (``tests/unit/builder/test_planner.py``);
the GPU figures are derived the same way from the same graphs with the stated GPU constants, and
are estimates: nothing here has a GPU to measure them on.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from triton_pipelines.repository.contract import PYTHON_SHM_DEFAULT_BYTES, PYTHON_SHM_GROWTH_BYTES, BuiltManifest, ShmCheck


MiB = 1 << 20
GiB = 1 << 30
# The tutorial's split of a GPU's memory.
BUDGET = {"models": 0.85, "batching": 0.10, "runtime": 0.05}
GPUS = {"T4": 16, "V100-16GB": 16, "V100-32GB": 32, "A10": 24, "A10G": 24, "L4": 24, "L40S": 48,
        "A100-40GB": 40, "A100-80GB": 80, "H100-80GB": 80, "H200": 141}

# Measured on the embedded target (tritonserver 2.51, Python 3.11, ONNX Runtime 1.32): the RSS of a
# Python-backend stub with numpy and triton_pipelines imported (37-44 MiB for our plain Python
# models), the same stub running ONNX Runtime on a one-node graph (77 MiB), tritonserver itself.
PYTHON_STUB_BYTES = 40 * MiB
ORT_STUB_BYTES = 77 * MiB
SERVER_PROCESS_BYTES = 44 * MiB
# ONNX Runtime's CPU arena over the graph's live peak (BFC arena, regions doubling): 0.9 to 2.0x on
# our models and shapes; 1.25 keeps every measured case within 25% (tests/unit/builder/test_planner.py).
CPU_ARENA_FACTOR = 1.25
# GPU constants: assumptions stated in docs/operations.md, not measured here.
CUDA_CONTEXT_BYTES = 512 * MiB  # per GPU: tritonserver's CUDA context with the backends' kernels
GPU_INSTANCE_BYTES = 128 * MiB  # per ONNX Runtime CUDA session: cuBLAS/cuDNN handles, workspaces
GPU_ARENA_FACTOR = 2.0  # ONNX Runtime's CUDA arena, kNextPowerOfTwo (the onnxruntime backend default)
TRT_ARENA_FACTOR = 1.0  # TensorRT sizes its execution context's memory exactly
# The Python-backend shared memory the launcher gives tritonserver (triton_pipelines.repository.contract).
SHM_DEFAULT_BYTES = PYTHON_SHM_DEFAULT_BYTES
SHM_GROWTH_BYTES = PYTHON_SHM_GROWTH_BYTES

GEMM_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "MatMulInteger", "DynamicQuantizeMatMul",
            "MatMulIntegerToFloat", "QLinearConv", "QLinearMatMul", "ConvInteger", "FusedMatMul", "FusedConv"}
INTEGER_GEMM_OPS = {"MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "ConvInteger"}
PASS_THROUGH_OPS = {"Transpose", "Cast", "Reshape", "DequantizeLinear", "Identity"}


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*(B|KB|KiB|MB|MiB|GB|GiB|TB|TiB)?\s*", text, re.I)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 40GiB, 24GB, 512MiB)")
    units = {"b": 1, "kb": 1e3, "kib": 1 << 10, "mb": 1e6, "mib": MiB, "gb": 1e9, "gib": GiB, "tb": 1e12,
             "tib": 1 << 40}
    return int(float(match[1]) * units[(match[2] or "b").lower()])


# ----------------------------------------------------------------------------------- one graph
@dataclass(frozen=True)
class GraphWeights:
    initializer_bytes: int  # every initializer at its stored precision
    gemm_weight_bytes: int  # initializers that are a GEMM/convolution weight (pre-packed on the CPU)
    fp32_bytes: int  # the FP32 part (halved in a TensorRT FP16 plan)


def _itemsize(elem_type: int) -> int:
    from onnx import helper

    return helper.tensor_dtype_to_np_dtype(elem_type).itemsize


def _numel(dims) -> int:
    return math.prod(int(d) for d in dims) if len(dims) else 1


def graph_weights(model) -> GraphWeights:
    from onnx import TensorProto

    sizes = {t.name: _numel(t.dims) * _itemsize(t.data_type) for t in model.graph.initializer}
    fp32 = sum(_numel(t.dims) * 4 for t in model.graph.initializer if t.data_type == TensorProto.FLOAT)
    producers = {out: node for node in model.graph.node for out in node.output}

    def source(name: str, depth: int = 0) -> str | None:
        if name in sizes:
            return name
        node = producers.get(name)
        if node is None or depth > 4 or node.op_type not in PASS_THROUGH_OPS or not node.input:
            return None
        return source(node.input[0], depth + 1)

    packed = set()
    for node in model.graph.node:
        if node.op_type in GEMM_OPS:
            for name in node.input[1:2] if node.op_type != "QLinearMatMul" else node.input[3:4]:
                found = source(name)
                if found:
                    packed.add(found)
    return GraphWeights(sum(sizes.values()), sum(sizes[n] for n in packed), fp32)


def live_peak(model, input_dims: dict[str, list[int]]) -> tuple[int, int]:
    """(the live peak in bytes, the graph outputs' bytes) at the given input shapes: shape inference,
    then a walk in execution order that allocates each node's outputs and frees every intermediate
    after its last consumer."""
    import onnx
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for tensor in fixed.graph.input:
        if tensor.name in input_dims:
            for dim, value in zip(tensor.type.tensor_type.shape.dim, input_dims[tensor.name]):
                dim.ClearField("dim_param")
                dim.dim_value = int(value)
    inferred = SymbolicShapeInference.infer_shapes(fixed, auto_merge=True)
    sizes = {}
    for info in list(inferred.graph.value_info) + list(inferred.graph.output):
        tensor_type = info.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
        if tensor_type.HasField("shape") and None not in dims:
            sizes[info.name] = _numel(dims) * _itemsize(tensor_type.elem_type)
    keep = {t.name for t in inferred.graph.initializer} | {t.name for t in inferred.graph.input}
    outputs = {t.name for t in inferred.graph.output}
    last_use = {}
    for index, node in enumerate(inferred.graph.node):
        for name in node.input:
            last_use[name] = index
    live = peak = 0
    for index, node in enumerate(inferred.graph.node):
        live += sum(sizes.get(name, 0) for name in node.output)
        peak = max(peak, live)
        for name in set(node.input):
            if name in sizes and name not in keep and name not in outputs and last_use.get(name) == index:
                live -= sizes[name]
    return peak, sum(sizes.get(name, 0) for name in outputs)


# ----------------------------------------------------------------------------------- the repository
@dataclass
class Instance:
    """One loaded version of one model, with its instance count."""
    model: str
    version: int
    count: int
    kind: str  # "gpu" (a compute model: on the GPU on the gpu target) or "python" (host only)
    backend: str  # "onnxruntime", "tensorrt_plan", "python"
    gpus: list[int] = field(default_factory=list)
    weights: int = 0  # per instance, on its device
    activations: int = 0
    overhead: int = 0
    shm: int = 0  # host /dev/shm per instance (Python-backend stubs)
    host: int = 0  # host memory per instance on the embedded target (the stub's RSS)
    shape: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def device_bytes(self) -> int:
        return self.weights + self.activations + self.overhead


def _config(path: Path) -> mc.ModelConfig:
    return text_format.Parse(path.read_text(), mc.ModelConfig())


def _versions(config: mc.ModelConfig, model_dir: Path) -> list[int]:
    present = sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())
    policy = config.version_policy
    if policy.HasField("specific"):
        return [v for v in policy.specific.versions if v in present]
    if policy.HasField("all"):
        return present
    return present[-(policy.latest.num_versions or 1):]


def _dims_for(config: mc.ModelConfig, batch: int, sequence: dict[str, int]) -> dict[str, list[int]]:
    """Concrete input shapes: the batch, and each -1 dim at the input's (or the model's) bound."""
    dims = {}
    for tensor in config.input:
        bound = sequence.get(tensor.name, sequence.get("", 1))
        dims[tensor.name] = [batch] + [d if d > 0 else bound for d in tensor.dims]
    return dims


def _tensor_bytes(config: mc.ModelConfig, batch: int, sequence: dict[str, int]) -> int:
    """Inputs and outputs of one full batch (what crosses the Python backend's shared memory)."""
    import numpy as np
    from tritonclient.utils import triton_to_np_dtype

    total = 0
    for tensors in (config.input, config.output):
        for tensor in tensors:
            bound = sequence.get(tensor.name, sequence.get("", 1))
            itemsize = 1 if tensor.data_type == mc.TYPE_STRING else np.dtype(
                triton_to_np_dtype(mc.DataType.Name(tensor.data_type)[5:])).itemsize
            total += batch * _numel([d if d > 0 else bound for d in tensor.dims]) * itemsize
    return total


def _shm_region(io_bytes: int) -> int:
    if io_bytes <= SHM_DEFAULT_BYTES:
        return SHM_DEFAULT_BYTES
    return SHM_DEFAULT_BYTES + math.ceil((io_bytes - SHM_DEFAULT_BYTES) / SHM_GROWTH_BYTES) * SHM_GROWTH_BYTES


class Repository:
    """The built repository's models, with what the planner needs of each."""

    def __init__(self, path: Path, sequence_overrides: dict[str, dict[str, int]] | None = None):
        self.path = Path(path)
        built = BuiltManifest.read(self.path)
        self.target = built.target
        self.compute = built.compute_models
        self.family = {name: base for base, facts in self.compute.items()
                       for name in [base, *facts.latency_variants]}
        self.sequence_overrides = sequence_overrides or {}
        self._graphs: dict[Path, object] = {}
        # Shape inference of a large graph takes seconds: results are kept per file and shape, next
        # to the build stamp (files at the repository's top level are not models to Triton).
        self._cache_file = self.path / ".plan-graphs.json"
        try:
            self._cache = json.loads(self._cache_file.read_text())
        except (FileNotFoundError, ValueError):
            self._cache = {}

    def sequence(self, model: str) -> tuple[dict[str, int], bool]:
        """Bounds of the -1 dims: {input: n, "": default}; and whether they were declared."""
        base = self.family.get(model, model)
        bounds = dict(self.sequence_overrides.get(base, {}))
        facts = self.compute.get(base)
        declared = facts.max_sequence_length if facts else 0
        if "" not in bounds and declared:
            bounds[""] = declared
        return bounds, bool(bounds)

    def graph(self, path: Path):
        import onnx

        path = path.resolve()
        if path not in self._graphs:
            self._graphs[path] = onnx.load(str(path), load_external_data=False)
        return self._graphs[path]

    def analyse(self, path: Path, dims: dict[str, list[int]]) -> tuple[GraphWeights, int]:
        """(weights, live peak at ``dims``) of an ONNX file, cached by its path, size, time and the shape."""
        path = path.resolve()
        stat = path.stat()
        key = json.dumps([str(path), stat.st_size, stat.st_mtime_ns, sorted(dims.items())])
        if key not in self._cache:
            graph = self.graph(path)
            peak, _ = live_peak(graph, dims)
            self._cache[key] = {"weights": list(graph_weights(graph).__dict__.values()), "peak": peak}
            self._cache_file.parent.mkdir(parents=True, exist_ok=True)
            self._cache_file.write_text(json.dumps(self._cache))
        entry = self._cache[key]
        return GraphWeights(*entry["weights"]), entry["peak"]

    def configs(self) -> dict[str, mc.ModelConfig]:
        return {path.parent.name: _config(path) for path in sorted(self.path.glob("*/config.pbtxt"))}

    def shm_needs(self) -> dict[str, int]:
        """/dev/shm per Python-backend model of this build (``shm_needs``), loaded versions counted
        from the version folders."""
        configs = self.configs()
        return shm_needs(configs, {name: self.sequence(name)[0] for name in configs},
                         {name: len(_versions(config, self.path / name)) for name, config in configs.items()})

    def instances(self) -> list[Instance]:
        found = []
        configs = self.configs()
        bounds = {name: self.sequence(name)[0] for name in configs}
        for config in configs.values():
            if config.platform == "ensemble":
                continue
            model_dir = self.path / config.name
            count = sum(g.count or 1 for g in config.instance_group) or 1
            gpus = sorted({gpu for g in config.instance_group for gpu in g.gpus})
            is_compute = config.name in self.family
            backend = ("tensorrt_plan" if config.platform == "tensorrt_plan" else "onnxruntime") if is_compute \
                else "python"
            for version in _versions(config, model_dir):
                instance = Instance(config.name, version, count, "gpu" if is_compute else "python", backend, gpus)
                if is_compute:
                    self._estimate_compute(instance, config, model_dir / str(version))
                else:
                    instance.host = PYTHON_STUB_BYTES
                    instance.shm = stub_region_bytes(config, configs, bounds)
                found.append(instance)
        return found

    def estimate(self, model: str, version: int, batch: int, sequence: dict[str, int] | None = None) -> dict:
        """The CPU (embedded) estimate of one instance at a given shape, by part, in bytes."""
        config = _config(self.path / model / "config.pbtxt")
        bounds = sequence if sequence is not None else self.sequence(model)[0]
        weights, peak = self.analyse(self.path / model / str(version) / "model.onnx", _dims_for(config, batch, bounds))
        io = _tensor_bytes(config, batch, bounds)
        out = _tensor_bytes(_outputs_only(config), batch, bounds)
        parts = {"runtime": ORT_STUB_BYTES, "weights": weights.initializer_bytes + weights.gemm_weight_bytes,
                 "activations": int(CPU_ARENA_FACTOR * peak), "tensors": io + out}
        parts["total"] = sum(parts.values())
        return parts

    def _estimate_compute(self, instance: Instance, config: mc.ModelConfig, version_dir: Path) -> None:
        batch = max(1, config.max_batch_size)
        bounds, declared = self.sequence(instance.model)
        if not declared and any(d < 0 for t in config.input for d in t.dims):
            instance.notes.append("sequence bound not declared: variable dims at 1 (declare max_sequence_length "
                                  "or pass --sequence-length); activations understated")
        weights, peak = self.analyse(version_dir / "model.onnx", _dims_for(config, batch, bounds))
        io = _tensor_bytes(config, batch, bounds)
        out = _tensor_bytes(_outputs_only(config), batch, bounds)
        instance.shape = f"batch {batch}" + "".join(
            f", {name or 'length'} {bound}" for name, bound in sorted(bounds.items()))
        if any(node.op_type in INTEGER_GEMM_OPS for node in self.graph(version_dir / "model.onnx").graph.node):
            instance.notes.append("integer (dynamically quantized) GEMMs: ONNX Runtime's CUDA provider runs them "
                                  "on the CPU; the GPU figures are its float parts")
        if instance.backend == "tensorrt_plan":
            instance.weights = weights.initializer_bytes - weights.fp32_bytes // 2
            instance.activations = int(TRT_ARENA_FACTOR * peak)
        else:
            instance.weights = weights.initializer_bytes
            instance.activations = int(GPU_ARENA_FACTOR * peak)
        instance.overhead = GPU_INSTANCE_BYTES
        instance.host = (ORT_STUB_BYTES + weights.initializer_bytes + weights.gemm_weight_bytes
                         + int(CPU_ARENA_FACTOR * peak) + io + out)
        instance.shm = _shm_region(io) if self.target == "embedded" else 0  # gpu: no stub


def _outputs_only(config: mc.ModelConfig) -> mc.ModelConfig:
    only = mc.ModelConfig()
    only.output.extend(config.output)
    return only


# ----------------------------------------------------------------------------------- /dev/shm
def bls_calls(config: mc.ModelConfig) -> list[tuple[str, int, dict[str, int]]]:
    """The models a Python-backend model calls (BLS), the rows one call carries and the bounds of
    their variable dims, from its parameters: their inputs and outputs cross the caller's own
    shared-memory region too. whisper_decode (and its variants): one encoder call per
    ``encoder_max_batch_size`` windows; each decoder step for the windows decoded together
    (``speech.decode_group_size``), its self-attention K/V up to Whisper's 448 positions (unless
    the decoder keeps them: ``kept_in_callee``)."""
    from triton_pipelines.pipelines.speech.config import MAX_TARGET_POSITIONS
    from triton_pipelines.pipelines.speech.jobs import decode_group_size

    p = {key: value.string_value for key, value in config.parameters.items()}
    if "encoder_model" in p and "decoder_model" in p:
        encoder, decoder = int(p["encoder_max_batch_size"]), int(p["decoder_max_batch_size"])
        return [(p["encoder_model"], encoder, {}),
                (p["decoder_model"], decode_group_size(decoder, encoder), {"": MAX_TARGET_POSITIONS})]
    return []


def stub_region_bytes(config: mc.ModelConfig, configs: dict[str, mc.ModelConfig],
                      bounds: dict[str, dict[str, int]]) -> int:
    """The shared-memory region one stub of ``config`` grows to: a full batch's inputs and outputs,
    plus those of its BLS calls at their row counts (``shm-growth-byte-size`` steps)."""
    io = _tensor_bytes(config, max(1, config.max_batch_size), bounds.get(config.name, {}))
    for callee, rows, callee_bounds in bls_calls(config):
        io += _tensor_bytes(configs[callee], rows, callee_bounds | kept_in_callee(config, configs[callee]))
    return _shm_region(io)


def kept_in_callee(caller: mc.ModelConfig, callee: mc.ModelConfig) -> dict[str, int]:
    """The callee's state pairs (its ``state_inputs``: the Whisper decoder's self-attention K/V on the
    embedded target) as bounds of 0, when the caller keys its calls (``decoder_input_cache``): the
    callee keeps them between the calls, so they never cross the caller's region (the first call's
    state is zero-length)."""
    from triton_pipelines.pipelines.onnx_runner import parse_state_pairs

    parameter = lambda config, key: config.parameters[key].string_value if key in config.parameters else ""  # noqa: E731
    if parameter(caller, "decoder_input_cache") != "true":
        return {}
    return {name: 0 for pair in parse_state_pairs(parameter(callee, "state_inputs")).items() for name in pair}


def config_versions(config: mc.ModelConfig) -> int:
    """Versions a config loads (the builder writes ``specific`` for canaries, else one)."""
    return len(config.version_policy.specific.versions) or 1


def shm_needs(configs: dict[str, mc.ModelConfig], bounds: dict[str, dict[str, int]],
              versions: dict[str, int] | None = None) -> dict[str, int]:
    """/dev/shm each Python-backend model may hold (bytes): its stubs (instances x loaded versions)
    x the region each grows to. An upper bound: outputs that a GPU backend returns in device memory
    to a BLS caller travel by CUDA IPC, not through the region."""
    needs = {}
    for name, config in sorted(configs.items()):
        if config.platform == "ensemble" or config.backend != "python":
            continue
        count = sum(g.count or 1 for g in config.instance_group) or 1
        stubs = count * (versions or {}).get(name, config_versions(config))
        needs[name] = stubs * stub_region_bytes(config, configs, bounds)
    return needs


def shm_size_text(size: int) -> str:
    """A size for compose's ``shm_size`` / Kubernetes' ``sizeLimit``: whole GiB, rounded up."""
    return f"{max(1, math.ceil(size / GiB))}gb"


# ----------------------------------------------------------------------------------- plans
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


# ----------------------------------------------------------------------------------- report
def gib(value: float) -> str:
    return f"{value / GiB:.2f}"


def gpu_report(repository: Repository, instances: list[Instance], memory: int, gpus: int) -> tuple[str, bool]:
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


def host_report(repository: Repository, instances: list[Instance], memory: int) -> tuple[str, bool]:
    stubs = sum(i.host * i.count for i in instances)
    shm = sum(i.shm * i.count for i in instances)
    total = stubs + SERVER_PROCESS_BYTES
    lines = [f"Host plan for {repository.path} on the embedded target (every model a Python-backend stub on the "
             f"CPU): {gib(memory)} GiB available", "",
             "| model | version | instances | at | stub RSS GiB | of it /dev/shm GiB |", "|---|---|---|---|---|---|"]
    for i in instances:
        lines.append(f"| {i.model} | {i.version} | {i.count} | {i.shape or 'idle'} | {gib(i.host)} | {gib(i.shm)} |")
    lines.append(f"\nstubs {gib(stubs)} GiB (shared memory regions {gib(shm)} GiB of it) + tritonserver "
                 f"{gib(SERVER_PROCESS_BYTES)} GiB = {gib(total)} GiB")
    lines += [f"note: {note}" for note in sorted({f'{i.model}: {n}' for i in instances for n in i.notes})]
    fits = total <= memory
    lines.append(("FITS" if fits else "DOES NOT FIT") + f": {gib(total)} of {gib(memory)} GiB"
                 + ("" if fits else ": lower max batch sizes, instance counts or the loaded versions"))
    return "\n".join(lines), fits


def shm_report(needs: dict[str, int]) -> str:
    lines = ["| model | /dev/shm GiB (stubs x region at a full batch, BLS calls included) |", "|---|---|"]
    lines += [f"| {name} | {gib(size)} |" for name, size in needs.items()]
    total = sum(needs.values())
    lines.append(f"\ntotal {gib(total)} GiB: docker compose TRITON_SHM_SIZE={shm_size_text(total)}; Kubernetes "
                 f"sizeLimit: {shm_size_text(total)[:-2]}Gi (an upper bound: every stub at a full batch at once)")
    return "\n".join(lines)


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
    memory = args.gpu_memory or (GPUS[args.gpu] * GiB if args.gpu else None)
    if memory:
        report, fits = gpu_report(repository, instances, memory, args.gpus)
    else:
        report, fits = host_report(repository, instances, args.host_memory or host_memory())
    if args.check:
        report = "\n".join(line for line in report.splitlines() if line.startswith(("FITS", "DOES NOT FIT", "note:", "  ")))
        report += "\n" + ShmCheck.measure(sum(repository.shm_needs().values())).note()
        report = "[plan] " + report.replace("\n", "\n[plan] ")
    print(report)
    return 0 if fits or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
