"""--whisper-int8 (the encoder's MatMul weights int8 per channel) and the VAD asset: no export of
Whisper itself (a small graph stands in for the quantizer)."""

from __future__ import annotations

import argparse

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from repo_builder.export.whisper import (ENCODER_INT8_NOTE, WhisperSource, export_encoder, export_encoder_int8,
                                         quantize_encoder)
from repo_builder.speech_pipeline import SpeechPipeline, encoder_model, packaged_source, vad_model_path
from triton_pipelines.pipelines.onnx_runner import OnnxBatchRunner, onnx_session
from triton_pipelines.pipelines.speech.vad import VAD_MODEL_FILE


def test_the_int8_encoder_is_another_export_with_its_provenance():
    source = packaged_source("test")
    plain, int8 = encoder_model(source, "embedded"), encoder_model(source, "embedded", int8=True)
    assert plain.export_onnx.func is export_encoder and int8.export_onnx.func is export_encoder_int8
    assert plain.source_key != int8.source_key  # a build switches cleanly either way
    assert ENCODER_INT8_NOTE in int8.provenance.architecture and ENCODER_INT8_NOTE not in plain.provenance.architecture
    assert isinstance(int8.export_onnx.args[0], WhisperSource)


def test_the_embedded_int8_encoder_runs_one_window_a_call():
    source = packaged_source("test")
    int8 = encoder_model(source, "embedded", int8=True).config("embedded")
    assert int8.parameters["rows_per_run"].string_value == "1"
    assert "rows_per_run" not in encoder_model(source, "embedded").config("embedded").parameters


def test_the_builder_flag():
    parser = argparse.ArgumentParser()
    SpeechPipeline.add_arguments(parser)
    assert parser.parse_args(["--whisper-int8"]).whisper_encoder == "int8"
    assert parser.parse_args(["--whisper-encoder", "int8"]).whisper_encoder == "int8"
    assert parser.parse_args([]).whisper_encoder == "float32"


def quantized_matmul(tmp_path):
    """A MatMul graph and its int8 version (``quantize_encoder``) → (int8 path, weight)."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((64, 32)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 32])], [numpy_helper.from_array(weight, "w")])
    source, target = tmp_path / "float32.onnx", tmp_path / "int8.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), source)
    quantize_encoder(source, target)
    return target, weight


def test_quantize_encoder_makes_matmul_weights_int8_and_keeps_the_results(tmp_path):
    target, weight = quantized_matmul(tmp_path)
    rng = np.random.default_rng(1)
    ops = {node.op_type for node in onnx.load(target).graph.node}
    assert "MatMulInteger" in ops or "DynamicQuantizeMatMul" in ops, ops
    x = rng.standard_normal((3, 64)).astype(np.float32)
    expected = x @ weight
    got = onnx_session(target, 1).run(None, {"x": x})[0]
    assert np.abs(got - expected).max() < 0.05 * np.abs(expected).max()


def test_the_vad_model_ships_in_the_faster_whisper_wheel():
    path = vad_model_path()
    assert path.name == VAD_MODEL_FILE and path.stat().st_size > 1_000_000


def test_a_row_of_the_int8_graph_does_not_depend_on_its_batch_when_run_a_row_a_call(tmp_path):
    """Dynamic quantization scales a call's activations together: a quiet row next to a loud one
    comes out differently than alone. ``rows_per_run=1`` (the embedded int8 encoder's) gives each
    row exactly its result alone, as two requests or as one request of several rows."""
    target, _ = quantized_matmul(tmp_path)
    rng = np.random.default_rng(2)
    quiet, loud = rng.standard_normal((1, 64)).astype(np.float32), 50 * rng.standard_normal((1, 64)).astype(np.float32)
    batched, per_row = OnnxBatchRunner(target, 1), OnnxBatchRunner(target, 1, rows_per_run=1)
    (alone,) = batched.run([{"x": quiet}])
    together = batched.run([{"x": quiet}, {"x": loud}])
    assert not np.array_equal(together[0]["y"], alone["y"])  # the batch changes the quiet row
    assert np.array_equal(per_row.run([{"x": quiet}, {"x": loud}])[0]["y"], alone["y"])
    (both,) = per_row.run([{"x": np.concatenate([quiet, loud])}])
    assert np.array_equal(both["y"][:1], alone["y"]) and both["y"].shape == (2, 32)


def test_the_int8_encoder_is_refused_on_the_gpu_target():
    import pytest

    from triton_pipelines.errors import ConfigError

    class Context:
        target = "gpu"
        args = argparse.Namespace(whisper_encoder="int8")

        @staticmethod
        def once(name, make):
            return packaged_source("test")

    with pytest.raises(ConfigError, match="embedded target"):
        SpeechPipeline().compute_models(Context())
