"""The speech pipeline on the real embedded Triton server, over HTTP and gRPC, against an
in-process reference: the same two ONNX files in ONNX Runtime, decoded greedily one utterance at a
time (no batching), and for one case transformers' ``generate`` on the torch model. The reference
windows a clip as audio_features does: with Silero VAD where the request's vad_filter (or the
default) asks for it."""

from __future__ import annotations

import hashlib
import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import soundfile

from triton_pipelines.client import InferenceServerException, TritonClient, text_tensor
from triton_pipelines.pipelines.speech.config import DEFAULT_VAD_MODE, SAMPLE_RATE, VAD_FILTER_MODES
from triton_pipelines.pipelines.speech.features import audio_to_features, load_mel_filters, vad_arguments
from triton_pipelines.pipelines.speech.jobs import join_transcript
from triton_pipelines.pipelines.speech.reference import WhisperOnnx
from triton_pipelines.pipelines.speech.tokenizer import WhisperTokenizer
from triton_pipelines.pipelines.speech.vad import VAD_MODEL_FILE, SileroVad

from tests.conftest import statistics_after
from tests.support.paths import TEST_DATA

DATA = TEST_DATA
HELLO = (DATA / "speech_hello.wav").read_bytes()  # 3.8 s, espeak-ng
MORNING = (DATA / "speech_good_morning.wav").read_bytes()  # 1.1 s
MODEL = "speech_recognition"


def wav_bytes(samples, rate=SAMPLE_RATE, subtype="PCM_16") -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, subtype=subtype, format="WAV")
    return buffer.getvalue()


NOISE = wav_bytes(0.05 * np.random.default_rng(7).standard_normal(4 * SAMPLE_RATE).astype(np.float32))


def int_tensor(values) -> np.ndarray:
    return np.array(values, dtype=np.int32).reshape(-1, 1)


class Reference:
    """Greedy decoding of each item alone, in process, from the files the server loaded."""

    def __init__(self, repository: Path):
        self.repository = repository
        self.whisper = WhisperOnnx(repository / "whisper_encoder" / "1" / "model.onnx",
                                   repository / "whisper_decoder" / "1" / "model.onnx", intra_op_threads=1)
        self.filters = load_mel_filters(repository / "audio_features" / "1" / "mel_filters.npz",
                                        self.whisper.shape.n_mels)
        self.tokenizer = WhisperTokenizer.for_vocab_size(
            repository / "whisper_decode" / "1" / "multilingual.tiktoken", self.whisper.shape.vocab_size)
        self.vad = SileroVad(repository / "audio_features" / "1" / VAD_MODEL_FILE)
        self._encoded: dict[tuple[str, bool | str], list[dict[str, np.ndarray]]] = {}

    def features(self, audio: bytes, vad: bool | str = DEFAULT_VAD_MODE) -> np.ndarray:
        """``vad``: a VAD mode, or a request's vad_filter (true: pack, false: off)."""
        mode = VAD_FILTER_MODES[vad] if isinstance(vad, bool) else vad
        return audio_to_features(audio, self.filters, **vad_arguments(mode, self.vad))

    def encoded(self, audio: bytes, vad: bool | str = DEFAULT_VAD_MODE) -> list[dict[str, np.ndarray]]:
        """Each window's cross K/V, computed once per clip: with real Whisper base the encoder is
        most of a decode, and the tests ask for the same clips with many options."""
        key = (hashlib.sha256(audio).hexdigest(), vad)
        if key not in self._encoded:
            features = self.features(audio, vad)
            self._encoded[key] = [self.whisper.encode(features[i:i + 1]) for i in range(len(features))]
        return self._encoded[key]

    def language(self, audio: bytes, vad: bool | str = DEFAULT_VAD_MODE) -> str:
        """The clip's language as openai-whisper detects it: on its first window."""
        return self.whisper.detect_language(self.encoded(audio, vad)[0], self.tokenizer)[0]

    def windows(self, audio: bytes, language="auto", task="transcribe", max_new_tokens=4,
                vad: bool | str = DEFAULT_VAD_MODE) -> list[list[int]]:
        """Each window alone; ``auto`` (what the server does without a language): the language
        detected on the first window (``language``)."""
        if not self.encoded(audio, vad):
            return []
        language = self.language(audio, vad) if language == "auto" else language
        prompt = np.array([self.tokenizer.prompt(language, task)])
        return [self.whisper.decode_encoded(dict(cross), prompt, self.tokenizer, max_new_tokens)[0]
                for cross in self.encoded(audio, vad)]

    def tokens(self, audio: bytes, **options) -> list[int]:
        return [t for window in self.windows(audio, **options) for t in window]

    def transcript(self, audio: bytes, **options) -> str:
        return join_transcript(self.tokenizer, self.windows(audio, **options))


@pytest.fixture(scope="session")
def reference(triton_server) -> Reference:
    return Reference(Path(triton_server.options.model_repository))


def transcribe(client: TritonClient, audios, max_new_tokens, vad_filter=None, model=MODEL,
               **optional) -> dict[str, np.ndarray]:
    inputs = {"audio": text_tensor(audios), "max_new_tokens": int_tensor(max_new_tokens)}
    if vad_filter is not None:
        inputs["vad_filter"] = np.array(vad_filter, dtype=bool).reshape(-1, 1)
    inputs.update({name: text_tensor(values) for name, values in optional.items()})
    return client.infer(model, inputs)


def ids_of(row: np.ndarray) -> list[int]:
    return [int(t) for t in row if t >= 0]


@pytest.mark.parametrize("vad", [False, True])
def test_batch_of_different_lengths_matches_in_process_greedy_decode(client, reference, vad):
    """With VAD the silent item has no window (an empty transcript next to its neighbours'); without
    it, it is decoded like the reference decodes it."""
    silence = wav_bytes(np.zeros(SAMPLE_RATE // 2, np.float32))
    audios, bounds = [HELLO, MORNING, silence], [6, 4, 3]
    languages = ["en", "de", "fr"]
    out = transcribe(client, audios, bounds, vad_filter=[vad] * 3, language=languages,
                     task=["transcribe", "translate", "transcribe"])
    assert out["token_ids"].dtype == np.int32 and out["transcript"].shape == (3, 1)
    tasks = ["transcribe", "translate", "transcribe"]
    for row, audio, bound, language, task, text in zip(out["token_ids"], audios, bounds, languages, tasks,
                                                        out["transcript"][:, 0]):
        expected = reference.tokens(audio, language=language, task=task, max_new_tokens=bound, vad=vad)
        assert ids_of(row) == expected
        if vad and audio is silence:
            assert expected == [] and text == b""
        else:
            assert 0 < len(expected) <= bound
        assert text.decode() == reference.transcript(audio, language=language, task=task, max_new_tokens=bound,
                                                     vad=vad)


def test_throughput_class_decodes_the_same_tokens(client, reference):
    """speech_recognition_batch (the router's `batch` class: whisper_decode_batch waits for fuller
    decode batches) serves the same weights and greedy loop."""
    inputs = {"audio": text_tensor([HELLO, MORNING]), "max_new_tokens": int_tensor([5, 5])}
    out = client.infer("speech_recognition_batch", inputs)
    assert ids_of(transcribe(client, [NOISE], [5], vad_filter=[True], model="speech_recognition_batch")["token_ids"][0]) == []
    for row, audio in zip(out["token_ids"], (HELLO, MORNING)):
        assert ids_of(row) == reference.tokens(audio, language="en", task="transcribe", max_new_tokens=5)


def test_concurrent_requests_are_decoded_together_and_match(triton_server, http_client, reference):
    """Separate requests land in one whisper_decode batch (fewer executions than requests) with
    different token bounds, so windows leave the batch at different steps."""
    clips = [HELLO, MORNING, wav_bytes(np.random.default_rng(1).standard_normal(SAMPLE_RATE).astype(np.float32) * 0.1)]
    jobs = [(clips[i % 3], 2 + i % 4) for i in range(6)]
    before = http_client.statistics("whisper_decode")["model_stats"][0]
    clients = [TritonClient("grpc", triton_server.grpc_url) for _ in jobs]
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda i: transcribe(clients[i], [jobs[i][0]], [jobs[i][1]]), range(len(jobs))))
    finally:
        for c in clients:
            c.close()
    after = statistics_after(http_client, "whisper_decode", before, len(jobs))
    assert after["inference_count"] - before["inference_count"] == len(jobs)
    assert after["execution_count"] - before["execution_count"] < len(jobs)
    for (audio, bound), out in zip(jobs, results):
        assert ids_of(out["token_ids"][0]) == reference.tokens(audio, max_new_tokens=bound)


def test_audio_longer_than_30_s_is_split_and_joined(client, reference):
    rng = np.random.default_rng(2)
    t = np.arange(int(33.5 * SAMPLE_RATE)) / SAMPLE_RATE
    audio = wav_bytes((0.2 * np.sin(2 * np.pi * 220 * t) + 0.02 * rng.standard_normal(len(t))).astype(np.float32))
    out = transcribe(client, [audio], [3], vad_filter=[False])  # a tone: VAD would find no speech
    windows = reference.windows(audio, max_new_tokens=3, vad=False)
    assert len(windows) == 2
    assert ids_of(out["token_ids"][0]) == windows[0] + windows[1]
    assert out["transcript"][0, 0].decode() == join_transcript(reference.tokenizer, windows)


@pytest.mark.parametrize("subtype,rate,channels", [
    ("PCM_U8", 16000, 1), ("PCM_24", 16000, 1), ("FLOAT", 16000, 1), ("PCM_16", 8000, 1),
    ("PCM_16", 48000, 1), ("PCM_16", 16000, 2),
])
def test_wav_variants_transcribe_like_the_reference(client, reference, subtype, rate, channels):
    samples, source_rate = soundfile.read(io.BytesIO(MORNING), dtype="float32")
    if rate != source_rate:
        import soxr

        samples = soxr.resample(samples, source_rate, rate)
    if channels == 2:
        samples = np.stack([samples, 0.5 * samples], axis=1)
    audio = wav_bytes(samples, rate=rate, subtype=subtype)
    out = transcribe(client, [audio], [3])
    assert ids_of(out["token_ids"][0]) == reference.tokens(audio, max_new_tokens=3)


def assert_invalid(call, *patterns):
    with pytest.raises(InferenceServerException) as caught:
        call()
    message = str(caught.value)
    for pattern in patterns:
        assert pattern in message, message
    # A bad input is the client's fault: HTTP 400 / gRPC INVALID_ARGUMENT.
    assert str(caught.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT"), message


BAD_AUDIO = {
    "empty": (b"", "is empty (0 bytes)"),
    "not_audio": (b"this is plain text, not a WAV file" * 10, "is not a decodable audio file"),
    "no_samples": (wav_bytes(np.zeros(0, np.float32)), "contains no audio samples"),
    "ten_minutes": (wav_bytes(np.zeros(600 * 8000, np.float32), rate=8000, subtype="PCM_U8"),
                    "is 600.0 s long; the limit is 300 s"),
}


@pytest.mark.parametrize("case", sorted(BAD_AUDIO))
def test_bad_audio_gets_a_clear_error(client, case):
    data, message = BAD_AUDIO[case]
    assert_invalid(lambda: transcribe(client, [MORNING, data], [2, 2]), "'audio'[1]", message)


def test_bad_options_get_clear_errors(client):
    assert_invalid(lambda: transcribe(client, [MORNING], [2], language=["xx"]), "unknown language 'xx'")
    assert_invalid(lambda: transcribe(client, [MORNING], [2], task=["summarize"]), "unknown task 'summarize'")
    assert_invalid(lambda: transcribe(client, [MORNING], [0]), "max_new_tokens")
    assert_invalid(lambda: transcribe(client, [MORNING], [445]), "max_new_tokens")


def test_a_failing_request_does_not_fail_its_batch_neighbours(triton_server, reference):
    clients = [TritonClient("grpc", triton_server.grpc_url) for _ in range(4)]
    payloads = [(MORNING, None), (b"garbage", None), (HELLO, None), (MORNING, "xx")]

    def send(i):
        audio, language = payloads[i]
        try:
            return transcribe(clients[i], [audio], [2], **({"language": [language]} if language else {}))
        except InferenceServerException as error:
            return error

    try:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(send, range(4)))
    finally:
        for c in clients:
            c.close()
    assert isinstance(results[1], InferenceServerException) and isinstance(results[3], InferenceServerException)
    assert ids_of(results[0]["token_ids"][0]) == reference.tokens(MORNING, max_new_tokens=2)
    assert ids_of(results[2]["token_ids"][0]) == reference.tokens(HELLO, max_new_tokens=2)


def test_defaults_apply_without_optional_inputs(internal_client, triton_server, reference):
    """No language/task/max_new_tokens: English, transcribe, the configured bound (whisper_decode,
    an internal step: on Triton's own port)."""
    client = internal_client
    config = (Path(triton_server.options.model_repository) / "whisper_decode" / "config.pbtxt").read_text()
    assert 'key: "max_new_tokens"' in config
    out = client.infer("whisper_decode", {
        "input_features": audio_to_features(MORNING, reference.filters)[None],
        "max_new_tokens": int_tensor([3]),
    })
    assert ids_of(out["token_ids"][0]) == reference.tokens(MORNING, max_new_tokens=3, vad=False)


def test_server_and_speech_models_are_healthy_afterwards(client):
    assert client.is_server_ready()
    for model in (MODEL, "audio_features", "whisper_decode", "whisper_encoder", "whisper_decoder"):
        assert client.is_model_ready(model), model
    out = transcribe(client, [HELLO], [2])
    assert out["token_ids"].shape[1] >= 1


def test_in_process_onnx_decode_equals_transformers_generate(triton_server, reference):
    """The exported graphs against the torch model they came from (the packages' Whisper base or
    random weights; a checkpoint build would need its directory here), with Whisper's suppression
    rules on both sides."""
    import torch

    from repo_builder.export.whisper import WhisperSource, load_whisper

    built = json.loads((Path(triton_server.options.model_repository) / ".built").read_text())
    row = {row["model"]: row for row in built["model_table"]}["whisper_decoder"]
    if row["kind"] == "package":
        source = WhisperSource("pretrained")
    elif row["random"]:
        source = WhisperSource("random", size=row["architecture"].split()[1])
    else:
        pytest.skip(f"repository built from a checkpoint ({row['kind']} {row['source']})")
    model = load_whisper(source)
    tok = reference.tokenizer
    features = np.concatenate([audio_to_features(a, reference.filters) for a in (HELLO, MORNING)])
    prompts = np.array([tok.prompt("en"), tok.prompt("de", "translate")])
    suppress = sorted(set(tok.non_speech_tokens) | set(range(tok.eot + 1, tok.n_vocab)))
    with torch.no_grad():
        generated = model.generate(torch.from_numpy(features), decoder_input_ids=torch.from_numpy(prompts),
                                   max_new_tokens=8, do_sample=False, num_beams=1, forced_decoder_ids=None,
                                   suppress_tokens=suppress, begin_suppress_tokens=[tok.encode(" ")[0], tok.eot])
    ours = reference.whisper.decode_windows(features, prompts, tok, 8)
    rows = generated.tolist()
    if all(row[:prompts.shape[1]] == prompt for row, prompt in zip(rows, prompts.tolist())):
        rows = [row[prompts.shape[1]:] for row in rows]  # the prompt, where generate returns it
    expected = [[t for t in row if t != tok.eot] for row in rows]
    assert ours == expected
    if source.kind == "pretrained":  # real weights stop at <|endoftext|>: "Good morning." is short
        assert any(len(tokens) < 8 for tokens in ours)


def test_embedded_decoder_keeps_cross_kv_between_steps_of_one_caller(internal_client, reference):
    """whisper_decoder on the embedded target: the first call carries the cross K/V with an
    input_cache_key; later calls name it (and the rows still running) and compute the same logits
    as calls that carry the tensors, as the in-process decoder does. One window: its cross K/V are
    37 MB, two would pass the public ports' 64 MiB body limit (whisper_decode sends them over BLS,
    and rows leaving the batch are covered by the pipeline tests). whisper_decoder is internal: the
    public ports do not serve it (no client may name another request's cached K/V)."""
    client = internal_client
    whisper = reference.whisper
    cross = whisper.encode(audio_to_features(MORNING, reference.filters))
    prompts = np.array([reference.tokenizer.prompt()], dtype=np.int64)
    shape = whisper.shape
    past = np.zeros((1, 2 * shape.layers, shape.heads, 0, shape.head_dim), np.float32)
    key = f"test/{client.protocol}"
    first = client.infer("whisper_decoder", {"input_ids": prompts, "past_self_kv": past, **cross},
                         parameters={"input_cache_key": key})
    logits, present = whisper.decoder.run(["logits", "present_self_kv"],
                                          {"input_ids": prompts, "past_self_kv": past, **cross})
    np.testing.assert_allclose(first["logits"], logits, atol=1e-4)
    # second step, naming the cached K/V
    ids = np.argmax(logits, axis=-1).reshape(1, 1).astype(np.int64)
    second = client.infer("whisper_decoder", {"input_ids": ids, "past_self_kv": present},
                          parameters={"input_cache_key": key, "input_cache_rows": "0"})
    expected, _ = whisper.decoder.run(["logits", "present_self_kv"],
                                      {"input_ids": ids, "past_self_kv": present, **cross})
    np.testing.assert_allclose(second["logits"], expected, atol=1e-4)
    assert_invalid(lambda: client.infer("whisper_decoder", {"input_ids": ids, "past_self_kv": present},
                                        parameters={"input_cache_key": "never-stored"}),
                   "'never-stored' is not cached")
    assert_invalid(lambda: client.infer("whisper_decoder", {"input_ids": ids, "past_self_kv": present}),
                   "missing inputs", "cross_key_0")


def test_decoder_instance_without_the_cached_kv_gets_them_again(http_client, reference, triton_server):
    """A decoder instance that does not hold whisper_decode's cross K/V (another instance, or an
    evicted slot) answers 'not cached here' and whisper_decode sends them again for the running
    windows. With the decoder's cache at 0 entries every step takes that path: same tokens."""
    control = triton_server.control
    original = control.config("whisper_decoder")
    config = json.loads(json.dumps(original))
    config["parameters"]["input_cache_entries"] = {"string_value": "0"}
    control.load("whisper_decoder", config=config)
    try:
        audios, bounds = [HELLO, MORNING], [7, 3]  # the second window leaves the batch early
        out = transcribe(http_client, audios, bounds)
        for row, audio, bound in zip(out["token_ids"], audios, bounds):
            assert ids_of(row) == reference.tokens(audio, max_new_tokens=bound)
    finally:
        control.load("whisper_decoder", config=original)
    assert "input_cache_entries" not in control.config("whisper_decoder")["parameters"]


def test_without_the_decoder_cache_windows_are_decoded_in_encoder_sized_groups(http_client, reference, triton_server):
    """The gpu target's path (no cross-K/V cache in the decoder, device tensors that cannot be
    joined): more windows than one encoder call takes are decoded group by group. Run here by
    loading whisper_decode with decoder_input_cache off: the same tokens as the reference."""
    control = triton_server.control
    original = control.config("whisper_decode")
    encoder_batch = int(original["parameters"]["encoder_max_batch_size"]["string_value"])
    speech = soundfile.read(io.BytesIO(HELLO), dtype="float32")[0]
    pause = np.zeros(SAMPLE_RATE * 26, np.float32)
    long_audio = wav_bytes(np.concatenate([np.concatenate([speech, pause])] * (encoder_batch + 1)))
    windows = len(reference.encoded(long_audio, vad=False))  # VAD would pack the speech into one window
    assert windows > encoder_batch
    config = json.loads(json.dumps(original))
    config["parameters"]["decoder_input_cache"] = {"string_value": "false"}
    control.load("whisper_decode", config=config)
    try:
        out = transcribe(http_client, [long_audio], [3], vad_filter=[False])
        assert ids_of(out["token_ids"][0]) == reference.tokens(long_audio, max_new_tokens=3, vad=False)
    finally:
        control.load("whisper_decode", config=original)
    assert control.config("whisper_decode")["parameters"]["decoder_input_cache"]["string_value"] == "true"


def test_noise_and_silence_alone_give_no_words(client, http_client, reference):
    """By default (VAD mode ``windows``) and under vad_filter true (``pack``) noise, a hum and silence
    have no speech: no window is decoded (the encoder is not called) and the transcript is empty.
    With vad_filter false (no VAD) the same noise is decoded, as the reference decodes it (Whisper
    base then says something)."""
    rng = np.random.default_rng(8)
    t = np.arange(3 * SAMPLE_RATE) / SAMPLE_RATE
    hum = wav_bytes((0.1 * np.sin(2 * np.pi * 50 * t) + 0.01 * rng.standard_normal(len(t))).astype(np.float32))
    silence = wav_bytes(np.zeros(2 * SAMPLE_RATE, np.float32))
    assert DEFAULT_VAD_MODE == "windows"
    for vad_filter in (None, [True, True, True]):
        before = http_client.statistics("whisper_encoder")["model_stats"][0]["inference_count"]
        out = transcribe(client, [NOISE, hum, silence], [20, 20, 20], vad_filter=vad_filter)
        assert out["transcript"][:, 0].tolist() == [b"", b"", b""], vad_filter
        assert all(ids_of(row) == [] for row in out["token_ids"])
        assert http_client.statistics("whisper_encoder")["model_stats"][0]["inference_count"] == before
    plain = transcribe(client, [NOISE], [20], vad_filter=[False])
    expected = reference.tokens(NOISE, max_new_tokens=20, vad=False)
    assert ids_of(plain["token_ids"][0]) == expected and expected != []


def test_a_long_file_is_cut_at_speech_boundaries(client, reference):
    """12 utterances 3 s apart (78 s): VAD leaves the pauses out and packs the utterances into 2
    windows (3 without it), none cut inside an utterance (tests/unit/pipelines/test_speech_vad.py),
    and the server decodes those windows as the reference does. (Its word error rate on distinct
    sentences: test_speech_quality.py.)"""
    speech = soundfile.read(io.BytesIO(HELLO), dtype="float32")[0]
    pause = np.zeros(3 * SAMPLE_RATE, np.float32)
    long_audio = wav_bytes(np.concatenate([speech] + [np.concatenate([pause, speech])] * 11))
    assert len(reference.encoded(long_audio, vad=True)) == 2 and len(reference.encoded(long_audio, vad=False)) == 3
    out = transcribe(client, [long_audio], [40], vad_filter=[True])
    assert ids_of(out["token_ids"][0]) == reference.tokens(long_audio, max_new_tokens=40, vad=True)
