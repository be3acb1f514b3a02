"""One description per compute model; its Triton config for each target is generated from it.

Targets:
- ``embedded``: the Python backend runs the ONNX file with ONNX Runtime on the CPU (the builder
  copies ``templates/onnx_runtime_runner.py`` in as its ``model.py``), because the embedded
  tritonserver has no ORT backend.
- ``gpu``: the native ``onnxruntime_onnx`` backend on ``KIND_GPU`` (the NGC container); per model,
  ``gpu_backend`` may instead choose ONNX Runtime with the TensorRT execution accelerator
  (``onnxruntime_trt``) or a TensorRT engine (``tensorrt_plan``, built by ``trtexec_args()``).
Name, tensors, max batch size and dynamic batching are identical in both (on the embedded target,
inputs listed in ``embedded_cached_inputs`` or ``embedded_state_inputs`` are also optional: a BLS caller
may name a cached copy, or the state its previous call left).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tritonclient.grpc import model_config_pb2 as mc

from triton_pipelines.pipelines.onnx_runner import LengthGrouping
from triton_pipelines.repository.contract import Provenance
from triton_pipelines.stub.heap import HEAP_KEEP_PARAMETER

TARGETS = ("embedded", "gpu")
# How the gpu target serves a compute model (``ComputeModel.gpu_backend``).
GPU_BACKENDS = ("onnxruntime_onnx", "onnxruntime_trt", "tensorrt_plan")
# onnxruntime_trt: parameters of the onnxruntime backend's "tensorrt" gpu_execution_accelerator.
# The engine cache lives outside the (read-only) repository; docker-compose mounts a volume there.
TRT_ACCELERATOR_PARAMETERS = (("precision_mode", "FP16"), ("max_workspace_size_bytes", str(1 << 30)),
                              ("trt_engine_cache_enable", "1"), ("trt_engine_cache_path", "/trt_cache"))


# No model gets a dynamic_batching.default_queue_policy. In Triton 2.51 any queue policy (a
# time-out, allow_timeout_override or max_queue_size) turns off the dynamic batcher's prefetching
# (core scheduler_utils.cc, PriorityQueue); the batcher then waits for an idle instance, but an
# instance that becomes idle does not wake it (rate_limiter.cc DequeuePayload), so a request that
# arrives while the instance is busy can sit up to the batcher's 500 ms poll. Measured here: every
# decoding step of a BLS loop behind a busy decoder, 1 in 8 stalled 500 ms. Back-pressure is the
# public front's in-flight limit instead (triton_pipelines.front.nginx_config, docs/operations.md).


@dataclass(frozen=True)
class LatencyVariant:
    """Another configuration of a compute model's weights, served as ``<name>_<suffix>``
    (see ``variants.py``): the model itself is the ``realtime`` class."""
    suffix: str
    preferred_batch_sizes: tuple[int, ...]
    max_queue_delay_microseconds: int
    preserve_ordering: bool = True


# The throughput ("batch") class every compute model gets unless its description says otherwise.
BATCH_VARIANT = LatencyVariant("batch", preferred_batch_sizes=(16, 32), max_queue_delay_microseconds=20000)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str  # a ModelConfig DataType name, e.g. "TYPE_FP32"
    dims: tuple[int, ...]


@dataclass(frozen=True)
class ComputeModel:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int
    export_onnx: Callable[[Path], None] = field(compare=False, repr=False)
    # Identity of the architecture and weights: with the name and tensors, the content hash that
    # decides re-export (``content_hash``); every other field only changes configs.
    source_key: str = ""
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_microseconds: int = 0
    embedded_cpu_threads: int = 2
    embedded_instances: int = 1
    gpu_instances: int = 1
    # gpu target only: one of GPU_BACKENDS, and the batch size the TensorRT optimization profile
    # is tuned for (0: max_batch_size).
    gpu_backend: str = "onnxruntime_onnx"
    trt_opt_batch_size: int = 0
    preserve_ordering: bool = False
    latency_variants: tuple[LatencyVariant, ...] = (BATCH_VARIANT,)
    # Canary: versions loaded together (version_policy specific); version N > 1 is derived from
    # version 1's ONNX by the named build in ``variants.VERSION_BUILDS`` ((2, "int8_dynamic"), ...).
    extra_versions: tuple[tuple[int, str], ...] = ()
    # embedded target only: inputs the ONNX Runtime runner keeps between a BLS caller's calls
    # (``onnx_runner.InputCache``). They stay in the config with their dims, marked optional, so a
    # caller may send them once and then name them by key instead of copying them on every call.
    embedded_cached_inputs: tuple[str, ...] = ()
    # embedded target only: state pairs (input, output) the runner keeps per BLS caller's key: a
    # keyed call that omits the input is fed the output of that caller's previous keyed call
    # (``onnx_runner.InputCache``, config parameter ``state_inputs``). The inputs are optional there.
    embedded_state_inputs: tuple[tuple[str, str], ...] = ()
    # embedded target only: ragged batching (``allow_ragged_batch`` on every input). The batcher
    # then merges requests of any sequence length and the runner groups their rows by their own
    # length (``onnx_runner.LengthGrouping``: its ``length_input`` and ``max_batch_tokens`` become
    # config parameters). The native onnxruntime backend would concatenate ragged inputs into one
    # flat tensor, which a padded graph cannot take, so the gpu target keeps equal shapes.
    embedded_length_grouping: LengthGrouping | None = None
    # embedded target only: freed bytes the runner's stub keeps on its heap instead of giving them
    # back to the kernel (config parameter ``heap_keep_freed_bytes``, ``stub.heap``); 0: glibc's
    # defaults. For models that allocate large arrays on every request.
    embedded_heap_keep_freed_bytes: int = 0
    # embedded target only: at most this many rows in one ONNX Runtime call (config parameter
    # ``rows_per_run``, ``OnnxBatchRunner``; 0: the whole batch). 1 for a graph whose outputs would
    # otherwise depend on the batch (dynamic int8 quantization): batches still form, run row by row.
    embedded_rows_per_run: int = 0
    # The largest size of the variable (-1) dimensions this model is sent at the configured limits
    # (a text encoder: the tokenizer's truncation length). The memory planner sizes activations
    # with it; 0: not declared (the planner then needs --sequence-length MODEL=N).
    max_sequence_length: int = 0
    # Where the weights came from: written into the config's parameters (``Provenance.config_parameters``)
    # and the model table of ``.built``. The weights themselves are in ``source_key``.
    provenance: Provenance | None = field(default=None, compare=False)

    @property
    def versions(self) -> tuple[int, ...]:
        return (1,) + tuple(number for number, _ in self.extra_versions)

    def content_hash(self, *extra: str) -> str:
        """What the exported ONNX depends on (not batching, backends or variants) plus ``extra``."""
        identity = repr((self.name, self.inputs, self.outputs, self.max_batch_size, self.source_key))
        digest = hashlib.sha256()
        for part in (identity, *extra):
            digest.update(part.encode())
            digest.update(b"\0")
        return digest.hexdigest()

    def config(self, target: str, execution_providers: str = "cpu") -> mc.ModelConfig:
        """``execution_providers``: embedded target only, the ONNX Runtime providers of the runner
        in preference order ("cpu", or e.g. "tensorrt,cuda,cpu" with onnxruntime-gpu)."""
        if target not in TARGETS:
            raise ValueError(f"unknown target {target!r}; choose one of {TARGETS}")
        config = mc.ModelConfig(name=self.name, max_batch_size=self.max_batch_size)
        for spec, tensors in ((self.inputs, config.input), (self.outputs, config.output)):
            for tensor in spec:
                tensors.add(name=tensor.name, data_type=mc.DataType.Value(tensor.data_type), dims=tensor.dims)
        batching = config.dynamic_batching
        batching.SetInParent()
        batching.preferred_batch_size.extend(self.preferred_batch_sizes)
        batching.max_queue_delay_microseconds = self.max_queue_delay_microseconds
        batching.preserve_ordering = self.preserve_ordering
        if self.extra_versions:
            config.version_policy.specific.versions.extend(self.versions)
        self._add_warmup(config, (1,))
        for key, value in (self.provenance.config_parameters() if self.provenance else {}).items():
            config.parameters[key].string_value = value
        if target == "embedded":
            config.backend = "python"
            config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_CPU, count=self.embedded_instances)
            config.parameters["onnx_file"].string_value = "model.onnx"
            config.parameters["intra_op_threads"].string_value = str(self.embedded_cpu_threads)
            if execution_providers != "cpu":
                config.parameters["execution_providers"].string_value = execution_providers
            # Inputs a keyed BLS caller may leave out: cached copies and state (onnx_runner.InputCache).
            state_inputs = [name for name, _ in self.embedded_state_inputs]
            unknown = (set(self.embedded_cached_inputs + tuple(state_inputs)) - {t.name for t in self.inputs}) | \
                      ({output for _, output in self.embedded_state_inputs} - {t.name for t in self.outputs})
            if unknown:
                raise ValueError(f"{self.name}: embedded_cached_inputs/embedded_state_inputs name unknown "
                                 f"tensors {sorted(unknown)}")
            for tensor in config.input:
                if tensor.name in self.embedded_cached_inputs or tensor.name in state_inputs:
                    tensor.optional = True
            if self.embedded_cached_inputs:
                config.parameters["cached_inputs"].string_value = ",".join(self.embedded_cached_inputs)
            if self.embedded_state_inputs:
                config.parameters["state_inputs"].string_value = ",".join(
                    f"{name}={output}" for name, output in self.embedded_state_inputs)
            grouping = self.embedded_length_grouping
            if grouping is not None:
                for tensor in config.input:
                    tensor.allow_ragged_batch = True
                if grouping.length_input:
                    config.parameters["length_input"].string_value = grouping.length_input
                config.parameters["max_batch_tokens"].string_value = str(grouping.max_batch_tokens)
            if self.embedded_heap_keep_freed_bytes:
                config.parameters[HEAP_KEEP_PARAMETER].string_value = str(self.embedded_heap_keep_freed_bytes)
            if self.embedded_rows_per_run:
                config.parameters["rows_per_run"].string_value = str(self.embedded_rows_per_run)
        else:
            self._gpu_backend_config(config)
            config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_GPU, count=self.gpu_instances)
        return config

    def _gpu_backend_config(self, config: mc.ModelConfig) -> None:
        if self.gpu_backend not in GPU_BACKENDS:
            raise ValueError(f"{self.name}: unknown gpu_backend {self.gpu_backend!r}; choose one of {GPU_BACKENDS}")
        if self.gpu_backend == "tensorrt_plan":
            self.trtexec_args()  # static shapes are required
            config.platform = "tensorrt_plan"
            config.default_model_filename = "model.plan"
            return
        config.platform = "onnxruntime_onnx"
        config.default_model_filename = "model.onnx"
        if self.gpu_backend == "onnxruntime_trt":
            accelerator = config.optimization.execution_accelerators.gpu_execution_accelerator.add(name="tensorrt")
            for key, value in TRT_ACCELERATOR_PARAMETERS:
                accelerator.parameters[key] = value
            # An explicit optimization profile (the 24.10 onnxruntime backend's trt_profile_*_shapes):
            # ORT-TRT builds the engine for batch 1 .. max_batch_size once, at load, instead of for
            # the batch sizes it has seen so far (rebuilding under traffic when a larger one comes).
            for kind, shapes in self.profile_shapes().items():
                accelerator.parameters[f"trt_profile_{kind}_shapes"] = shapes

    def _add_warmup(self, config: mc.ModelConfig, batch_sizes: tuple[int, ...]) -> None:
        """``model_warmup``: Triton runs these zero-filled requests on every instance while loading
        it, before the version is READY, so the first real request does not pay for the runtime's
        first run (ONNX Runtime's kernel and buffer set-up, TensorRT's engine build). A variable
        (-1) dimension is warmed at size 1."""
        for batch_size in batch_sizes:
            warmup = config.model_warmup.add(name=f"batch_{batch_size}", batch_size=batch_size)
            for tensor in self.inputs:
                data = warmup.inputs[tensor.name]
                data.data_type = mc.DataType.Value(tensor.data_type)
                data.dims.extend(d if d > 0 else 1 for d in tensor.dims)
                data.zero_data = True

    def profile_shapes(self) -> dict[str, str]:
        """TensorRT optimization profile covering batch 1 .. max_batch_size (optimized for
        ``trt_opt_batch_size``), as ``{"min"|"opt"|"max": "name:BxD1xD2,..."}``: the format of both
        trtexec's ``--minShapes`` and the onnxruntime backend's ``trt_profile_min_shapes``."""
        for tensor in self.inputs:
            if any(d <= 0 for d in tensor.dims):
                raise ValueError(f"{self.name}: a TensorRT profile needs static non-batch dims, "
                                 f"{tensor.name} has {list(tensor.dims)}")
        opt = self.trt_opt_batch_size or self.max_batch_size
        batches = {"min": 1, "opt": min(opt, self.max_batch_size), "max": self.max_batch_size}
        return {kind: ",".join(f"{t.name}:{'x'.join(str(d) for d in (batch, *t.dims))}" for t in self.inputs)
                for kind, batch in batches.items()}

    def trtexec_args(self) -> list[str]:
        """trtexec flags turning ``model.onnx`` into an FP16 ``model.plan`` with that profile
        (``docker/build_trt_engines.sh`` runs them)."""
        return ["--fp16"] + [f"--{kind}Shapes={shapes}" for kind, shapes in self.profile_shapes().items()]
