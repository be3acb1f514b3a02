"""Cheap to send, costly to decode (issue 19, items 4, 6, 13), through the public ports of the real
server over HTTP and gRPC: each hostile file is refused (or bounded) quickly with a 400 naming the
problem, and a neighbour's request is answered while it is handled."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from triton_pipelines.client import InferenceServerException, TritonClient, text_tensor

from tests.support import hostile_files as hostile
from tests.server.test_hostile import assert_serving
from tests.support.paths import TEST_DATA

DATA = TEST_DATA


def refused(client, model: str, name: str, data: bytes, match: str, within_s: float = 5.0) -> float:
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as error:
        client.infer(model, {name: text_tensor([data])})
    elapsed = time.monotonic() - started
    assert match in str(error.value), str(error.value)
    assert "400" in str(error.value) or "INVALID_ARG" in str(error.value)
    assert elapsed < within_s, f"{model}: refused after {elapsed:.1f} s"
    return elapsed


@pytest.mark.parametrize("case,match", [
    ("jpeg_scans", "progressive JPEG with more than 64 scans"),
    ("jpeg_segments", "JPEG with more than 1024 marker segments"),
    ("bmp_rle8", "RLE8 BMP of 7071x7071 = 49999041 pixels"),
    ("png_chunks", "PNG with more than 16384 chunks"),
    ("gif_blocks", "GIF with more than 16384 extension blocks"),
])
def test_images_that_cost_far_more_than_their_pixels_are_refused_before_decoding(triton_server, client, case, match):
    data = {"jpeg_scans": lambda: hostile.progressive_jpeg(1448, 100_000),
            "jpeg_segments": lambda: hostile.jpeg_with_segments(1_000_000),
            "bmp_rle8": lambda: hostile.bmp_rle8_early_row_ends(),
            "png_chunks": lambda: hostile.png_many_chunks(1_000_000, idat=False),
            "gif_blocks": lambda: hostile.gif_many_extensions(1_000_000)}[case]()
    refused(client, "image_classification", "image", data, match)


def test_a_neighbours_image_is_answered_while_hostile_images_arrive(triton_server, client):
    """Two concurrent 2.3 MB progressive JPEGs (200,000 empty scans) took 40.6 s each and a
    neighbour's image timed out at 30 s."""
    jpeg = hostile.progressive_jpeg(1448, 200_000)
    scene = (DATA / "scene.jpg").read_bytes()

    def attack():
        own = TritonClient(client.protocol, triton_server.url(client.protocol))  # one client per thread
        try:
            return refused(own, "image_classification", "image", jpeg, "more than 64 scans")
        finally:
            own.close()

    with ThreadPoolExecutor(2) as pool:
        attacks = [pool.submit(attack) for _ in range(2)]
        started = time.monotonic()
        answer = client.infer("image_classification", {"image": text_tensor([scene])})
        neighbour_s = time.monotonic() - started
        refused_s = [a.result() for a in attacks]
    print(f"image neighbour {neighbour_s:.2f} s; hostile JPEGs refused in {refused_s}")
    assert answer["labels"].shape[0] == 1 and neighbour_s < 10
    assert_serving(triton_server)


def test_audio_below_telephone_band_is_refused(triton_server, client):
    """A 644-byte WAV at 1 Hz declaring 300 s used to be resampled to 4.8 M samples, 10 windows."""
    data = hostile.wav(1, 300)
    assert len(data) < 1000
    refused(client, "speech_recognition", "audio", data, "sample rate of 1 Hz; the minimum is 8000 Hz", within_s=3)


@pytest.mark.parametrize("fmt", ["FLAC", "OGG"])
def test_compressed_silence_declaring_minutes_costs_one_window(triton_server, internal_client, fmt):
    """audio_features is internal (Triton's own port); the pipeline is called on the public one.
    Without VAD one window (10 before the silent windows were skipped); by default (VAD) none."""
    data = hostile.compressed_silence(299, format=fmt)
    assert len(data) < 100_000
    started = time.monotonic()
    features = internal_client.infer("audio_features", {"audio": text_tensor([data]),
                                                        "vad_filter": np.array([[False]])})
    assert int(features["num_windows"][0, 0]) == 1
    features = internal_client.infer("audio_features", {"audio": text_tensor([data])})
    assert int(features["num_windows"][0, 0]) == 0
    public = TritonClient(internal_client.protocol, triton_server.url(internal_client.protocol))
    public.infer("speech_recognition", {"audio": text_tensor([data])})
    public.close()
    assert time.monotonic() - started < 30


def test_a_request_of_64_long_texts_does_not_hold_the_tokenizer(triton_server, internal_client):
    """64 rows × 64 KiB (4 MiB, legal): the tokenizer reads a bounded prefix of each row
    (text_tokenizer is internal: Triton's own port)."""
    client = internal_client
    rng = np.random.default_rng(1)
    words = np.array(["reset", "password", "parcel", "billing", "refund", "naïve", "über"])
    rows = [" ".join(rng.choice(words, 12_000)).encode()[:65_536].decode("utf-8", "ignore") for _ in range(64)]
    short = [row[:4096] for row in rows]  # the same first 256 tokens, 1/16 of the text
    client.infer("text_tokenizer", {"text": text_tensor(rows[:1])})  # warm

    def tokenize(batch):
        started = time.monotonic()
        tokens = client.infer("text_tokenizer", {"text": text_tensor(batch)})
        return time.monotonic() - started, tokens
    short_s, short_tokens = min((tokenize(short) for _ in range(3)), key=lambda r: r[0])
    long_s, tokens = min((tokenize(rows) for _ in range(3)), key=lambda r: r[0])
    np.testing.assert_array_equal(tokens["input_ids"], short_tokens["input_ids"])
    assert tokens["input_ids"].shape == (64, 256)
    print(f"text_tokenizer, 64 rows: {long_s * 1000:.0f} ms at 64 KiB, {short_s * 1000:.0f} ms at 4 KiB")
    # A row costs its 256 tokens, not its bytes: 16x the text, not 16x the time (before: 3.0 s
    # against ~0.2 s). Relative, so a loaded machine slows both alike.
    assert long_s < 4 * short_s + 0.2
    assert_serving(triton_server)
