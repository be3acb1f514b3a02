"""The OpenAI-compatible surface (issue 23) through the public HTTP port, with the unmodified
``openai`` client: models, embeddings (equal to native text_embedding, one Triton request per 64
strings, real token counts), transcriptions and translations in every format and streamed (SSE from
the decoupled ``speech_recognition_stream``), chat against the loopback fake gateway with cost,
keys, and the same streaming pipeline on the public gRPC port (``start_stream``); hostile input
(the end of the module): clean OpenAI errors, neighbours served, the server alive; a client that
leaves a stream stops its decode; a killed frontend is restarted.

One server for the module, with only the models these tests use (text embedding, the Whisper models
and the streaming model), ``TRITON_API_KEYS_FILE`` set and the gateway variables pointing at the
fake gateway."""

from __future__ import annotations

import base64
import json
import os
import queue
import time
import urllib.request

import numpy as np
import pytest

from triton_pipelines.client import TritonClient, text_tensor
from triton_pipelines.server.launcher import start_on_free_ports

from tests.conftest import LOG_DIR, ensure_repository, gateway_environment, statistics_after
from tests.support.fake_gateway import Reply
from tests.support.paths import PROJECT_ROOT, TEST_DATA

openai = pytest.importorskip("openai")

MODELS = ["text_tokenizer", "text_encoder", "text_embedding", "whisper_encoder",
          "whisper_decoder", "speech_recognition_stream"]
KEY = "sk-test-team-a-0123456789"
OTHER_KEY = "sk-test-team-b-0123456789"
GATEWAY_KEY = "gateway-secret-key-xyz"
HELLO = TEST_DATA / "speech_hello.wav"
HELLO_TEXT = "Hello World! This is a test on the speech recognition pipeline."


@pytest.fixture(scope="module")
def server(fake, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(f'keys:\n  - {{key: "{KEY}", name: team-a}}\n'
                    f'  - {{key: "{OTHER_KEY}", name: team-b, models: [deepseek-v3.2]}}\n')
    saved = os.environ.get("TRITON_API_KEYS_FILE")
    os.environ["TRITON_API_KEYS_FILE"] = str(keys)
    try:
        with gateway_environment(fake.base_url, GATEWAY_KEY):
            launched = start_on_free_ports(ensure_repository(), LOG_DIR / "test-openai-server.log", models=MODELS,
                                           timeout_s=900)
    finally:
        if saved is None:
            os.environ.pop("TRITON_API_KEYS_FILE", None)
        else:
            os.environ["TRITON_API_KEYS_FILE"] = saved
    yield launched
    launched.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key=KEY, max_retries=0, timeout=300)


def post(server, path: str, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(f"http://{server.http_url}{path}", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


# ------------------------------------------------------------------------------------ models, keys
def test_models_lists_pipelines_and_gateway_models_with_their_owner(client):
    models = {m.id: m.owned_by for m in client.models.list()}
    assert {"text_embedding", "speech_recognition", "whisper-1"} <= set(models)
    assert models["text_embedding"] == "self-hosted" and models["gpt-4.1"] == "gateway"
    assert client.models.retrieve("deepseek-v3.2").owned_by == "gateway"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_a_self_hosted_model_carries_the_provenance_of_its_compute_models(client):
    from triton_pipelines.repository.contract import BuiltManifest

    rows = {row["model"]: row for row in BuiltManifest.read(ensure_repository()).model_table}
    entry = client.models.retrieve("text_embedding").to_dict()
    assert {"id", "object", "created", "owned_by"} <= set(entry)
    served = {item["model"]: item for item in entry["provenance"]}
    assert served["text_encoder"]["source"] == rows["text_encoder"]["source"]
    assert served["text_encoder"]["files"] == rows["text_encoder"]["files"] and not served["text_encoder"]["random"]
    assert "provenance" not in client.models.retrieve("gpt-4.1").to_dict()


@pytest.mark.parametrize("key", [None, "wrong-key-0123456789", KEY[:-1]])
def test_a_missing_or_unknown_key_is_401_and_never_echoed(server, key):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    status, _, body = post(server, "/v1/embeddings", b'{"model":"text_embedding","input":"x"}', headers)
    assert status == 401
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_api_key" and (key is None or key not in body.decode())
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="nope-nope-nope-nope",
                      max_retries=0).models.list()


# ------------------------------------------------------------------------------------ embeddings
def test_embeddings_equal_the_native_pipeline_and_count_real_tokens(client, server):
    texts = ["How do I reset my password?", "Where is my parcel?", "", "héllo wörld " * 50]
    response = client.embeddings.create(model="text_embedding", input=texts)
    got = np.array([d.embedding for d in response.data], dtype=np.float32)
    native = TritonClient("grpc", server.internal_url("grpc"))
    try:
        expected = native.infer("text_embedding", {"text": text_tensor(texts)})["embedding"]
    finally:
        native.close()
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.9999
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(server.options.model_repository / "text_tokenizer" / "1" / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(256)
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(t).ids) for t in texts)
    assert response.usage.prompt_tokens < len(texts) * 128  # real tokens, not the padded bucket
    # (the openai client asks for base64 by default and decodes it; asked for explicitly, it is the string)
    single = client.embeddings.create(model="text_embedding", input=texts[0], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(single.data[0].embedding), dtype="<f4")
    assert np.allclose(decoded, expected[0], atol=1e-6)
    floats = client.embeddings.create(model="text_embedding", input=texts[0], encoding_format="float")
    assert np.allclose(np.array(floats.data[0].embedding, np.float32), expected[0], atol=1e-6)


def test_the_embedding_requests_raw_grpc_form_is_tritonclients():
    """/v1/embeddings builds its ModelInferRequest itself (no tritonclient wrappers): the BYTES
    tensor in raw_input_contents as tritonclient serializes it, the FP32 output read from
    raw_output_contents; anything else is a clean 500, not a wrong vector."""
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import serialize_byte_tensor

    from triton_pipelines.openai_api import protocol as proto
    from triton_pipelines.openai_api.triton_grpc import bytes_request, fp32_output

    texts = ["How do I reset my password?".encode(), b"", "héllo".encode(), b"x" * 70_000]
    request = bytes_request(service_pb2, "text_embedding", "text", texts, "embedding")
    assert request.model_name == "text_embedding" and [o.name for o in request.outputs] == ["embedding"]
    tensor = request.inputs[0]
    assert (tensor.name, tensor.datatype, list(tensor.shape)) == ("text", "BYTES", [4, 1])
    expected = serialize_byte_tensor(np.array(texts, dtype=np.object_).reshape(-1, 1))
    assert request.raw_input_contents == [expected.item()]  # as InferInput.set_data_from_numpy keeps it

    vectors = np.random.default_rng(0).standard_normal((2, 384)).astype(np.float32)
    response = service_pb2.ModelInferResponse(model_name="text_embedding")
    response.outputs.add(name="other", datatype="BYTES", shape=[2, 1])
    response.outputs.add(name="embedding", datatype="FP32", shape=[2, 384])
    response.raw_output_contents.extend([b"\0" * 8, vectors.tobytes()])
    assert np.array_equal(fp32_output(response, "embedding"), vectors)
    for name in ("other", "missing"):
        with pytest.raises(proto.OpenAIError) as caught:
            fp32_output(response, name)
        assert caught.value.status == 500


def test_binary_http_answers_are_read_by_offset_and_checked():
    from triton_pipelines.openai_api import protocol as proto
    from triton_pipelines.openai_api.triton_http import http_fp32_output

    vectors = np.arange(6, dtype=np.float32).reshape(2, 3)
    header = json.dumps({"outputs": [{"name": "other", "datatype": "BYTES", "shape": [1],
                                      "parameters": {"binary_data_size": 5}},
                                     {"name": "embedding", "datatype": "FP32", "shape": [2, 3],
                                      "parameters": {"binary_data_size": 24}}]}).encode()
    headers = [(b"inference-header-content-length", str(len(header)).encode())]
    body = header + b"12345" + vectors.tobytes()
    assert np.array_equal(http_fp32_output(headers, body, "embedding"), vectors)
    for name, answer in (("other", body), ("missing", body), ("embedding", body[:-4]), ("embedding", b"{")):
        with pytest.raises(proto.OpenAIError) as caught:
            http_fp32_output(headers if answer is body else [], answer, name)
        assert caught.value.status == 500


def start_frontend(extra: list[str], env: dict | None = None):
    """The frontend alone on a free port (no nginx, no keys); (process, base URL) once it answers."""
    import subprocess
    import sys

    from triton_pipelines.server.processes import free_ports

    port = free_ports(1)[0]
    env = env if env is not None else {k: v for k, v in os.environ.items() if k != "TRITON_API_KEYS_FILE"}
    process = subprocess.Popen([sys.executable, "-m", "triton_pipelines", "frontend", f"--port={port}",
                                f"--model-repository={ensure_repository()}", *extra], env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return process, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise AssertionError(f"the frontend did not start: {process.stderr.read()[-2000:]!r}")
            time.sleep(0.2)


def test_embeddings_over_triton_http_equal_the_grpc_path(server):
    """--triton-http (each replica's loopback HTTP port): /v1/embeddings over HTTP gives the gRPC
    path's answer byte for byte, errors included; a dead replica is skipped."""
    grpc_address = server.internal_url("grpc").removeprefix("http://")
    http_address = server.internal_url("http").removeprefix("http://")
    dead = "127.0.0.1:1"
    over_grpc, grpc_url = start_frontend([f"--triton-grpc={grpc_address}"])
    over_http, http_url = start_frontend([f"--triton-grpc={grpc_address}", f"--triton-grpc={grpc_address}",
                                          f"--triton-http={dead}", f"--triton-http={http_address}"])
    try:
        bodies = [{"model": "text_embedding", "input": ["How do I reset my password?", "", "héllo " * 40]},
                  {"model": "text_embedding", "input": "x", "encoding_format": "base64"},
                  {"model": "text_embedding", "input": [f"text {i}" for i in range(130)]},
                  {"model": "text_embedding", "input": "x" * 70_000}, {"model": "nope", "input": "x"}]
        for body in bodies:
            answers = []
            for url in (grpc_url, http_url, http_url):  # the dead replica first or second
                request = urllib.request.Request(f"{url}/v1/embeddings", data=json.dumps(body).encode(),
                                                 headers={"Content-Type": "application/json"}, method="POST")
                try:
                    with urllib.request.urlopen(request, timeout=60) as response:
                        answers.append((response.status, response.read()))
                except urllib.error.HTTPError as error:
                    answers.append((error.code, error.read()))
            assert answers[0] == answers[1] == answers[2], [(s, b[:200]) for s, b in answers]
    finally:
        for process in (over_grpc, over_http):
            process.terminate()
            process.wait(timeout=30)
    # every replica unreachable: 503 in OpenAI's shape
    nobody, url = start_frontend([f"--triton-grpc={dead}", f"--triton-http={dead}"])
    try:
        request = urllib.request.Request(f"{url}/v1/embeddings", data=b'{"model":"text_embedding","input":"x"}',
                                         headers={"Content-Type": "application/json"}, method="POST")
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        assert caught.value.code == 503 and json.loads(caught.value.read())["error"]["code"] == "service_unavailable"
    finally:
        nobody.terminate()
        nobody.wait(timeout=30)


def test_a_list_of_64_strings_is_one_triton_request_and_130_are_three(client, server):
    internal = TritonClient("http", server.internal_url("http"))
    try:
        for count, requests in ((64, 1), (130, 3)):
            before = internal.statistics("text_embedding")["model_stats"][0]
            # texts never sent before: a repeated request is answered by the response cache
            nonce = os.urandom(6).hex()
            response = client.embeddings.create(model="text_embedding", input=[f"text {nonce} {i}" for i in range(count)])
            assert [d.index for d in response.data] == list(range(count))
            after = statistics_after(internal, "text_embedding", before, count)
            assert int(after["inference_count"]) - int(before["inference_count"]) == count
            assert int(after["inference_stats"]["success"]["count"]) - \
                int(before["inference_stats"]["success"]["count"]) == requests
    finally:
        internal.close()


# ------------------------------------------------------------------------------------ audio
def speech_onsets(samples: np.ndarray, rate: int, gap_s: float = 0.5) -> list[float]:
    """Where speech starts after a silence of at least ``gap_s`` (samples above -40 dBFS)."""
    loud = np.flatnonzero(np.abs(samples) > 0.01) / rate
    return [float(t) for i, t in enumerate(loud) if i == 0 or t - loud[i - 1] >= gap_s]


def stream_final(server, audio: bytes, **inputs) -> dict:
    """speech_recognition_stream's final response (public gRPC port), without partials."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        tensors = []
        for name, value in {"audio": audio, **inputs}.items():
            tensor = grpcclient.InferInput(name, [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[value]], dtype=object))
            tensors.append(tensor)
        client.async_stream_infer("speech_recognition_stream", tensors, parameters={"partials": False})
        while True:
            result, error = results.get(timeout=300)
            assert error is None, error
            if result.as_numpy("is_final")[0, 0]:
                return {name: result.as_numpy(name)[0, 0] for name in ("transcript", "segments", "detected_language", "duration")}
    finally:
        client.stop_stream()
        client.close()


def test_transcription_in_every_response_format(client, server):
    """json and text without timestamps; verbose_json, srt and vtt with Whisper's segment
    timestamps: the segments and cues are the stream model's (timestamps=segment) for the same
    audio, and the language is detected when none is sent."""
    audio = HELLO.read_bytes()
    assert client.audio.transcriptions.create(model="speech_recognition", file=("a.wav", audio)).text == HELLO_TEXT
    assert client.audio.transcriptions.create(model="whisper-1", file=("a.wav", audio),
                                              response_format="text").strip() == HELLO_TEXT
    expected = json.loads(stream_final(server, audio, timestamps=b"segment")["segments"])
    assert expected and all(s["end"] > s["start"] for s in expected)
    verbose = client.audio.transcriptions.create(model="speech_recognition", file=("a.wav", audio),
                                                 response_format="verbose_json")
    assert verbose.language == "english" and 3.0 < verbose.duration < 5.0
    assert [(s.start, s.end, s.text) for s in verbose.segments] == [(s["start"], s["end"], s["text"]) for s in expected]
    assert " ".join(s.text for s in verbose.segments) == verbose.text
    asked = client.audio.transcriptions.create(model="speech_recognition", file=("a.wav", audio), language="en",
                                               response_format="verbose_json", timestamp_granularities=["segment"])
    assert [(s.start, s.end) for s in asked.segments] == [(s.start, s.end) for s in verbose.segments]

    def cue(seconds: float, separator: str) -> str:
        millis = int(round(seconds * 1000))
        return f"00:00:{millis // 1000:02d}{separator}{millis % 1000:03d}"

    srt = client.audio.transcriptions.create(model="speech_recognition", file=("a.wav", audio), response_format="srt")
    assert srt == "\n".join(f"{i + 1}\n{cue(s['start'], ',')} --> {cue(s['end'], ',')}\n{s['text']}\n"
                            for i, s in enumerate(expected))
    vtt = client.audio.transcriptions.create(model="speech_recognition", file=("a.wav", audio), response_format="vtt")
    assert vtt == "WEBVTT\n\n" + "\n".join(f"{cue(s['start'], '.')} --> {cue(s['end'], '.')}\n{s['text']}\n"
                                             for s in expected)


def test_timestamp_granularities_word_and_segment(client, server):
    """timestamp_granularities[]=word: verbose_json's words are the stream model's (timestamps=word)
    in order within the clip; with segment too, the segments come along; only with verbose_json."""
    audio = HELLO.read_bytes()
    expected = [w for s in json.loads(stream_final(server, audio, timestamps=b"word")["segments"]) for w in s["words"]]
    words = client.audio.transcriptions.create(model="speech_recognition", file=("a.wav", audio),
                                               response_format="verbose_json", timestamp_granularities=["word"])
    assert [(w.word, w.start, w.end) for w in words.words] == [(w["word"].strip(), w["start"], w["end"]) for w in expected]
    assert " ".join(w.word for w in words.words) == words.text and not words.segments
    assert all(0 <= w.start <= w.end <= words.duration for w in words.words)
    both = client.audio.transcriptions.create(model="speech_recognition", file=("a.wav", audio),
                                              response_format="verbose_json", timestamp_granularities=["word", "segment"])
    assert both.words == words.words and both.segments
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.transcriptions.create(model="speech_recognition", file=("a.wav", audio),
                                           timestamp_granularities=["segment"])
    assert "needs response_format verbose_json" in str(caught.value)


def test_a_long_clip_has_segments_that_follow_the_speech(client):
    """~47 s (two windows) of the same sentence 9 times, 1.5 s apart: one segment per repetition,
    in order, in both windows; the duration is the clip's. On this repetitive clip Whisper base's
    timestamps snap to whole seconds (measured: 0, 5, 10, 15, 21, 27.5, ... for onsets 0, 5.3,
    10.6, 16.0, 21.3, 26.6, ...: up to 1.1 s off), so each start is held to 1.2 s of its
    repetition here; test_speech_quality's two distinct sentences are held to 0.3 s."""
    import soundfile

    samples, rate = soundfile.read(str(HELLO), dtype="float32")
    pause = np.zeros(int(rate * 1.5), np.float32)
    long = np.concatenate([np.concatenate([samples, pause])] * 9)  # ~47 s: two windows
    import io

    buffer = io.BytesIO()
    soundfile.write(buffer, long, rate, format="WAV")
    verbose = client.audio.transcriptions.create(model="speech_recognition", file=("long.wav", buffer.getvalue()),
                                                 response_format="verbose_json")
    starts = [s.start for s in verbose.segments]
    print("segments:", [(s.start, s.end, s.text) for s in verbose.segments])
    assert starts == sorted(starts) and all(s.end > s.start for s in verbose.segments)
    onsets = speech_onsets(long, rate, gap_s=1.0)
    assert len(onsets) == 9 and len(starts) == 9
    assert all(abs(start - onset) <= 1.2 for start, onset in zip(starts, onsets)), (onsets, starts)
    assert all(a.end <= b.start for a, b in zip(verbose.segments, verbose.segments[1:]))
    assert abs(verbose.duration - len(long) / rate) < 0.01 and verbose.segments[-1].end <= verbose.duration
    assert verbose.text == " ".join(s.text for s in verbose.segments)


def test_a_pause_between_two_sentences_shows_in_the_verbose_json_segments(client):
    """The clip, 2 s of silence, the clip again: the pause lies between two segments, the second
    starting within 0.3 s of where its speech starts."""
    import io

    import soundfile

    samples, rate = soundfile.read(str(HELLO), dtype="float32")
    joined = np.concatenate([samples, np.zeros(2 * rate, np.float32), samples])
    buffer = io.BytesIO()
    soundfile.write(buffer, joined, rate, format="WAV")
    verbose = client.audio.transcriptions.create(model="speech_recognition", file=("pause.wav", buffer.getvalue()),
                                                 response_format="verbose_json")
    onsets = speech_onsets(joined, rate, gap_s=1.5)
    assert len(onsets) == 2
    after = [s for s in verbose.segments if s.start >= onsets[1] - 0.3]
    before = [s for s in verbose.segments if s.start < onsets[1] - 0.3]
    assert after and before and abs(after[0].start - onsets[1]) <= 0.3
    assert after[0].start - before[-1].end >= 1.4, verbose.segments


def test_noise_gives_no_words_by_default_and_vad_filter_is_a_form_field(client):
    """VAD by default (mode windows): 4 s of noise is an empty transcript; the form field vad_filter
    (speaches' name; the openai client sends it through extra_body) false turns VAD off, and Whisper
    base then says something about the noise; true (pack) is empty again."""
    import io

    import soundfile

    noise = (0.05 * np.random.default_rng(11).standard_normal(4 * 16000)).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, noise, 16000, format="WAV")
    texts = [client.audio.transcriptions.create(model="speech_recognition", file=("noise.wav", buffer.getvalue()),
                                                **({"extra_body": {"vad_filter": value}} if value else {})).text
             for value in (None, "false", "true")]
    assert texts[0] == "" and texts[1].strip() != "" and texts[2] == "", texts
    verbose = client.audio.transcriptions.create(model="speech_recognition", file=("noise.wav", buffer.getvalue()),
                                                 response_format="verbose_json")
    assert verbose.text == "" and verbose.segments == [] and abs(verbose.duration - 4.0) < 0.01  # the clip's
    with pytest.raises(openai.BadRequestError, match="vad_filter"):
        client.audio.transcriptions.create(model="speech_recognition", file=("noise.wav", buffer.getvalue()),
                                           extra_body={"vad_filter": "maybe"})


def test_translation(client):
    result = client.audio.translations.create(model="speech_recognition", file=("a.wav", HELLO.read_bytes()))
    assert "speech recognition" in result.text.lower()


def test_streamed_transcription_sends_deltas_as_tokens_are_decoded_then_done(client, server):
    started = time.monotonic()
    events = []
    stream = client.audio.transcriptions.create(model="speech_recognition", file=("a.wav", HELLO.read_bytes()),
                                                stream=True)
    for event in stream:
        events.append((time.monotonic() - started, event))
    deltas = [e for _, e in events if e.type == "transcript.text.delta"]
    done = [e for _, e in events if e.type == "transcript.text.done"]
    assert len(deltas) >= 5 and len(done) == 1 and events[-1][1].type == "transcript.text.done"
    assert "".join(d.delta for d in deltas) == done[0].text == HELLO_TEXT
    # the deltas arrive over time, not all at the end
    assert events[-1][0] - events[0][0] > 0.05
    metrics = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    assert 'openai_streamed_responses_total{endpoint="/v1/audio/transcriptions",model="speech_recognition"}' in metrics


def test_the_streaming_pipeline_on_the_public_grpc_port(server):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        audio = grpcclient.InferInput("audio", [1, 1], "BYTES")
        audio.set_data_from_numpy(np.array([[HELLO.read_bytes()]], dtype=object))
        client.async_stream_infer("speech_recognition_stream", [audio])
        partials, final = [], None
        while final is None:
            result, error = results.get(timeout=120)
            assert error is None, error
            if result.as_numpy("is_final")[0, 0]:
                final = result
            else:
                partials.append(result.as_numpy("delta")[0, 0].decode())
        assert len(partials) >= 5 and "".join(partials) == final.as_numpy("transcript")[0, 0].decode() == HELLO_TEXT
        segments = json.loads(final.as_numpy("segments")[0, 0])
        assert segments[0]["start"] == 0.0 and segments[0]["text"] == HELLO_TEXT  # no timestamps: the window
        assert final.as_numpy("detected_language")[0, 0].decode() == "en"  # detected
        # an internal model is refused on the stream as on ModelInfer
        ids = grpcclient.InferInput("input_ids", [1, 1], "INT64")
        ids.set_data_from_numpy(np.array([[1]], dtype=np.int64))
        client.async_stream_infer("whisper_decoder", [ids])
        result, error = results.get(timeout=30)
        assert result is None and error is not None
        assert "unknown model 'whisper_decoder'" in str(error)
        # the refusal answered that request only: the same stream still transcribes
        client.async_stream_infer("speech_recognition_stream", [audio])
        while True:
            result, error = results.get(timeout=120)
            assert error is None, error
            if result.as_numpy("is_final")[0, 0]:
                break
        assert result.as_numpy("transcript")[0, 0].decode() == HELLO_TEXT
    finally:
        client.stop_stream()
        client.close()


# ------------------------------------------------------------------------------------ chat
@pytest.fixture
def gateway(fake):
    fake.reset()
    yield fake
    fake.reset()


def test_chat_completion_through_the_gateway_with_exact_cost(client, gateway):
    gateway.script(Reply(content="hello back", prompt_tokens=1000, completion_tokens=500))
    raw = client.chat.completions.with_raw_response.create(model="claude-sonnet-4.5",
                                                           messages=[{"role": "user", "content": "hi"}])
    completion = raw.parse()
    assert completion.choices[0].message.content == "hello back"
    # claude-sonnet-4.5: 4.50 $/M input, 15.00 $/M output
    assert completion.usage.model_extra["cost_usd"] == pytest.approx(0.0045 + 0.0075)
    assert float(raw.headers["x-request-cost-usd"]) == pytest.approx(0.012)
    assert raw.headers["x-gateway-model"] == completion.model == "claude-sonnet-4.5"
    assert "x-fallback-from" not in raw.headers and completion.model_extra["x_gateway"]["fallback_from"] is None
    sent = gateway.requests[-1]
    assert sent.body["model"] == "claude-sonnet-4.5" and sent.headers["authorization"] == f"Bearer {GATEWAY_KEY}"
    assert KEY not in json.dumps(sent.headers)  # the client's key never goes upstream


def test_streamed_chat_completion_with_usage_in_the_final_chunk(client, gateway):
    gateway.script(Reply(content="streamed answer", prompt_tokens=10, completion_tokens=20))
    chunks = list(client.chat.completions.create(model="deepseek-v3.2", messages=[{"role": "user", "content": "x"}],
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "streamed answer"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 2  # the gateway's own chunks
    assert chunks[-1].usage.total_tokens == 30
    assert chunks[-1].usage.model_extra["cost_usd"] == pytest.approx((10 * 0.42 + 20 * 1.68) / 1e6)
    sent = gateway.requests[-1].body
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    # without include_usage the client gets no usage chunk (the cost is still known upstream)
    gateway.script(Reply(content="a b c", prompt_tokens=1, completion_tokens=3))
    chunks = list(client.chat.completions.create(model="deepseek-v3.2", messages=[{"role": "user", "content": "x"}],
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "a b c"
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason == "stop"


def test_chat_errors(client, server, gateway):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="text_embedding", messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["param"] == "model"
    # a key limited to deepseek-v3.2 does not reach gpt-4.1 (GatewayService: 403, as on the router)
    limited = openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as caught:
        limited.chat.completions.create(model="gpt-4.1", messages=[{"role": "user", "content": "x"}])
    assert caught.value.code == "model_not_allowed" and OTHER_KEY not in str(caught.value.body)
    gateway.default = Reply(status=500)  # every model: the fallbacks fail too
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="gemini-2.5-flash", messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 502 and GATEWAY_KEY not in str(caught.value.body)
    assert "models tried: gemini-2.5-flash: upstream_error, gpt-4.1" in caught.value.message


def test_metrics_by_endpoint_and_model_never_show_a_key(client, server):
    client.embeddings.create(model="text_embedding", input="metrics")
    metrics = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    assert 'openai_requests_total{endpoint="/v1/embeddings",model="text_embedding",code="200"}' in metrics
    assert 'openai_request_duration_seconds_bucket{endpoint="/v1/embeddings",model="text_embedding",le="+Inf"}' \
        in metrics
    assert "launcher_openai_frontend_restarts_total 0" in metrics
    assert KEY not in metrics and OTHER_KEY not in metrics  # key names only as the spend metrics' key_name
    assert all('key_name="team-' in line for line in metrics.splitlines() if "team-" in line)
    assert base64.b64encode(KEY.encode()).decode() not in metrics


# ------------------------------------------------------------------------------------ hostile input
def multipart(parts: list[tuple[str, str | None, bytes]], boundary: str = "XyZ") -> tuple[bytes, dict]:
    chunks = []
    for name, filename, value in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        chunks.append(f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n")
    body = b"".join(chunks) + f"--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}", "Authorization": f"Bearer {KEY}"}


MODEL_PART = ("model", None, b"speech_recognition")


def assert_openai_error(status: int, body: bytes, expected_status: int, param: str | None = "any") -> dict:
    assert status == expected_status, (status, body[:300])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param != "any":
        assert error["param"] == param, error
    return error


def neighbour_is_served(client):
    assert len(client.embeddings.create(model="text_embedding", input="still here").data) == 1


@pytest.mark.parametrize("case", ["1000 parts", "no file", "empty file", "1 MB filename", "json body",
                                  "text body", "no boundary", "truncated multipart", "file twice",
                                  "binary field", "100 KB field", "garbage audio"])
def test_hostile_audio_requests_get_clean_errors(server, client, case):
    audio = HELLO.read_bytes()
    auth = {"Authorization": f"Bearer {KEY}"}
    if case == "1000 parts":
        body, headers = multipart([MODEL_PART] + [(f"x{i}", None, b"1") for i in range(1000)] + [("file", "a.wav", audio)])
        expected, param = 400, None
    elif case == "no file":
        body, headers = multipart([MODEL_PART])
        expected, param = 400, "file"
    elif case == "empty file":
        body, headers = multipart([MODEL_PART, ("file", "a.wav", b"")])
        expected, param = 400, "file"
    elif case == "1 MB filename":
        body, headers = multipart([MODEL_PART, ("file", "a" * 2**20, audio)])
        expected, param = 400, "file"
    elif case == "json body":
        body, headers = json.dumps({"model": "speech_recognition", "file": "x"}).encode(), {
            **auth, "Content-Type": "application/json"}
        expected, param = 400, None
    elif case == "text body":
        body, headers = b"hello", {**auth, "Content-Type": "text/plain"}
        expected, param = 400, None
    elif case == "no boundary":
        body, headers = b"--x\r\n", {**auth, "Content-Type": "multipart/form-data"}
        expected, param = 400, None
    elif case == "truncated multipart":
        body, headers = multipart([MODEL_PART, ("file", "a.wav", audio)])
        body = body[:len(body) // 2]
        expected, param = 400, "any"
    elif case == "file twice":
        body, headers = multipart([MODEL_PART, ("file", "a.wav", audio), ("file", "b.wav", audio)])
        expected, param = 400, "file"
    elif case == "binary field":
        body, headers = multipart([("model", None, b"\xff\xfe"), ("file", "a.wav", audio)])
        expected, param = 400, "model"
    elif case == "100 KB field":
        body, headers = multipart([MODEL_PART, ("prompt", None, b"p" * 100_000), ("file", "a.wav", audio)])
        expected, param = 400, "prompt"
    else:  # garbage audio
        body, headers = multipart([MODEL_PART, ("file", "a.wav", b"RIFF" + os.urandom(5000))])
        expected, param = 400, "file"
    status, _, answer = post(server, "/v1/audio/transcriptions", body, headers)
    assert_openai_error(status, answer, expected, param)
    neighbour_is_served(client)


def test_a_100_mb_file_is_413_in_openais_shape(server, client):
    body, headers = multipart([MODEL_PART, ("file", "big.wav", b"\0" * (100 * 2**20))])
    status, _, answer = post(server, "/v1/audio/transcriptions", body, headers)
    error = assert_openai_error(status, answer, 413)
    assert error["code"] == "request_too_large"
    # just under the front's body limit but over the audio limit: refused by the frontend itself
    body, headers = multipart([MODEL_PART, ("file", "big.wav", b"\0" * (64 * 2**20 - 4096))])
    status, _, answer = post(server, "/v1/audio/transcriptions", body, headers)
    assert status in (400, 413), answer[:200]  # 400: the audio decoder's refusal of a non-audio file
    neighbour_is_served(client)


@pytest.mark.parametrize("payload, status, param", [
    ({"model": "text_embedding", "input": ["x"] * 10_000}, 400, "input"),
    ({"model": "text_embedding", "input": [["a", ["b"]]]}, 400, "input"),
    ({"model": "text_embedding", "input": [[1, 2], [3]]}, 400, "input"),
    ({"model": "unknown-model", "input": "x"}, 404, "model"),
    ({"model": "text_embedding", "input": "x" * 70_000}, 400, "input"),
    ({"model": "text_embedding", "input": None}, 400, "input"),
])
def test_hostile_embeddings_requests_get_clean_errors(server, client, payload, status, param):
    got, _, answer = post(server, "/v1/embeddings", json.dumps(payload).encode(),
                          {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    assert_openai_error(got, answer, status, param)
    neighbour_is_served(client)


@pytest.mark.parametrize("body", [b"[" * 200_000, b"{" + b'"a":1,' * 300_000 + b'"a":2}', b"\x00" * 1000, b""])
def test_hostile_json_bodies(server, client, body):
    status, _, answer = post(server, "/v1/embeddings", body,
                             {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    assert_openai_error(status, answer, 400)
    neighbour_is_served(client)


def test_a_client_that_leaves_a_stream_stops_its_decode(server, client):
    """A ~25 s clip (one window, ~100 tokens): the client reads the first delta and hangs up; the
    Triton stream is cancelled and the decoder stops within a few steps, the server stays alive."""
    import http.client
    import io

    import soundfile

    samples, rate = soundfile.read(str(HELLO), dtype="float32")
    long = np.concatenate([np.concatenate([samples, np.zeros(int(rate * 0.5), np.float32)])] * 6)
    buffer = io.BytesIO()
    soundfile.write(buffer, long, rate, format="WAV")
    body, headers = multipart([MODEL_PART, ("stream", None, b"true"), ("file", "long.wav", buffer.getvalue())])
    internal = TritonClient("http", server.internal_url("http"))

    def decoder_steps():
        return int(internal.statistics("whisper_decoder")["model_stats"][0]["execution_count"])

    try:
        before = decoder_steps()
        full = client.audio.transcriptions.create(model="speech_recognition", file=("long.wav", buffer.getvalue()))
        time.sleep(0.5)
        whole = decoder_steps() - before
        assert whole > 40 and len(full.text.split()) > 40
        host, port = server.http_url.rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=120)
        before = decoder_steps()
        connection.request("POST", "/v1/audio/transcriptions", body, headers)
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
        assert b"transcript.text.delta" in response.readline()
        connection.sock.close()  # the client leaves mid-stream
        connection.close()
        time.sleep(3)
        cancelled = decoder_steps() - before
        time.sleep(1)
        assert decoder_steps() - before == cancelled  # nothing is still decoding
        assert cancelled < whole / 2, (cancelled, whole)
    finally:
        internal.close()
    metrics = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    assert 'openai_stream_disconnects_total{endpoint="/v1/audio/transcriptions",model="speech_recognition"} 1' \
        in metrics
    neighbour_is_served(client)
    assert client.audio.transcriptions.create(model="speech_recognition", file=("a.wav", HELLO.read_bytes())).text \
        == HELLO_TEXT


def test_a_killed_frontend_is_restarted(server, client):
    old = server.openai.process.pid
    server.openai.process.kill()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            neighbour_is_served(client)
            break
        except (openai.APIStatusError, openai.APIConnectionError):
            time.sleep(0.3)
    neighbour_is_served(client)
    assert server.openai.process.pid != old
    metrics = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    assert "launcher_openai_frontend_restarts_total 1" in metrics
    with urllib.request.urlopen(f"http://{server.http_url}/v1/health", timeout=10) as health:
        assert (health.status, json.loads(health.read())) == (200, {"status": "ok"})  # /v1's own health



# ------------------------------------------------------------------------------------ README
def readme_curl_commands() -> list[str]:
    """The curl lines of the README's OpenAI section, joined across backslash continuations."""
    readme = (PROJECT_ROOT / "README.md").read_text()
    section = readme.split("## OpenAI-compatible API", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    return [line.strip() for line in block.splitlines() if line.strip().startswith("curl ")]


def test_the_readme_curl_examples_work_as_written(server, gateway):
    import shlex
    import subprocess

    commands = readme_curl_commands()
    assert len(commands) >= 5
    root = PROJECT_ROOT
    for command in commands:
        argv = shlex.split(command.replace("localhost:8000", server.http_url))
        argv[1:1] = ["-H", f"Authorization: Bearer {KEY}", "--fail-with-body"]  # the server's keys file
        done = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (command, done.stdout[:500], done.stderr[:500])
        assert '"error"' not in done.stdout and done.stdout.strip(), (command, done.stdout[:300])


def test_concurrent_streams_share_decoder_batches(client, server):
    """Four streamed transcriptions at once: the streaming model decodes them in fewer executions
    than requests (its dynamic batcher puts concurrent streams into one decode loop)."""
    from concurrent.futures import ThreadPoolExecutor

    internal = TritonClient("http", server.internal_url("http"))
    try:
        before = internal.statistics("speech_recognition_stream")["model_stats"][0]

        def transcribe(_):
            stream = client.audio.transcriptions.create(model="speech_recognition", stream=True,
                                                        file=("a.wav", HELLO.read_bytes()))
            return [e for e in stream if e.type == "transcript.text.done"][0].text

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(transcribe, range(4)))
        assert texts == [HELLO_TEXT] * 4
        after = statistics_after(internal, "speech_recognition_stream", before, 4)
        executions = int(after["execution_count"]) - int(before["execution_count"])
        assert int(after["inference_count"]) - int(before["inference_count"]) == 4 and executions < 4
    finally:
        internal.close()


def test_keys_off_the_frontend_is_open_and_a_missing_triton_is_503(tmp_path):
    """The frontend alone, without TRITON_API_KEYS_FILE, against a Triton that is not there."""
    import subprocess
    import sys

    from triton_pipelines.server.processes import free_ports

    port, nobody = free_ports(2)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_API_KEYS_FILE"}
    process = subprocess.Popen([sys.executable, "-m", "triton_pipelines", "frontend", f"--port={port}",
                                f"--triton-grpc=127.0.0.1:{nobody}", f"--model-repository={ensure_repository()}"],
                               env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read())
                break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.2)
        assert {"text_embedding", "gpt-4.1"} <= {m["id"] for m in models["data"]}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/embeddings", method="POST",
                                         data=b'{"model":"text_embedding","input":"x"}',
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        assert caught.value.code == 503 and json.loads(caught.value.read())["error"]["code"] == "service_unavailable"
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_stop_lets_a_stream_in_flight_finish(client, server):
    """Last in the module (it stops the module's server): a streamed transcription in flight when
    the launcher stops ends with its transcript.text.done (nginx closes gracefully, the frontend
    finishes what it has, then the replicas drain)."""
    import threading

    events, first = [], threading.Event()

    def transcribe():
        stream = client.audio.transcriptions.create(model="speech_recognition", stream=True,
                                                    file=("a.wav", HELLO.read_bytes()))
        for event in stream:
            events.append(event)
            first.set()

    worker = threading.Thread(target=transcribe)
    worker.start()
    assert first.wait(120)
    server.stop()
    worker.join(60)
    assert events[-1].type == "transcript.text.done" and events[-1].text == HELLO_TEXT
    assert not server.openai.alive()
