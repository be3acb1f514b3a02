"""Vision pipeline logic without a server: the preprocessing recipe (checked against a hand-computed
antialiased resize + centre crop), format/mode handling, refusals, top-k, and the gpu-target configs
and TensorRT engine script."""

from __future__ import annotations

import io
import os
import re
import struct
import subprocess
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from PIL import Image
from tritonclient.grpc import model_config_pb2 as mc

from triton_pipelines.errors import ConfigError, InputError
from triton_pipelines.pipelines.scoring import softmax, top_k
from triton_pipelines.pipelines.vision import (
    IMAGENET_MEAN, IMAGENET_STD, Classifier, ImagePreprocessor, PreprocessConfig, center_crop_box,
    decode_to_rgb, imagenet_labels, parse_top_k, preprocess_image, resized_size, transform,
)
from tests.support.paths import PROJECT_ROOT

ROOT = PROJECT_ROOT
DATA = ROOT / "tests" / "data"
CONFIG = PreprocessConfig()


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def png_bomb(width: int, height: int) -> bytes:
    """A valid PNG whose header claims width x height 8-bit RGB pixels: IHDR, one IDAT holding the
    first row (compressed zeros), IEND. A few hundred bytes that would decode to width*height*3."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    first_row = zlib.compress(b"\x00" * (1 + 3 * width))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", first_row) + chunk(b"IEND", b"")


def denormalize(pixels: np.ndarray) -> np.ndarray:
    """[3, H, W] normalized → [H, W, 3] in 0..255 (float)."""
    mean = np.asarray(IMAGENET_MEAN, np.float32)[:, None, None]
    std = np.asarray(IMAGENET_STD, np.float32)[:, None, None]
    return ((pixels * std + mean) * 255.0).transpose(1, 2, 0)


# --- the recipe --------------------------------------------------------------------------------


def test_resized_size_follows_torchvision_resize_int():
    assert resized_size(640, 480, 256) == (341, 256)  # int(256 * 640 / 480) = 341
    assert resized_size(480, 640, 256) == (256, 341)
    assert resized_size(500, 500, 256) == (256, 256)
    assert resized_size(1, 1, 256) == (256, 256)
    assert resized_size(12, 480, 256) == (256, 10240)


def test_center_crop_box_uses_torchvision_offsets():
    # 640x480 → 341x256; left = round((341 - 224) / 2) = round(58.5) = 58, top = 16.
    box = center_crop_box(640, 480, CONFIG)
    scale_x, scale_y = 640 / 341, 480 / 256
    assert box == pytest.approx((58 * scale_x, 16 * scale_y, 282 * scale_x, 240 * scale_y))


def test_hand_computed_antialiased_resize_and_center_crop():
    """A 10x4 image, Resize(2) + CenterCrop(2): a 2x downscale whose bilinear (triangle) filter is
    stretched over 2 source pixels each side, as torchvision/Pillow antialiasing does.

    Resize(2): 10x4 → 5x2; crop left = round((5 - 2) / 2) = 2, top = 0; output pixel (i, j) samples
    the source centre ((2 + j + 0.5) * 2, (i + 0.5) * 2) with weights tri(d / 2) over |d| < 2:
    interior taps [1, 3, 3, 1] / 8; at the top border (centre 1.0) the tap at -1 falls outside and
    the rest renormalize to [3, 3, 1] / 7 (and [1, 3, 3] / 7 at the bottom).
    Pillow rounds to uint8 after the horizontal pass, then after the vertical pass.
    """
    rng = np.random.default_rng(3)
    source = rng.integers(0, 256, (4, 10), dtype=np.uint8)
    rgb = np.repeat(source[:, :, None], 3, axis=2)
    horizontal = np.zeros((10, 2))
    horizontal[3:7, 0] = [1, 3, 3, 1]  # output column 0: centre x = 5.0 → source columns 3..6
    horizontal[5:9, 1] = [1, 3, 3, 1]  # output column 1: centre x = 7.0 → source columns 5..8
    horizontal /= 8
    vertical = np.zeros((2, 4))
    vertical[0, 0:3] = [3, 3, 1]  # output row 0: centre y = 1.0
    vertical[1, 1:4] = [1, 3, 3]  # output row 1: centre y = 3.0
    vertical /= 7
    after_horizontal = np.floor(source.astype(np.float64) @ horizontal + 0.5)
    expected = np.floor(vertical @ after_horizontal + 0.5)

    config = PreprocessConfig(resize_shorter_side=2, crop_size=2)
    pixels = transform(Image.fromarray(rgb), config)
    assert pixels.shape == (3, 2, 2) and pixels.dtype == np.float32
    got = denormalize(pixels)
    for channel in range(3):
        np.testing.assert_allclose(got[:, :, channel], expected, atol=1.0 + 1e-3)
    # The non-antialiased answer (2-tap bilinear between source pixels) is measurably different.
    naive = (source[[0, 2]][:, [4, 6]].astype(float) + source[[1, 3]][:, [5, 7]]) / 2
    assert np.abs(naive - expected).max() > 5


def test_normalization_and_layout_by_hand():
    """An image already at the resize size: no resampling, so every output value is checkable."""
    rng = np.random.default_rng(5)
    rgb = rng.integers(0, 256, (256, 300, 3), dtype=np.uint8)  # Resize(256) keeps 300x256
    pixels = preprocess_image(encode(Image.fromarray(rgb), "PNG"))
    top, left = 16, 38  # round((256 - 224) / 2), round((300 - 224) / 2)
    crop = rgb[top:top + 224, left:left + 224].astype(np.float32) / 255.0
    expected = ((crop - np.float32(IMAGENET_MEAN)) / np.float32(IMAGENET_STD)).transpose(2, 0, 1)
    assert pixels.shape == (3, 224, 224)
    np.testing.assert_allclose(pixels, expected, atol=1e-6)


@pytest.mark.parametrize("size", [(640, 480), (500, 375), (37, 1000), (3000, 200), (231, 229)])
def test_box_resize_equals_resize_then_crop(size):
    """The one-call box resample equals torchvision's Resize + CenterCrop within 1 level on ≤1% of
    pixels (float rounding of the box edges)."""
    width, height = size
    rgb = np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    image = Image.fromarray(rgb)
    new_w, new_h = resized_size(width, height, 256)
    full = np.asarray(image.resize((new_w, new_h), Image.BILINEAR), dtype=np.float32)
    top, left = int(round((new_h - 224) / 2.0)), int(round((new_w - 224) / 2.0))
    reference = full[top:top + 224, left:left + 224]
    got = denormalize(transform(image, CONFIG))
    difference = np.abs(got - reference)
    assert difference.max() <= 1.0 + 1e-3
    assert (difference > 0.5).mean() <= 0.01


# --- formats and modes --------------------------------------------------------------------------


def test_every_shipped_format_decodes_to_a_224_tensor():
    for name in ("scene.jpg", "scene.webp", "scene.bmp", "scene_alpha.png", "scene_palette.png",
                 "scene_cmyk.jpg", "animated.gif", "gray16.png", "pixel_1x1.png", "tall_strip.png",
                 "scene_exif_orientation6.jpg"):
        pixels = preprocess_image((DATA / name).read_bytes())
        assert pixels.shape == (3, 224, 224) and pixels.dtype == np.float32, name
        assert np.isfinite(pixels).all(), name


def test_exif_orientation_is_applied():
    upright = np.asarray(decode_to_rgb((DATA / "scene_exif_orientation6.jpg").read_bytes(), CONFIG), np.float32)
    reference = Image.open(DATA / "scene.jpg").resize((160, 120), Image.BILINEAR)
    assert upright.shape == (120, 160, 3)  # stored 120 wide x 160 high, displayed landscape
    assert np.abs(upright - np.asarray(reference, np.float32)).mean() < 6  # JPEG noise only


def test_sixteen_bit_grayscale_is_scaled_not_clipped():
    values = np.array([[0, 257, 32896, 65535]], dtype=np.uint16)
    rgb = np.asarray(decode_to_rgb(encode(Image.fromarray(values), "PNG"), CONFIG))
    assert rgb[0, :, 0].tolist() == [0, 1, 128, 255]
    assert (rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all()


def test_alpha_is_composited_over_white():
    rgba = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    rgb = np.asarray(decode_to_rgb(encode(rgba, "PNG"), CONFIG))
    assert rgb[0, 0].tolist() == [10, 20, 30]
    assert rgb[3, 3].tolist() == [255, 255, 255]
    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 0, 0, 200, 0, 0] + [0] * 762)
    palette.putpixel((1, 0), 1)
    rgb = np.asarray(decode_to_rgb(encode(palette, "PNG", transparency=0), CONFIG))
    assert rgb[0].tolist() == [[255, 255, 255], [200, 0, 0]]


def test_cmyk_and_grayscale_become_rgb():
    for image in (Image.new("CMYK", (8, 8), (0, 255, 255, 0)), Image.new("L", (8, 8), 77), Image.new("1", (8, 8), 1)):
        fmt = "JPEG" if image.mode == "CMYK" else "PNG"
        rgb = decode_to_rgb(encode(image, fmt, **({"quality": 95} if fmt == "JPEG" else {})), CONFIG)
        assert rgb.mode == "RGB" and rgb.size == (8, 8)
    red = np.asarray(decode_to_rgb(encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG", quality=95), CONFIG))
    assert red[4, 4, 0] > 200 and red[4, 4, 1] < 40 and red[4, 4, 2] < 40


def test_animated_gif_uses_the_first_frame():
    first = Image.new("P", (8, 8), 0)
    first.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    second = Image.new("P", (8, 8), 1)
    second.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    data = encode(first, "GIF", save_all=True, append_images=[second], duration=50)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    assert np.asarray(decode_to_rgb(data, CONFIG))[0, 0].tolist() == [255, 0, 0]


def test_extreme_aspect_ratio_is_cheap():
    strip = encode(Image.new("RGB", (1, 20000), (9, 99, 199)), "PNG")
    started = time.perf_counter()
    pixels = preprocess_image(strip)
    assert time.perf_counter() - started < 2.0  # never materializes the 256 x 5,120,000 resize
    assert pixels.shape == (3, 224, 224)
    np.testing.assert_allclose(denormalize(pixels)[100, 100], [9, 99, 199], atol=0.5)


# --- refusals -----------------------------------------------------------------------------------


JPEG = (DATA / "scene.jpg").read_bytes()


@pytest.mark.parametrize("data, message", [
    (b"", "is empty (0 bytes)"),
    (os.urandom(2048), "not a recognized image"),
    (b"hello, this is a text file\n" * 20, "not a recognized image"),
    (JPEG[: len(JPEG) // 2], "truncated or corrupt JPEG"),
    (png_bomb(20000, 20000), "decompression bomb"),
    (encode(Image.new("RGB", (8, 8)), "TIFF"), "not a recognized image"),  # a real format we refuse
    (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "not a recognized image"),
])
def test_bad_inputs_raise_input_errors_naming_the_problem(data, message):
    with pytest.raises(InputError, match=re.escape(message)) as info:
        preprocess_image(data, CONFIG, name="image[3]")
    assert "image[3]" in str(info.value)


def test_payload_and_pixel_limits():
    with pytest.raises(InputError, match="is 8328 bytes; the limit is 1000 bytes"):
        preprocess_image(JPEG, PreprocessConfig(max_image_bytes=1000))
    with pytest.raises(InputError, match="320x240 = 76800 pixels; the limit is 70000"):
        preprocess_image(JPEG, PreprocessConfig(max_image_pixels=70000))


def test_a_bad_image_fails_only_its_own_request():
    preprocessor = ImagePreprocessor(threads=2)
    try:
        good = np.array([[JPEG]], dtype=object)
        mixed = np.array([[JPEG], [b"garbage"]], dtype=object)
        empty = np.zeros((0, 1), dtype=object)
        result = preprocessor.run([good, mixed, good, empty])
    finally:
        preprocessor.close()
    assert result.outputs[0].shape == (1, 3, 224, 224)
    assert isinstance(result.outputs[1], InputError) and "image[1]" in str(result.outputs[1])
    np.testing.assert_array_equal(result.outputs[2], result.outputs[0])
    assert isinstance(result.outputs[3], InputError) and "empty batch" in str(result.outputs[3])
    np.testing.assert_array_equal(result.outputs[0][0], preprocess_image(JPEG))
    assert result.timing.decode_s > 0 and result.timing.transform_s > 0


def test_jpeg_draft_decodes_large_jpegs_at_reduced_scale():
    large = encode(Image.open(DATA / "scene.jpg").resize((1280, 960)), "JPEG", quality=90)
    exact = preprocess_image(large)
    drafted = decode_to_rgb(large, PreprocessConfig(jpeg_draft=True))
    assert drafted.size == (640, 480)  # 1/2 scale still covers the 341x256 resize
    close = preprocess_image(large, PreprocessConfig(jpeg_draft=True))
    assert np.abs(denormalize(close) - denormalize(exact)).mean() < 3


# --- postprocessing -----------------------------------------------------------------------------


def test_softmax_top_k_and_labels():
    logits = np.array([[1.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 10.0]], dtype=np.float32)
    probabilities = softmax(logits)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-6)
    e = np.exp(logits[0] - 3.0)
    np.testing.assert_allclose(probabilities[0], e / e.sum(), rtol=1e-6)
    ids, scores = top_k(probabilities, 3)
    assert ids.tolist() == [[1, 3, 2], [3, 0, 1]]  # ties keep the lower class id first
    assert ids.dtype == np.int64 and (np.diff(scores, axis=1) <= 0).all()
    classifier = Classifier(["a", "b", "c", "d"])
    labels, scores, ids = classifier.classify(logits, 2)
    assert labels.tolist() == [[b"b", b"d"], [b"d", b"a"]] and scores.dtype == np.float32
    assert classifier.classify(logits, 50)[0].shape == (2, 4)  # k is capped at the class count
    with pytest.raises(InputError, match=r"logits must be \[n, 4\]"):
        classifier.classify(np.zeros((1, 5), np.float32), 1)


def test_parse_top_k():
    assert parse_top_k({}) == 5
    assert parse_top_k({"top_k": 1}) == 1
    assert parse_top_k({"top_k": 100}) == 100
    assert parse_top_k({"top_k": "7"}) == 7
    for bad in (0, 101, -3, True, 2.5, "five", None):
        with pytest.raises(InputError, match="request parameter 'top_k'"):
            parse_top_k({"top_k": bad})


def test_the_recipe_comes_from_the_config_parameters():
    """The builder writes the served classifier's recipe (vision_models.Preprocessing) as strings."""
    config = PreprocessConfig.from_parameters({"mean": "0.5,0.5,0.5", "std": "0.25, 0.25, 0.25",
                                               "resize_shorter_side": "182", "crop_size": "160", "jpeg_draft": "true"})
    assert (config.mean, config.std, config.resize_shorter_side, config.crop_size, config.jpeg_draft) == (
        (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), 182, 160, True)
    assert PreprocessConfig.from_parameters({}) == PreprocessConfig()
    image = Image.new("RGB", (300, 200), (255, 128, 0))
    pixels = preprocess_image(encode(image, "PNG"), config)
    assert pixels.shape == (3, 160, 160)
    np.testing.assert_allclose(pixels[:, 80, 80], [(1 - 0.5) / 0.25, (128 / 255 - 0.5) / 0.25, -2.0], atol=1e-6)
    with pytest.raises(ConfigError, match="parameter mean must be 3 comma-separated numbers"):
        PreprocessConfig.from_parameters({"mean": "0.5,0.5"})


def test_imagenet_labels():
    labels = imagenet_labels()
    assert len(labels) == 1000
    assert labels[0] == "tench" and labels[207] == "Golden Retriever"
    assert all(label and "\n" not in label for label in labels)


# --- gpu target -----------------------------------------------------------------------------------


def classifier_description(backend: str):
    from repo_builder.compute import ComputeModel, TensorSpec

    return ComputeModel(name="efficientnet_lite0", inputs=(TensorSpec("pixel_values", "TYPE_FP32", (3, 224, 224)),),
                        outputs=(TensorSpec("logits", "TYPE_FP32", (1000,)),), max_batch_size=32,
                        export_onnx=lambda path: None, gpu_backend=backend, trt_opt_batch_size=16)


@pytest.mark.parametrize("backend", ["onnxruntime_onnx", "onnxruntime_trt", "tensorrt_plan"])
def test_gpu_backend_configs_parse_as_model_config(backend):
    config = classifier_description(backend).config("gpu")
    reparsed = text_format.Parse(text_format.MessageToString(config), mc.ModelConfig())
    assert reparsed == config
    assert reparsed.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
    accelerators = reparsed.optimization.execution_accelerators.gpu_execution_accelerator
    if backend == "tensorrt_plan":
        assert (reparsed.platform, reparsed.default_model_filename) == ("tensorrt_plan", "model.plan")
        assert not accelerators
    else:
        assert (reparsed.platform, reparsed.default_model_filename) == ("onnxruntime_onnx", "model.onnx")
    if backend == "onnxruntime_trt":
        (trt,) = accelerators
        # Keys the onnxruntime backend (r24.10 src/onnxruntime.cc) accepts for its "tensorrt"
        # accelerator, the explicit profile included (it replaces the former warm-up workaround).
        assert trt.name == "tensorrt" and dict(trt.parameters) == {
            "precision_mode": "FP16", "max_workspace_size_bytes": "1073741824",
            "trt_engine_cache_enable": "1", "trt_engine_cache_path": "/trt_cache",
            "trt_profile_min_shapes": "pixel_values:1x3x224x224",
            "trt_profile_opt_shapes": "pixel_values:16x3x224x224",
            "trt_profile_max_shapes": "pixel_values:32x3x224x224"}
    # every compute model is warmed at batch 1 (compute.ComputeModel._add_warmup); on ORT-TRT that
    # builds the engine for the whole profile at load
    assert [w.batch_size for w in reparsed.model_warmup] == [1]
    assert all(w.inputs["pixel_values"].zero_data for w in reparsed.model_warmup)
    # The embedded target does not depend on the gpu backend.
    assert classifier_description(backend).config("embedded") == classifier_description("onnxruntime_onnx").config("embedded")


def test_trtexec_args_cover_batch_1_to_max():
    assert classifier_description("tensorrt_plan").trtexec_args() == [
        "--fp16", "--minShapes=pixel_values:1x3x224x224", "--optShapes=pixel_values:16x3x224x224",
        "--maxShapes=pixel_values:32x3x224x224"]


def test_vision_pipeline_flag_selects_the_gpu_backend(tmp_path):
    from repo_builder.__main__ import parse_context

    for backend in ("onnxruntime_onnx", "onnxruntime_trt", "tensorrt_plan"):
        context, pipelines = parse_context(["--target", "gpu", "--output", str(tmp_path), "--pipelines", "vision",
                                            "--image-gpu-backend", backend])
        (model,) = [m for pipeline in pipelines for m in pipeline.compute_models(context)]
        assert model.gpu_backend == backend
        config = model.config("gpu")
        assert config.platform == ("tensorrt_plan" if backend == "tensorrt_plan" else "onnxruntime_onnx")


def test_trt_engine_script_builds_once_and_links_variants(tmp_path):
    """docker/build_trt_engines.sh with a stand-in trtexec that records its flags."""
    repository = tmp_path / "repo"
    base = repository / "efficientnet_lite0" / "1"
    base.mkdir(parents=True)
    (base / "model.onnx").write_bytes(b"onnx")
    (base / "trtexec.args").write_text("\n".join(classifier_description("tensorrt_plan").trtexec_args()) + "\n")
    variant = repository / "efficientnet_lite0_batch" / "1"
    variant.mkdir(parents=True)
    for name in ("model.onnx", "trtexec.args"):
        (variant / name).symlink_to(Path("..") / ".." / "efficientnet_lite0" / "1" / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "trtexec.log"
    fake = bin_dir / "trtexec"
    fake.write_text("#!/usr/bin/env bash\necho \"$@\" >> " + str(log) + "\n"
                    "for a in \"$@\"; do case $a in --saveEngine=*) echo plan > \"${a#--saveEngine=}\";; esac; done\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    script = ROOT / "docker" / "build_trt_engines.sh"
    for _ in range(2):
        subprocess.run(["bash", str(script), str(repository)], env=env, check=True, capture_output=True)
    calls = log.read_text().splitlines()
    assert len(calls) == 1, calls  # the second run finds the plan up to date; the variant links it
    assert f"--onnx={base / 'model.onnx'}" in calls[0] and "--fp16" in calls[0]
    assert "--minShapes=pixel_values:1x3x224x224" in calls[0] and "--maxShapes=pixel_values:32x3x224x224" in calls[0]
    assert (base / "model.plan").read_text() == "plan\n"
    assert (variant / "model.plan").resolve() == (base / "model.plan").resolve()
    (base / "trtexec.args").write_text("--fp16\n--minShapes=pixel_values:1x3x224x224\n")
    subprocess.run(["bash", str(script), str(repository)], env=env, check=True, capture_output=True)
    assert len(log.read_text().splitlines()) == 2  # other flags → rebuilt
