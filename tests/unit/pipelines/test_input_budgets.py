"""Work budgets (no server): each hostile file class is refused by a cheap check before decoding,
quickly, with a message naming the problem; good files of the same formats still pass; the limits
in the built model configs are the Python constants, which the builder writes there."""

from __future__ import annotations

import io
import struct
import time
from dataclasses import fields

import numpy as np
import pytest
from PIL import Image

from triton_pipelines.pipelines import image_budget
from triton_pipelines.errors import InputError
from triton_pipelines.pipelines.vision import PreprocessConfig, preprocess_image

from tests.support import hostile_files as hostile


def config_parameters(model: str) -> dict[str, str]:
    """What the builder writes into a Python model's config from the runtime's constants."""
    from repo_builder.pipeline import parameter_text
    from triton_pipelines.pipelines.speech import config as speech
    from triton_pipelines.pipelines import text
    from triton_pipelines.pipelines import vision

    owners = {name: values for module in (speech, text, vision) for name, values in module.CONFIG_PARAMETERS.items()}
    return {key: parameter_text(value) for key, value in owners[model].items()}


def test_the_built_configs_hold_the_runtime_constants():
    """The one owner of each limit is its Python constant; the built config carries it (the source
    config names none of them: tests/unit/builder/test_configs.py)."""
    from repo_builder.files import read_config

    from tests.conftest import ensure_repository

    for model in ("image_preprocess", "classification_postprocess", "text_tokenizer", "audio_features",
                  "whisper_decode", "speech_recognition_stream"):
        built = read_config(ensure_repository() / model / "config.pbtxt").parameters
        assert {k: built[k].string_value for k in config_parameters(model)} == config_parameters(model), model


def refused_fast(data: bytes, match: str, config: PreprocessConfig = PreprocessConfig()) -> None:
    started = time.process_time()
    with pytest.raises(InputError, match=match):
        preprocess_image(data, config)
    assert time.process_time() - started < 0.5


def test_image_preprocess_config_holds_the_python_defaults():
    """The adapter reads back PreprocessConfig's defaults from what the builder writes."""
    parameters = config_parameters("image_preprocess")
    for field in fields(PreprocessConfig):
        if field.name.startswith("max_"):
            assert int(parameters[field.name]) == field.default, field.name
    assert PreprocessConfig.from_parameters(parameters) == PreprocessConfig()
    assert PreprocessConfig.from_parameters({"max_jpeg_scans": "7", "jpeg_draft": "true"}).max_jpeg_scans == 7


def test_progressive_jpeg_with_too_many_scans_is_refused_before_decoding():
    refused_fast(hostile.progressive_jpeg(1448, 100_000), "progressive JPEG with more than 64 scans")
    # a real progressive JPEG (libjpeg's ~10 scans) and one with 54 extra empty scans decode
    assert preprocess_image(hostile.progressive_jpeg(300, 0)).shape == (3, 224, 224)
    assert preprocess_image(hostile.progressive_jpeg(300, 50)).shape == (3, 224, 224)
    with pytest.raises(InputError, match="more than 3 scans"):
        preprocess_image(hostile.progressive_jpeg(300, 0), PreprocessConfig(max_jpeg_scans=3))


def test_jpeg_with_too_many_segments_is_refused():
    refused_fast(hostile.jpeg_with_segments(500_000), "JPEG with more than 1024 marker segments")
    assert preprocess_image(hostile.jpeg_with_segments(900)).shape == (3, 224, 224)


def test_rle_bmp_is_bounded_by_its_own_pixel_limit():
    refused_fast(hostile.bmp_rle8_early_row_ends(), r"RLE8 BMP of 7071x7071 = 49999041 pixels; .* limited to 1000000")
    refused_fast(hostile.bmp_rle8_early_row_ends(2000, 1000, rle4=True), "RLE4 BMP of 2000x1000")
    started = time.process_time()
    assert preprocess_image(hostile.bmp_rle8_early_row_ends(1000, 1000)).shape == (3, 224, 224)
    assert time.process_time() - started < 2  # the worst case at the limit (~0.3 s measured)
    buffer = io.BytesIO()  # uncompressed BMP: C decoder, only the pixel limit applies
    Image.new("RGB", (2000, 1000), (10, 20, 30)).save(buffer, "BMP")
    assert preprocess_image(buffer.getvalue()).shape == (3, 224, 224)


@pytest.mark.parametrize("idat", [True, False])
def test_png_with_too_many_chunks_is_refused(idat):
    refused_fast(hostile.png_many_chunks(200_000, idat=idat), "PNG with more than 16384 chunks")
    assert preprocess_image(hostile.png_many_chunks(1000, idat=idat)).shape == (3, 224, 224)


def test_gif_with_too_many_blocks_before_its_first_image_is_refused():
    refused_fast(hostile.gif_many_extensions(500_000), "GIF with more than 16384 extension blocks")
    assert preprocess_image(hostile.gif_many_extensions(1000)).shape == (3, 224, 224)


def tiff_directory(entries: int, data_bytes: int) -> bytes:
    ifd = struct.pack("<H", entries)
    for tag in range(entries):
        ifd += struct.pack("<HHII", 0x8000 + tag, 7, data_bytes, 8 + 2 + 12 * entries + 4)
    return b"II*\x00" + struct.pack("<I", 8) + ifd + bytes(4) + bytes(data_bytes)


def test_overlapping_exif_and_mpf_directories_are_refused():
    with pytest.raises(InputError, match="EXIF directory of 4000 tags claiming 160000000 bytes"):
        image_budget.check_tiff_directory(tiff_directory(4000, 40_000), "image", "EXIF")
    image_budget.check_tiff_directory(tiff_directory(1, 1000), "image", "EXIF")
    image_budget.check_tiff_directory(tiff_directory(1, 1000)[:500], "image", "EXIF")  # truncated: Pillow skips it
    # in a JPEG: Pillow reads the APP1 EXIF at open
    base = hostile.jpeg_with_segments(0)
    exif = b"Exif\x00\x00" + tiff_directory(1000, 50_000)[:60_000]
    app1 = b"\xff\xe1" + struct.pack(">H", len(exif) + 2) + exif
    refused_fast(base[:2] + app1 + base[2:], "EXIF directory of 1000 tags")
    mpf = b"MPF\x00" + tiff_directory(1000, 50_000)[:60_000]
    app2 = b"\xff\xe2" + struct.pack(">H", len(mpf) + 2) + mpf
    refused_fast(base[:2] + app2 + base[2:], "MPF directory of 1000 tags")
    # a PNG's EXIF never reaches Pillow's reader: the image is answered, quickly
    started = time.process_time()
    assert preprocess_image(hostile.exif_bomb_png(4000, 40_000)).shape == (3, 224, 224)
    assert time.process_time() - started < 0.5


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_pillows_exif_transpose(orientation):
    from PIL import ImageOps

    pixels = np.arange(40 * 24 * 3, dtype=np.uint8).reshape(24, 40, 3)
    image = Image.fromarray(pixels)
    exif = Image.Exif()
    exif[0x0112] = orientation
    for fmt in ("JPEG", "PNG", "WEBP"):
        buffer = io.BytesIO()
        image.save(buffer, fmt, exif=exif.tobytes(), **({"lossless": True} if fmt == "WEBP" else {}))
        opened = Image.open(io.BytesIO(buffer.getvalue()))
        opened.load()
        assert image_budget.exif_orientation(opened.info.get("exif")) == orientation
        expected = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(buffer.getvalue()))).convert("RGB"))
        from triton_pipelines.pipelines.vision import to_rgb

        assert np.array_equal(np.asarray(to_rgb(opened)), expected), (fmt, orientation)


# ------------------------------------------------------------------------------------ audio
from triton_pipelines.limits import MAX_AUDIO_BYTES, MAX_AUDIO_SECONDS  # noqa: E402
from triton_pipelines.pipelines.speech.audio import decode_audio  # noqa: E402
from triton_pipelines.pipelines.speech.config import MAX_DECODED_SAMPLES, MIN_SAMPLE_RATE, SAMPLE_RATE  # noqa: E402
from triton_pipelines.pipelines.speech.features import audio_to_features  # noqa: E402
from triton_pipelines.pipelines.speech.windows import is_silent, sounding_windows, split_windows  # noqa: E402


def test_audio_features_config_holds_the_python_defaults():
    parameters = config_parameters("audio_features")
    assert float(parameters["max_audio_seconds"]) == MAX_AUDIO_SECONDS
    assert int(parameters["max_audio_bytes"]) == MAX_AUDIO_BYTES
    assert int(parameters["max_decoded_samples"]) == MAX_DECODED_SAMPLES
    assert int(parameters["min_sample_rate"]) == MIN_SAMPLE_RATE


@pytest.mark.parametrize("rate", [1, 100, 7999])
def test_audio_below_telephone_band_is_refused(rate):
    data = hostile.wav(rate, 300 * rate if rate < 7999 else 8000)
    started = time.process_time()
    with pytest.raises(InputError, match=f"has a sample rate of {rate} Hz; the minimum is 8000 Hz"):
        decode_audio(data)
    assert time.process_time() - started < 0.2
    assert len(decode_audio(hostile.wav(8000, 8000))) == 16000  # 1 s at the floor: decoded


def test_a_wav_header_cannot_declare_more_samples_than_the_file_carries():
    data = bytearray(hostile.wav(16000, 16000))  # 1 s, then claim 300 s in RIFF and data sizes
    data[4:8] = struct.pack("<I", 36 + 300 * 32000)
    data[40:44] = struct.pack("<I", 300 * 32000)
    assert len(decode_audio(bytes(data))) == 16000


def test_other_libsndfile_formats_are_refused():
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(16000, np.float32), 16000, format="AIFF")
    with pytest.raises(InputError, match="AIFF .*accepted: WAV, FLAC, OGG"):
        decode_audio(buffer.getvalue())


@pytest.mark.parametrize("fmt", ["FLAC", "OGG", "OPUS"])
def test_compressed_silence_costs_one_window(fmt):
    data = hostile.compressed_silence(299, format=fmt)
    assert len(data) < 200_000
    filters = np.zeros((80, 201), np.float32)
    started = time.process_time()
    assert audio_to_features(data, filters).shape == (1, 80, 3000)
    assert time.process_time() - started < 5


def test_silent_windows_are_left_out_and_sounding_ones_kept():
    rate = SAMPLE_RATE
    rng = np.random.default_rng(0)
    voice = (0.1 * rng.standard_normal(5 * rate)).astype(np.float32)
    silence = np.zeros(60 * rate, np.float32)
    audio = np.concatenate([voice, silence, voice, silence])  # 130 s: 5 windows, 2 sound
    windows = sounding_windows(audio)
    assert len(split_windows(audio)) == 5 and len(windows) == 2
    assert all(not is_silent(w) for w in windows)
    # a constant offset and dither below 4 LSB of 16-bit audio are silence; one LSB above is not
    assert is_silent(np.full(100, 0.3, np.float32))
    assert is_silent(rng.integers(-1, 2, 1000).astype(np.float32) / 32768)
    assert not is_silent(rng.integers(-3, 3, 1000).astype(np.float32) / 32768 * 2)


# ------------------------------------------------------------------------------------ text
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from triton_pipelines.pipelines.text import TextTokenizer  # noqa: E402

from tests.unit.pipelines.test_text import minilm_dir  # noqa: E402

_TOKENIZERS: dict = {}


def tokenizers(prefix_chars: int) -> tuple[TextTokenizer, TextTokenizer]:
    """(bounded with a small prefix so that growth is exercised, whole-text reference)."""
    if prefix_chars not in _TOKENIZERS:
        path = minilm_dir() / "tokenizer.json"
        _TOKENIZERS[prefix_chars] = (TextTokenizer(path, prefix_chars=prefix_chars), TextTokenizer(path, prefix_chars=None))
    return _TOKENIZERS[prefix_chars]


def assert_same_tokens(texts: list[str], prefix_chars: int) -> None:
    bounded, whole = tokenizers(prefix_chars)
    assert bounded.prefix_chars == prefix_chars  # the prefix path is on for this tokenizer
    a, b = bounded.encode(texts), whole.encode(texts)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.attention_mask, b.attention_mask)


PIECES = ["word", "Hello", "ΟΔΟΣ", "ΑΣ.b", "Σ", "naïve", "e\u0301", "\u0301", "中文字", "ｆｕｌｌ", "İstanbul", "ß",
          "x" * 150, "y" * 99, "ab" * 60, "🙂", "\x00", "\ufffd", "\x1c", "\u200b", "\u00a0", "\u3000", "...", "-",
          "don't", "1,000.5", "<tag>", "\t", "\n", "\r\n", " ", "   ", "a" * 10_000]
SEPARATORS = ["", " ", "  ", "\t", "\n", "\u00a0", ".", "\u0301"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(PIECES), st.sampled_from(SEPARATORS)), min_size=0, max_size=400),
       st.sampled_from([1, 7, 64, 512]))
def test_bounded_prefix_tokenization_equals_whole_text_tokenization(parts, prefix_chars):
    text = "".join(piece + separator for piece, separator in parts)
    assert_same_tokens([text, text[::-1], text.upper()], prefix_chars)


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=0, max_size=3000), st.sampled_from([1, 16, 256]))
def test_bounded_prefix_tokenization_equals_whole_text_on_any_unicode(text, prefix_chars):
    assert_same_tokens([text, text * 3], prefix_chars)


@pytest.mark.slow
def test_long_texts_cost_what_their_first_tokens_cost():
    bounded, whole = tokenizers(4096)
    rng = np.random.default_rng(0)
    words = np.array(["reset", "password", "parcel", "billing", "refund", "naïve", "über", "x" * 120])
    texts = [" ".join(rng.choice(words, 12_000))[:65_536] for _ in range(64)]  # 64 rows of 64 KiB
    texts[3] = "z" * 65_000 + " tail"  # one enormous word: no cut point, tokenized whole
    assert_same_tokens(texts, 4096)
    started = time.process_time()
    bounded.encode(texts)
    bounded_s = time.process_time() - started
    started = time.process_time()
    whole.encode(texts)
    whole_s = time.process_time() - started
    print(f"64 x 64 KiB: bounded {bounded_s * 1000:.0f} ms, whole {whole_s * 1000:.0f} ms")
    assert bounded_s < whole_s / 3


def test_16_bit_grayscale_is_scaled_in_integers_exactly_like_rounding():
    from triton_pipelines.pipelines.vision import to_rgb

    values = np.arange(65536, dtype=np.uint16).reshape(256, 256)
    buffer = io.BytesIO()
    Image.fromarray(values).save(buffer, "PNG")
    opened = Image.open(io.BytesIO(buffer.getvalue()))
    opened.load()
    assert opened.mode.startswith("I;16")
    rgb = np.asarray(to_rgb(opened))
    expected = np.clip(np.rint(values / 257.0), 0, 255).astype(np.uint8)
    assert all(np.array_equal(rgb[..., channel], expected) for channel in range(3))


def test_mpf_directory_of_overlapping_longs_is_refused_at_once():
    """2,700 LONG tags over the same 32 KB in a 65 KB APP2: Pillow's MPO check unpacked them all at
    open (1.98 s, +200 MB measured)."""
    entries, data_bytes = 2700, 32_000
    ifd = struct.pack("<H", entries) + b"".join(
        struct.pack("<HHII", 0x8000 + tag, 4, data_bytes // 4, 8 + 2 + 12 * entries + 4) for tag in range(entries))
    mpf = b"MPF\x00" + b"II*\x00" + struct.pack("<I", 8) + ifd + bytes(4) + bytes(data_bytes)
    base = hostile.jpeg_with_segments(0)
    refused_fast(base[:2] + b"\xff\xe2" + struct.pack(">H", len(mpf) + 2) + mpf + base[2:], "MPF directory of 2700 tags")
