"""Speech pipeline: ``whisper_encoder`` and ``whisper_decoder`` (compute models; their ONNX graphs
and weights: ``repo_builder.export.whisper``), ``audio_features`` and ``whisper_decode`` (Python,
BLS) and the ``speech_recognition`` ensemble.

Weights: by default on the embedded target the real OpenAI Whisper base (from the weights
packages); ``--whisper-checkpoint DIR`` (a local Hugging Face checkpoint); or, with an explicit
``--whisper-size``, that architecture with deterministic random weights. The gpu target's default
stays random large-v3.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
from functools import partial
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from triton_pipelines.pipelines.speech.config import CONFIG_PARAMETERS
from triton_pipelines.pipelines.speech.decoding import cross_names
from triton_pipelines.stub.heap import HEAP_KEEP_PARAMETER

from .compute import ComputeModel, LatencyVariant, TensorSpec
from .export.whisper import (ENCODER_POSITIONS, N_FRAMES, RANDOM_INIT_STD, RANDOM_SEED, WHISPER_SIZES, WhisperSource,
                             export_decoder, export_encoder, whisper_config_dict)
from .pipeline import BuildContext, Pipeline

# Without --whisper-size/--whisper-checkpoint: real Whisper base (PRETRAINED) on the embedded
# target, random large-v3 on the gpu target.
PRETRAINED = "pretrained-base"
DEFAULT_WEIGHTS = {"embedded": PRETRAINED, "gpu": "large-v3"}
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
SPEECH_BATCH_VARIANT = LatencyVariant("batch", preferred_batch_sizes=(8,), max_queue_delay_microseconds=50000)


def whisper_assets_dir() -> Path:
    """``whisper/assets`` of the openai-whisper package (installed --no-deps; never imported)."""
    spec = importlib.util.find_spec("whisper")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("openai-whisper is not installed: run `make install` "
                           "(pip install --no-deps -r requirements-nodeps.txt)")
    return Path(list(spec.submodule_search_locations)[0]) / "assets"


def choose_source(target: str, size: str | None, checkpoint: Path | None) -> WhisperSource:
    """The weights of a build: ``--whisper-checkpoint``, else ``--whisper-size`` (random), else the
    target's default (``DEFAULT_WEIGHTS``)."""
    if checkpoint is not None:
        return WhisperSource("checkpoint", checkpoint=checkpoint.resolve())
    if size is not None:
        return WhisperSource("random", size=size)
    default = DEFAULT_WEIGHTS[target]
    return WhisperSource("pretrained") if default == PRETRAINED else WhisperSource("random", size=default)


def cross_attention_specs(arch: dict) -> tuple[TensorSpec, ...]:
    """The cross-attention K/V of every decoder layer: the encoder's outputs, the decoder's inputs."""
    heads = arch["decoder_attention_heads"]
    head_dim = arch["d_model"] // heads
    specs = []
    for i in range(arch["decoder_layers"]):
        specs += [TensorSpec(f"cross_key_{i}", "TYPE_FP32", (heads, head_dim, ENCODER_POSITIONS)),
                  TensorSpec(f"cross_value_{i}", "TYPE_FP32", (heads, ENCODER_POSITIONS, head_dim))]
    return tuple(specs)


def encoder_model(source: WhisperSource, target: str) -> ComputeModel:
    arch = whisper_config_dict(source)
    return ComputeModel(
        name="whisper_encoder",
        inputs=(TensorSpec("input_features", "TYPE_FP32", (arch["num_mel_bins"], N_FRAMES)),),
        outputs=cross_attention_specs(arch),
        max_batch_size=MAX_ENCODER_BATCH[target],
        export_onnx=partial(export_encoder, source),
        source_key=source.key(),
        latency_variants=(),
        embedded_heap_keep_freed_bytes=HEAP_KEEP_FREED_BYTES,
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
                 TensorSpec("present_self_kv", "TYPE_FP32", cache)),
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
        parser.add_argument("--whisper-size", choices=sorted(WHISPER_SIZES),
                            help="build whisper_encoder/whisper_decoder with this architecture and deterministic "
                                 f"random weights (init_std={RANDOM_INIT_STD}, seed {RANDOM_SEED}): fast tests. "
                                 "Default: real Whisper base from the weights packages on the embedded target, "
                                 "random large-v3 on the gpu target; ignored with --whisper-checkpoint")
        parser.add_argument("--whisper-checkpoint", type=Path, metavar="DIR",
                            help="a local Hugging Face WhisperForConditionalGeneration checkpoint "
                                 "(config.json + weights)")

    def source(self, context: BuildContext) -> WhisperSource:
        return choose_source(context.target, context.args.whisper_size, context.args.whisper_checkpoint)

    def architecture(self, context: BuildContext) -> dict:
        return whisper_config_dict(self.source(context))

    def compute_models(self, context: BuildContext) -> list[ComputeModel]:
        source = self.source(context)
        return [encoder_model(source, context.target), decoder_model(source)]

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
        if model_name in ("whisper_decode", "speech_recognition_stream"):
            shutil.copy2(assets / "multilingual.tiktoken", version_dir / "multilingual.tiktoken")

    def model_table(self, context: BuildContext) -> list[dict]:
        source = self.source(context)
        arch = self.architecture(context)
        name = {"checkpoint": f"Whisper from {source.checkpoint}", "pretrained": "Whisper base",
                "random": f"Whisper {source.size}"}[source.kind]
        architecture = (f"{name} ({arch['encoder_layers']}+{arch['decoder_layers']} layers, d_model "
                        f"{arch['d_model']}, {arch['num_mel_bins']} mel bins)")
        weights = source.describe()
        return [{"model": "whisper_encoder", "architecture": architecture + ": encoder + cross-attention K/V",
                 "weights": weights},
                {"model": "whisper_decoder", "architecture": architecture + ": decoder step with self-attention "
                 "KV cache", "weights": weights}]
