"""Vision pipeline: ``resnet50`` (compute), ``image_preprocess`` and ``classification_postprocess``
(Python) and the ``image_classification`` ensemble.

Weights: ``--resnet50-checkpoint DIR`` (a local Hugging Face ``ResNetForImageClassification``
checkpoint, e.g. a copy of microsoft/resnet-50), else the microsoft/resnet-50 architecture
(``ResNetConfig(num_labels=1000)``: 25,557,032 parameters) with deterministic random weights (seed 0).

GPU target: ``--resnet50-gpu-backend`` chooses how the gpu target serves it (see ``compute.GPU_BACKENDS``):
``onnxruntime_onnx`` (CUDA EP), ``onnxruntime_trt`` (ORT with the TensorRT execution accelerator,
FP16) or ``tensorrt_plan`` (a ``model.plan`` that ``docker/build_trt_engines.sh`` builds with trtexec,
FP16, in the NGC TensorRT container before Triton starts).
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

from triton_pipelines.pipelines import vision

from .compute import GPU_BACKENDS, ComputeModel, TensorSpec
from .export.resnet import IMAGE_SIZE, NUM_CLASSES, RANDOM_SEED, export_resnet50
from .files import hash_files
from .pipeline import BuildContext, Pipeline

MAX_BATCH_SIZE = 32
LABELS_FILE = "labels.txt"


class VisionPipeline(Pipeline):
    python_models = ("image_preprocess", "classification_postprocess")
    runtime_parameters = vision.CONFIG_PARAMETERS
    ensembles = ("image_classification",)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--resnet50-checkpoint", type=Path, metavar="DIR",
                            help="a local Hugging Face ResNetForImageClassification checkpoint for resnet50 "
                                 "(1000 ImageNet classes); default: deterministic random weights")
        parser.add_argument("--resnet50-gpu-backend", choices=GPU_BACKENDS, default="onnxruntime_onnx",
                            help="gpu target only: serve resnet50 with ONNX Runtime (CUDA EP), ONNX Runtime "
                                 "with the TensorRT accelerator (onnxruntime_trt, FP16), or a TensorRT FP16 "
                                 "engine built by trtexec (tensorrt_plan; see docs/vision.md)")

    def compute_models(self, context: BuildContext) -> list[ComputeModel]:
        checkpoint = context.args.resnet50_checkpoint
        return [ComputeModel(
            name="resnet50",
            inputs=(TensorSpec("pixel_values", "TYPE_FP32", (3, IMAGE_SIZE, IMAGE_SIZE)),),
            outputs=(TensorSpec("logits", "TYPE_FP32", (NUM_CLASSES,)),),
            max_batch_size=MAX_BATCH_SIZE,
            export_onnx=partial(export_resnet50, checkpoint),
            source_key=hash_files(checkpoint) if checkpoint else f"resnet-50 random seed {RANDOM_SEED}",
            gpu_backend=context.args.resnet50_gpu_backend,
            trt_opt_batch_size=16,
        )]

    def write_assets(self, model_name: str, version_dir: Path, context: BuildContext) -> None:
        if model_name == "classification_postprocess":
            (version_dir / LABELS_FILE).write_text("\n".join(class_labels(context)) + "\n", encoding="utf-8")

    def model_table(self, context: BuildContext) -> list[dict]:
        checkpoint = context.args.resnet50_checkpoint
        return [{"model": "resnet50",
                 "architecture": "ResNet-50 (microsoft/resnet-50 configuration, 25.6M parameters)",
                 "weights": f"local checkpoint {checkpoint}" if checkpoint
                            else f"deterministic random (seed {RANDOM_SEED}): labels are not meaningful"}]


def class_labels(context: BuildContext) -> list[str]:
    """The checkpoint's id2label when it names real classes, else the ImageNet-1k names."""
    checkpoint = context.args.resnet50_checkpoint
    if checkpoint is not None and (checkpoint / "config.json").exists():
        import json

        id2label = json.loads((checkpoint / "config.json").read_text()).get("id2label") or {}
        labels = [str(id2label.get(str(i), "")) for i in range(NUM_CLASSES)]
        if all(labels) and not all(label.startswith("LABEL_") for label in labels):
            return labels
    from triton_pipelines.pipelines.vision import imagenet_labels

    return imagenet_labels()
