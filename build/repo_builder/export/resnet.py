"""ResNet-50 (``resnet50``) to ONNX: a local Hugging Face ``ResNetForImageClassification``
checkpoint, or the microsoft/resnet-50 architecture with deterministic random weights. This module
is hashed into the exported model's content key: a change here re-exports it."""

from __future__ import annotations

from pathlib import Path

NUM_CLASSES = 1000
IMAGE_SIZE = 224
RANDOM_SEED = 0
OPSET = 17


def load_resnet50(checkpoint: Path | None):
    import torch
    from transformers import ResNetConfig, ResNetForImageClassification

    if checkpoint is not None:
        model = ResNetForImageClassification.from_pretrained(str(checkpoint))
    else:
        torch.manual_seed(RANDOM_SEED)
        model = ResNetForImageClassification(ResNetConfig(num_labels=NUM_CLASSES))
    return model.eval()


def export_resnet50(checkpoint: Path | None, onnx_path: Path) -> None:
    """``pixel_values [B, 3, 224, 224]`` → ``logits [B, 1000]``, legacy exporter, dynamic batch axis."""
    import torch

    model = load_resnet50(checkpoint)

    class Logits(torch.nn.Module):
        def __init__(self, resnet):
            super().__init__()
            self.resnet = resnet

        def forward(self, pixel_values):
            return self.resnet(pixel_values=pixel_values).logits

    example = torch.zeros((2, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.float32)
    with torch.no_grad():
        torch.onnx.export(
            Logits(model), (example,), str(onnx_path), input_names=["pixel_values"], output_names=["logits"],
            dynamic_axes={"pixel_values": {0: "batch"}, "logits": {0: "batch"}},
            opset_version=OPSET, dynamo=False,
        )
