"""The repository builder: weights from a local checkpoint, content-hash rebuilds, both targets."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from repo_builder.__main__ import main as build
from repo_builder.files import read_config
from repo_builder.text_pipeline import minilm_dir


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A local Hugging Face BERT checkpoint (random, hidden 64) with MiniLM's tokenizer."""
    import torch
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=128)).save_pretrained(folder)
    shutil.copy2(minilm_dir() / "tokenizer.json", folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def built(tiny_checkpoint, tmp_path_factory):
    output = tmp_path_factory.mktemp("repo")
    build(["--pipelines", "text", "--output", str(output), "--text-encoder-checkpoint", str(tiny_checkpoint)])
    return output


@pytest.mark.slow  # exports a checkpoint (module fixture `built`)
def test_local_checkpoint_sets_the_encoder_and_the_embedding_width(built, tiny_checkpoint):
    import onnxruntime as ort
    import torch
    from transformers import BertModel

    assert list(read_config(built / "text_encoder" / "config.pbtxt").output[0].dims) == [-1, 64]
    assert list(read_config(built / "text_encoder" / "config.pbtxt").output[1].dims) == [64]
    assert list(read_config(built / "text_embedding" / "config.pbtxt").output[0].dims) == [64]
    assert list(read_config(built / "intent_classifier" / "config.pbtxt").input[0].dims) == [64]
    ids = np.array([[101, 7592, 2088, 102]], dtype=np.int64)
    session = ort.InferenceSession(str(built / "text_encoder" / "1" / "model.onnx"))
    (hidden,) = session.run(["last_hidden_state"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    with torch.no_grad():
        expected = BertModel.from_pretrained(str(tiny_checkpoint), add_pooling_layer=False)(
            input_ids=torch.from_numpy(ids)).last_hidden_state.numpy()
    np.testing.assert_allclose(hidden, expected, atol=1e-4)
    prototypes = np.load(built / "intent_classifier" / "1" / "intent_prototypes.npz")
    assert prototypes["vectors"].shape[1] == 64


@pytest.mark.slow
def test_rebuild_with_nothing_changed_exports_nothing(built, tiny_checkpoint, capsys):
    onnx = built / "text_encoder" / "1" / "model.onnx"
    before = onnx.stat().st_mtime_ns
    build(["--pipelines", "text", "--output", str(built), "--text-encoder-checkpoint", str(tiny_checkpoint)])
    assert onnx.stat().st_mtime_ns == before
    assert "text_encoder: up to date" in capsys.readouterr().out


@pytest.mark.slow
def test_gpu_target_rewrites_only_configs(built, tiny_checkpoint):
    onnx = built / "text_encoder" / "1" / "model.onnx"
    before = onnx.stat().st_mtime_ns
    build(["--target", "gpu", "--pipelines", "text", "--output", str(built),
           "--text-encoder-checkpoint", str(tiny_checkpoint)])
    config = read_config(built / "text_encoder" / "config.pbtxt")
    assert config.platform == "onnxruntime_onnx" and not config.backend
    assert not (built / "text_encoder" / "1" / "model.py").exists()
    assert onnx.stat().st_mtime_ns == before
    assert read_config(built / "text_tokenizer" / "config.pbtxt").backend == "python"


@pytest.mark.slow
def test_every_folder_and_file_is_readable_by_another_user(built):
    """The builder runs as root, the servers as uid 1000: no 0700 folder (mkdtemp) or 0600 file."""
    import stat

    unreadable = [str(path.relative_to(built)) for path in [built, *built.rglob("*")]
                  if not path.is_symlink() and (
                      (path.is_dir() and (path.stat().st_mode & 0o005) != 0o005)
                      or (path.is_file() and not path.stat().st_mode & stat.S_IROTH))]
    assert not unreadable, f"not readable by others: {unreadable[:10]}"


def test_replace_dir_leaves_a_readable_folder(tmp_path):
    from repo_builder.files import replace_dir

    def fill(folder):
        (folder / "1").mkdir()
        (folder / "1" / "model.onnx").write_bytes(b"x")
        (folder / "config.pbtxt").write_text("name: 'm'")
        (folder / "config.pbtxt").chmod(0o600)

    replace_dir(tmp_path / "m", fill)
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "m" / "1").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "m" / "config.pbtxt").stat().st_mode & 0o777 == 0o644
