"""ResNet (``resnet50``, ``resnet18`` ...) to ONNX: a Hugging Face ``ResNetForImageClassification``
checkpoint folder (``--image-model``: an id such as microsoft/resnet-50, or a folder), or, only on
the explicit request ``--image-model random:resnet50``, the microsoft/resnet-50 architecture with
deterministic random weights (benchmarks: their timing does not depend on the weights). This
module is hashed into the exported model's content key: a change here re-exports it."""

from __future__ import annotations

from pathlib import Path

RANDOM_NUM_CLASSES = 1000
RANDOM_SEED = 0
# ResNetConfig(num_labels=1000)'s model.parameters() (tests/unit/builder/test_vision_models.py counts them).
RANDOM_PARAMETERS = 25_557_032
OPSET = 17


def load_resnet(checkpoint: Path | None):
    """The model in eval mode: the checkpoint's, or (``None``) ResNet-50 with random weights (seed 0)."""
    import torch
    from transformers import ResNetConfig, ResNetForImageClassification

    if checkpoint is not None:
        model = ResNetForImageClassification.from_pretrained(str(checkpoint))
    else:
        torch.manual_seed(RANDOM_SEED)
        model = ResNetForImageClassification(ResNetConfig(num_labels=RANDOM_NUM_CLASSES))
    return model.eval()


def export_resnet(checkpoint: Path | None, image_size: int, onnx_path: Path) -> None:
    """``pixel_values [B, 3, S, S]`` → ``logits [B, classes]`` (S: ``image_size``), legacy exporter,
    dynamic batch axis."""
    import torch

    model = load_resnet(checkpoint)

    class Logits(torch.nn.Module):
        def __init__(self, resnet):
            super().__init__()
            self.resnet = resnet

        def forward(self, pixel_values):
            return self.resnet(pixel_values=pixel_values).logits

    example = torch.zeros((2, 3, image_size, image_size), dtype=torch.float32)
    with torch.no_grad():
        torch.onnx.export(
            Logits(model), (example,), str(onnx_path), input_names=["pixel_values"], output_names=["logits"],
            dynamic_axes={"pixel_values": {0: "batch"}, "logits": {0: "batch"}},
            opset_version=OPSET, dynamo=False,
        )
