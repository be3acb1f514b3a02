"""The real Whisper base weights (no server): the packages' model.bin, its reader and the mapping
onto Hugging Face ``WhisperForConditionalGeneration``."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from repo_builder import ct2_whisper
from repo_builder.export.whisper import WHISPER_SIZES
from repo_builder.speech_pipeline import whisper_assets_dir
from triton_pipelines.pipelines.speech.tokenizer import WhisperTokenizer


def string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def tiny_model_bin(variables: dict[str, np.ndarray], aliases: dict[str, str]) -> bytes:
    ids = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2, np.dtype(np.float16): 4}
    out = struct.pack("<I", 6) + string("WhisperSpec") + struct.pack("<II", 3, len(variables))
    for name, value in variables.items():
        out += string(name) + struct.pack("<B", value.ndim) + struct.pack(f"<{value.ndim}I", *value.shape)
        out += struct.pack("<BI", ids[value.dtype], value.nbytes) + value.tobytes()
    out += struct.pack("<I", len(aliases))
    for alias, target in aliases.items():
        out += string(alias) + string(target)
    return out


def test_reader_parses_the_v6_layout_and_resolves_aliases():
    weight = np.arange(6, dtype=np.float16).reshape(2, 3)
    data = tiny_model_bin({"a/weight": weight, "a/scalar": np.array(8, np.int16)}, {"b/weight": "a/weight"})
    header, variables = ct2_whisper.parse_model_bin(data)
    assert header == {"version": 6, "spec": "WhisperSpec", "revision": 3, "aliases": {"b/weight": "a/weight"}}
    np.testing.assert_array_equal(variables["a/weight"], weight)
    np.testing.assert_array_equal(variables["b/weight"], weight)
    assert int(variables["a/scalar"]) == 8
    with pytest.raises(ct2_whisper.WeightsError, match="truncated"):
        ct2_whisper.parse_model_bin(data[:40])
    with pytest.raises(ct2_whisper.WeightsError, match="version 5"):
        ct2_whisper.parse_model_bin(struct.pack("<I", 5) + data[4:])


def test_a_model_bin_with_another_checksum_is_refused(tmp_path):
    part = tmp_path / "model.bin.part1"
    part.write_bytes(b"not the weights")
    with pytest.raises(ct2_whisper.WeightsError, match="sha256"):
        ct2_whisper.read_model_bin_bytes([part], sha256="0" * 64)
    with pytest.raises(ct2_whisper.WeightsError, match="expected 145217532"):
        ct2_whisper.read_model_bin_bytes([part])


@pytest.fixture(scope="module")
def packaged():
    return ct2_whisper.load_ct2_whisper()  # size and sha256 checked


def test_the_packages_hold_whisper_base_in_float16(packaged):
    header, variables = packaged
    assert (header["version"], header["spec"], header["revision"]) == (6, "WhisperSpec", 3)
    assert header["aliases"] == {"decoder/projection/weight": "decoder/embeddings/weight"}
    assert len(variables) - len(header["aliases"]) == 212
    weights = [v for v in variables.values() if v.ndim >= 1]
    assert all(v.dtype == np.float16 for v in weights)
    assert ct2_whisper.architecture(variables) == WHISPER_SIZES["base"]


def test_mapping_loads_strictly_with_tied_embedding_and_stored_positions(packaged):
    _, variables = packaged
    model = ct2_whisper.load_hf_whisper()  # strict load_state_dict inside
    decoder = model.model.decoder
    assert model.proj_out.weight.data_ptr() == decoder.embed_tokens.weight.data_ptr()
    np.testing.assert_array_equal(model.model.encoder.embed_positions.weight.detach().numpy(),
                                  variables["encoder/position_encodings/encodings"].astype(np.float32))
    fused = variables["decoder/layer_2/self_attention/linear_0/weight"].astype(np.float32)
    attention = decoder.layers[2].self_attn
    np.testing.assert_array_equal(attention.v_proj.weight.detach().numpy(), fused[1024:])
    assert attention.k_proj.bias is None
    cross = variables["decoder/layer_5/attention/linear_1/weight"].astype(np.float32)
    np.testing.assert_array_equal(decoder.layers[5].encoder_attn.v_proj.weight.detach().numpy(), cross[512:])


def test_non_speech_tokens_equal_the_packages_suppress_ids():
    tokenizer = WhisperTokenizer(whisper_assets_dir() / "multilingual.tiktoken")
    config = json.loads((ct2_whisper.weights_dir() / "config.json").read_text())
    assert list(tokenizer.non_speech_tokens) == [t for t in config["suppress_ids"] if t < tokenizer.eot]
    assert config["suppress_ids_begin"] == [tokenizer.encode(" ")[0], tokenizer.eot]
    mask, begin = tokenizer.suppress_masks(51865)
    assert np.isinf(mask[list(tokenizer.non_speech_tokens)]).all() and mask[tokenizer.eot] == 0
    assert np.isinf(begin[config["suppress_ids_begin"]]).all() and mask[220] == 0
