"""The ``model.py`` adapters and their Triton-facing helpers (``triton_pipelines.stub``) in this
process, with ``tests/support/fake_pb_utils.py`` standing in for Triton's stub module: no server. The
adapters stay thin; what they do is answered here, what Triton does by the server tests."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import json_format

from repo_builder.files import read_config
from repo_builder.repository import ONNX_RUNNER_TEMPLATE
from tests.support import fake_pb_utils
from triton_pipelines.errors import INPUT_ERROR_PREFIX, InputError
from triton_pipelines.pipelines.onnx_runner import EmbeddedComputeModel, InputCache
from tests.support.paths import PROJECT_ROOT

ROOT = PROJECT_ROOT
REPOSITORY = ROOT / "model_repository"
ADAPTERS = sorted((ROOT / "python_models").glob("*/model.py")) + [ONNX_RUNNER_TEMPLATE]
MAX_ADAPTER_LINES = 80


@pytest.fixture
def pb(monkeypatch):
    """``triton_python_backend_utils`` is the fake while the test runs (and the stub modules are
    imported afresh against it)."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils)
    fake_pb_utils.MODELS.clear()
    yield fake_pb_utils
    for name in [name for name in sys.modules if name.startswith("triton_pipelines.stub.")]:
        del sys.modules[name]


def load_adapter(path: Path):
    spec = importlib.util.spec_from_file_location(f"adapter_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TritonPythonModel()


def built_args(name: str, instance: int = 0) -> dict:
    """What Triton passes to ``initialize`` for a model of the built repository."""
    if not (REPOSITORY / ".built").exists():
        pytest.skip("model_repository/ not built (make test builds it first)")
    config = json_format.MessageToDict(read_config(REPOSITORY / name / "config.pbtxt"),
                                       preserving_proto_field_name=True)
    return {"model_config": json.dumps(config), "model_repository": str(REPOSITORY / name), "model_version": "1",
            "model_name": name, "model_instance_name": f"{name}_{instance}"}


def initialized(path: Path, name: str, instance: int = 0):
    model = load_adapter(path)
    model.initialize(built_args(name, instance))
    return model


def outputs(response) -> dict[str, np.ndarray]:
    assert not response.has_error(), response.error().message()
    return {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}


@pytest.mark.parametrize("path", ADAPTERS, ids=lambda p: p.parent.name if p.name == "model.py" else p.stem)
def test_every_adapter_is_short_and_loads(pb, path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_ADAPTER_LINES, f"{path}: {lines} lines; move its logic into src/triton_pipelines"
    assert hasattr(load_adapter(path), "execute")


# --- stub.responses: one request loop, one mapping of failures to codes --------------------------


def test_a_bad_request_is_answered_alone_with_invalid_arg(pb):
    from triton_pipelines.stub.responses import respond

    def parse(request):
        if request.inputs["x"].as_numpy()[0] < 0:
            raise InputError("input 'x' is negative")
        return {"y": request.inputs["x"].as_numpy() * 2}

    good, bad = pb.Request({"x": np.array([1])}), pb.Request({"x": np.array([-1])})
    answers = respond([good, bad, good], parse)
    assert [outputs(answers[i])["y"].tolist() for i in (0, 2)] == [[2], [2]]
    assert answers[1].error().code() == pb.TritonError.INVALID_ARG
    assert answers[1].error().message() == INPUT_ERROR_PREFIX + "input 'x' is negative"


def test_a_failed_batch_fails_its_requests_not_the_stub(pb):
    from triton_pipelines.stub.responses import respond

    def parse(request):
        if request.inputs["x"].as_numpy()[0] < 0:
            raise InputError("negative")
        return request.inputs["x"].as_numpy()

    def run(works):
        raise ValueError("boom")

    answers = respond([pb.Request({"x": np.array([1])}), pb.Request({"x": np.array([-1])})], parse, run,
                      failure="model failed")
    assert (answers[0].error().code(), answers[0].error().message()) == (pb.TritonError.INTERNAL, "model failed: boom")
    assert answers[1].error().code() == pb.TritonError.INVALID_ARG


def test_run_answers_per_work_with_outputs_or_an_error(pb):
    from triton_pipelines.stub.responses import respond

    works = []

    def run(items):
        works.append(items)
        return [{"y": items[0]}, InputError("second is bad"), RuntimeError("third broke")]

    answers = respond([pb.Request({}) for _ in range(3)], lambda request: len(works) or 7, run)
    assert works == [[7, 7, 7]]  # one run for the whole batch
    assert outputs(answers[0])["y"].tolist() == 7
    assert [a.error().code() for a in answers[1:]] == [pb.TritonError.INVALID_ARG, pb.TritonError.INTERNAL]


@pytest.mark.parametrize("reason, code", [("invalid_input", "INVALID_ARG"), ("upstream_invalid_input", "INVALID_ARG"),
                                          ("overloaded", "UNAVAILABLE"), ("not_configured", "UNAVAILABLE"),
                                          ("internal", "INTERNAL"), ("upstream_error", "INTERNAL")])
def test_one_mapping_from_failure_reasons_to_codes(pb, reason, code):
    from triton_pipelines.stub.responses import response_error

    assert response_error(reason, "m").code() == code


def test_model_args():
    from triton_pipelines.stub.model_args import model_parameters, version_dir

    args = {"model_config": json.dumps({"parameters": {"a": {"string_value": "1"}}}),
            "model_repository": "/models/m", "model_version": "3"}
    assert model_parameters(args) == {"a": "1"}
    assert version_dir(args) == Path("/models/m/3")


# --- the embedded target's compute models (onnx_runner.EmbeddedComputeModel) --------------------


class FakeRunner:
    output_names = ["y", "z"]

    def __init__(self, fail=False):
        self.calls, self.fail, self.asked = [], fail, []

    def run(self, requests, output_names=None):
        self.calls.append(len(requests))
        self.asked.append(list(output_names or self.output_names))
        if self.fail:
            raise RuntimeError("out of memory")
        outputs = {"y": lambda r: r["x"] + 1, "z": lambda r: r["x"] * 0}
        return [{name: outputs[name](request) for name in self.asked[-1]} for request in requests]


def test_compute_model_batches_plain_requests_and_runs_cached_ones_alone():
    runner = FakeRunner()
    model = EmbeddedComputeModel("m", runner, ["x", "k"], InputCache(["k"]))
    plain = model.feeds({"x": np.ones(1), "k": np.zeros(1)}, {})
    keyed = model.feeds({"x": np.ones(1), "k": np.zeros(1)}, {"input_cache_key": "c"})
    named = model.feeds({"x": np.ones(1)}, {"input_cache_key": "c"})
    assert (plain[1], keyed[1], named[1]) == (None, "c", "c") and "k" in named[0]
    results = model.run([plain, keyed, plain, named])
    assert runner.calls == [2, 1, 1] and all(r["y"].tolist() == [2.0] for r in results)


def test_compute_model_computes_and_answers_only_the_requested_outputs():
    """Triton's requested_output_names: a run computes the union of its requests' outputs and each
    request gets only its own (an ensemble step asking for ``embedding`` is not sent the token states)."""
    runner = FakeRunner()
    model = EmbeddedComputeModel("m", runner, ["x"])
    work = model.feeds({"x": np.ones(1)}, {})
    results = model.run([work, work, work], [["y"], ["y"], []])
    assert runner.asked == [["y", "z"]] and [sorted(r) for r in results] == [["y"], ["y"], ["y", "z"]]
    runner.asked.clear()
    assert [list(r) for r in model.run([work, work], [["z"], ["z"]])] == [["z"], ["z"]] and runner.asked == [["z"]]


def test_compute_model_keeps_a_keyed_callers_state_and_sends_it_only_when_asked():
    """state_inputs: a keyed run computes the state output (here z for input s) whether or not the
    request asks for it, keeps it as the key's next s, and answers only what was asked."""
    runner = FakeRunner()
    model = EmbeddedComputeModel("m", runner, ["x", "s"], InputCache([], states={"s": "z"}))
    first = model.feeds({"x": np.ones(2), "s": np.full(2, 5.0)}, {"input_cache_key": "c"})
    assert [sorted(r) for r in model.run([first], [["y"]])] == [["y"]] and runner.asked == [["y", "z"]]
    later = model.feeds({"x": np.ones(1)}, {"input_cache_key": "c", "input_cache_rows": "1"})
    assert later[0]["s"].tolist() == [0.0]  # z of the previous run (x * 0), row 1
    plain = model.feeds({"x": np.ones(1), "s": np.ones(1)}, {})
    model.run([plain], [["y"]])
    assert runner.asked[-1] == ["y"]  # without a key nothing is kept
    with pytest.raises(InputError, match=r"missing inputs \['s'\]"):
        model.feeds({"x": np.ones(1)}, {})


def test_compute_model_refuses_missing_inputs_and_fails_only_the_failed_run():
    model = EmbeddedComputeModel("m", FakeRunner(fail=True), ["x", "k"], InputCache(["k"]))
    with pytest.raises(InputError, match=r"m: missing inputs \['k'\] \(or an input_cache_key naming them\)"):
        model.feeds({"x": np.ones(1)}, {})
    results = model.run([({"x": np.ones(1), "k": np.ones(1)}, None)])
    assert isinstance(results[0], RuntimeError) and str(results[0]) == "m: ONNX Runtime failed: out of memory"


# --- adapters over the built repository ---------------------------------------------------------


def test_text_tokenizer_adapter_tokenizes_and_refuses_bad_utf8(pb):
    from triton_pipelines.pipelines.text import TextTokenizer

    model = initialized(ROOT / "python_models" / "text_tokenizer" / "model.py", "text_tokenizer")
    texts = np.array([[b"Where is my parcel?"]], dtype=object)
    good, bad = model.execute([pb.Request({"text": texts}), pb.Request({"text": np.array([[b"caf\xe9"]], dtype=object)})])
    expected = TextTokenizer.served(REPOSITORY / "text_tokenizer").encode(["Where is my parcel?"])
    np.testing.assert_array_equal(outputs(good)["input_ids"], expected.input_ids)
    assert bad.error().message() == INPUT_ERROR_PREFIX + "input 'text'[0] is not valid UTF-8 (byte 0xe9 at offset 3)"


@pytest.mark.slow
def test_whisper_decode_adapter_gives_the_in_process_tokens_across_decoder_instances(pb):
    """audio_features → whisper_decode, whose BLS calls reach the embedded runner template for
    whisper_encoder and two whisper_decoder instances taking turns: each holds the cross K/V cache
    of its own, so steps miss it and send the windows again. Tokens equal the in-process reference."""
    from triton_pipelines.pipelines.speech.reference import WhisperOnnx
    from triton_pipelines.pipelines.speech.tokenizer import WhisperTokenizer

    features_model = initialized(ROOT / "python_models" / "audio_features" / "model.py", "audio_features")
    decode_model = initialized(ROOT / "python_models" / "whisper_decode" / "model.py", "whisper_decode")
    pb.MODELS["whisper_encoder"] = initialized(ONNX_RUNNER_TEMPLATE, "whisper_encoder")
    decoders = itertools.cycle([initialized(ONNX_RUNNER_TEMPLATE, "whisper_decoder", i) for i in range(2)])
    pb.MODELS["whisper_decoder"] = lambda: next(decoders)

    wav = (ROOT / "tests" / "data" / "speech_hello.wav").read_bytes()
    (features,) = features_model.execute([pb.Request({"audio": np.array([[wav]], dtype=object)})])
    features = outputs(features)
    (answer,) = decode_model.execute([pb.Request({**features, "max_new_tokens": np.array([[24]], np.int32)})])
    served = outputs(answer)

    tokenizer = WhisperTokenizer(REPOSITORY / "whisper_decode" / "1" / "multilingual.tiktoken")
    reference = WhisperOnnx(REPOSITORY / "whisper_encoder" / "1" / "model.onnx",
                            REPOSITORY / "whisper_decoder" / "1" / "model.onnx", intra_op_threads=2)
    windows = features["input_features"][0, :int(features["num_windows"][0, 0])]
    expected = reference.decode_windows(windows, np.array([tokenizer.prompt()] * len(windows)), tokenizer, 24)
    tokens = [t for t in served["token_ids"][0].tolist() if t >= 0]
    assert tokens == [t for window in expected for t in window] and len(tokens) > 3
    assert served["transcript"][0, 0].decode().startswith("Hello")


@pytest.mark.slow
def test_whisper_decode_stops_a_request_whose_client_has_gone_and_answers_its_neighbour(pb):
    """One batch, two requests: the first one's client has gone (cancelled, or past the deadline the
    screen forwards); it is answered CANCELLED (its window leaves the batch after the first step),
    the other one gets its transcript."""
    import time

    from triton_pipelines.limits import CLIENT_DEADLINE_PARAMETER

    features_model = initialized(ROOT / "python_models" / "audio_features" / "model.py", "audio_features")
    decode_model = initialized(ROOT / "python_models" / "whisper_decode" / "model.py", "whisper_decode")
    pb.MODELS["whisper_encoder"] = initialized(ONNX_RUNNER_TEMPLATE, "whisper_encoder")
    decoder = initialized(ONNX_RUNNER_TEMPLATE, "whisper_decoder")
    calls = []
    pb.MODELS["whisper_decoder"] = lambda: calls.append(1) or decoder
    wav = (ROOT / "tests" / "data" / "speech_hello.wav").read_bytes()
    (features,) = features_model.execute([pb.Request({"audio": np.array([[wav]], dtype=object)})])
    inputs = {**outputs(features), "max_new_tokens": np.array([[24]], np.int32)}
    past = {CLIENT_DEADLINE_PARAMETER: str(time.time_ns() - 1)}
    cancelled = pb.Request(inputs)
    cancelled.cancelled = True
    for gone in (cancelled, pb.Request(inputs, parameters=past)):
        calls.clear()
        left, served = decode_model.execute([gone, pb.Request(inputs)])
        assert left.has_error() and left.error().code() == pb.TritonError.CANCELLED
        assert "client has gone" in left.error().message()
        assert outputs(served)["transcript"][0, 0].decode().startswith("Hello") and 3 < len(calls) <= 24


def test_only_the_stub_package_imports_triton():
    """The package docstring's promise: outside ``triton_pipelines.stub`` nothing imports Triton's
    stub module, so all of it runs (and is tested) without a server."""
    package = ROOT / "src" / "triton_pipelines"
    importers = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                       if "import triton_python_backend_utils" in path.read_text())
    assert importers and all(name.startswith("stub/") for name in importers), importers


@pytest.mark.slow
def test_the_streaming_speech_adapter_sends_partials_then_the_whisper_decode_transcript(pb):
    """speech_recognition_stream (decoupled) against the embedded runners: partial responses whose
    deltas add up to the final transcript, one final response flagged final, a bad clip answered
    alone; the transcript equals whisper_decode's for the same audio."""
    import json as json_module

    stream = initialized(ROOT / "python_models" / "speech_recognition_stream" / "model.py", "speech_recognition_stream")
    features_model = initialized(ROOT / "python_models" / "audio_features" / "model.py", "audio_features")
    decode_model = initialized(ROOT / "python_models" / "whisper_decode" / "model.py", "whisper_decode")
    pb.MODELS["whisper_encoder"] = initialized(ONNX_RUNNER_TEMPLATE, "whisper_encoder")
    pb.MODELS["whisper_decoder"] = initialized(ONNX_RUNNER_TEMPLATE, "whisper_decoder")
    wav = (ROOT / "tests" / "data" / "speech_hello.wav").read_bytes()
    good = pb.Request({"audio": np.array([[wav]], dtype=object)})
    bad = pb.Request({"audio": np.array([[b"not audio"]], dtype=object)})
    assert stream.execute([good, bad]) is None
    (error, flags), = bad.get_response_sender().sent
    assert flags == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and "not a decodable audio file" in error.error().message()
    sent = good.get_response_sender().sent
    assert [flags for _, flags in sent] == [0] * (len(sent) - 1) + [pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL]
    values = [outputs(response) for response, _ in sent]
    assert all(not v["is_final"][0, 0] for v in values[:-1]) and values[-1]["is_final"][0, 0]
    text = values[-1]["transcript"][0, 0].decode()
    assert "".join(v["delta"][0, 0].decode() for v in values) == text and len(values) > 5
    assert json_module.loads(values[-1]["segments"][0, 0])[0]["text"] == text

    (features,) = features_model.execute([pb.Request({"audio": np.array([[wav]], dtype=object)})])
    (answer,) = decode_model.execute([pb.Request(outputs(features))])
    assert outputs(answer)["transcript"][0, 0].decode() == text
