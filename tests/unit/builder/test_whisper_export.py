"""The Whisper decoder's post-export rewrite (export/whisper.py): no stale per-weight files."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from repo_builder.export.whisper import share_tied_embedding


def _tied_decoder(path, vocab=64, width=16):
    """Gather(embedding, input_ids) ... MatMul(x, embedding.T): the legacy exporter's tied layout,
    saved as the exporter saves a model over 2 GiB: one external file per weight."""
    rng = np.random.default_rng(0)
    embedding = rng.standard_normal((vocab, width)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["embed_tokens.weight", "input_ids"], ["h"]),
             helper.make_node("MatMul", ["h", "proj"], ["logits"])]
    graph = helper.make_graph(
        nodes, "decoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", vocab])],
        [numpy_helper.from_array(embedding, "embed_tokens.weight"),
         numpy_helper.from_array(np.ascontiguousarray(embedding.T), "proj")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=False,
              size_threshold=0)
    return embedding


def test_a_large_decoder_keeps_only_model_onnx_and_its_data_file(tmp_path):
    import onnxruntime as ort

    path = tmp_path / "model.onnx"
    embedding = _tied_decoder(path)
    assert len(list(tmp_path.iterdir())) == 3  # model.onnx + one file per weight
    share_tied_embedding(path, external_data_bytes=0)  # "large": as large-v3 is
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"input_ids": np.array([3, 5])})
    np.testing.assert_allclose(logits, embedding[[3, 5]] @ embedding.T, rtol=1e-5)
    # Run again (a rebuild): still two files and the same result.
    share_tied_embedding(path, external_data_bytes=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]


def test_a_small_decoder_is_one_file(tmp_path):
    path = tmp_path / "model.onnx"
    _tied_decoder(path)
    share_tied_embedding(path)
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"]
