"""The built repository's model instances and their estimates.

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

import json
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from triton_pipelines.repository.contract import BuiltManifest

from .graph import INTEGER_GEMM_OPS, GraphWeights, graph_weights, live_peak
from .shm import _shm_region, _tensor_bytes, shm_needs, stub_region_bytes
from .sizes import (CPU_ARENA_FACTOR, GPU_ARENA_FACTOR, GPU_INSTANCE_BYTES, ORT_STUB_BYTES, PYTHON_STUB_BYTES,
                    TRT_ARENA_FACTOR)


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
