"""A native gRPC ``speech_recognition`` call whose deadline passes is no longer decoded (issue 33
§3), through the public gRPC port of the real server: the client gets DEADLINE_EXCEEDED, the
decoder stops within about a second (``whisper_decoder``'s execution count stops growing, short of
half the steps of the whole clip's decode), and a neighbour's short transcription queued behind it
is answered.

Triton 2.51 cancels an ensemble's step only when it schedules the step after the cancellation, never
a running one: the screen forwards the deadline (``limits.CLIENT_DEADLINE_PARAMETER``) and
``whisper_decode`` stops by it between steps."""

from __future__ import annotations

import io
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile

from tests.conftest import LOG_DIR, ensure_repository
from tests.support.paths import TEST_DATA
from triton_pipelines.client import InferenceServerException, TritonClient
from triton_pipelines.server.launcher import start_on_free_ports

MODELS = ["audio_features", "whisper_encoder", "whisper_decoder", "whisper_decode", "speech_recognition"]
HELLO = TEST_DATA / "speech_hello.wav"
HELLO_TEXT = "Hello World! This is a test on the speech recognition pipeline."
DEADLINE_S = 2.5


@pytest.fixture(scope="module")
def server():
    launched = start_on_free_ports(ensure_repository(), LOG_DIR / "test-hostile-cancel-server.log", models=MODELS,
                                   timeout_s=900)
    yield launched
    launched.stop()


def long_clip(seconds: float) -> bytes:
    """Speech repeated (``HELLO`` and half a second of silence) to ``seconds``: many tokens per window."""
    samples, rate = soundfile.read(str(HELLO), dtype="float32")
    unit = np.concatenate([samples, np.zeros(int(rate * 0.5), np.float32)])
    clip = np.tile(unit, int(np.ceil(seconds * rate / len(unit))))[:int(seconds * rate)]
    buffer = io.BytesIO()
    soundfile.write(buffer, clip, rate, format="WAV")
    return buffer.getvalue()


def test_a_call_past_its_deadline_stops_decoding_and_its_neighbour_is_answered(server):
    import tritonclient.grpc as grpcclient

    internal = TritonClient("http", server.internal_url("http"))
    public = TritonClient("grpc", server.url("grpc"))
    hasty = grpcclient.InferenceServerClient(server.url("grpc"))
    clip = np.array([[long_clip(120.0)]], dtype=object)

    def steps() -> int:
        return int(internal.statistics("whisper_decoder")["model_stats"][0]["execution_count"])

    def neighbour() -> tuple[str, float]:
        started = time.monotonic()
        answer = public.infer("speech_recognition", {"audio": np.array([[HELLO.read_bytes()]], dtype=object)})
        return answer["transcript"][0, 0].decode(), time.monotonic() - started

    try:
        assert neighbour()[0] == HELLO_TEXT  # warm
        before, started = steps(), time.monotonic()
        whole = public.infer("speech_recognition", {"audio": clip})["transcript"][0, 0].decode()
        whole_s, whole_steps = time.monotonic() - started, steps() - before
        assert len(whole.split()) > 100 and whole_steps > 60, (whole_steps, whole)

        tensor = grpcclient.InferInput("audio", [1, 1], "BYTES")
        tensor.set_data_from_numpy(clip)
        before, started = steps(), time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            time.sleep(0.3)
            queued = pool.submit(lambda: (time.sleep(0.5), neighbour())[1])  # behind the long one
            with pytest.raises(InferenceServerException) as caught:
                hasty.infer("speech_recognition", [tensor], client_timeout=DEADLINE_S)
            assert "DEADLINE_EXCEEDED" in str(caught.value.status())
            text, waited = queued.result(timeout=120)
        assert text == HELLO_TEXT
        time.sleep(1.5)
        after_cancel = steps() - before
        print(f"\nwhole decode: {whole_steps} steps in {whole_s:.1f} s; with a {DEADLINE_S} s deadline: "
              f"{after_cancel} steps (the neighbour's included); neighbour answered in {waited:.1f} s")
        time.sleep(2.0)
        assert steps() - before == after_cancel  # nothing is still decoding
        # the long call's steps (and the neighbour's) stop short of the whole decode
        assert after_cancel < whole_steps / 2, (after_cancel, whole_steps)
    finally:
        internal.close()
        public.close()
        hasty.close()
