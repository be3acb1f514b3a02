"""Encoded images → normalized NCHW FP32 (triton_pipelines.vision). All images of the dynamic batch
are decoded in this one execute on the preprocessor's thread pool; a bad image fails only its request.

Custom metrics (Triton's /metrics): image_preprocess_decode_duration_us and
image_preprocess_transform_duration_us, summed over images, split the model's compute time."""

import triton_python_backend_utils as pb_utils

from triton_pipelines.backend import error_response, model_parameters
from triton_pipelines.vision import ImagePreprocessor, PreprocessConfig


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        self.preprocessor = ImagePreprocessor(
            PreprocessConfig(max_image_bytes=int(parameters["max_image_bytes"]),
                             max_image_pixels=int(parameters["max_image_pixels"]),
                             max_request_pixels=int(parameters["max_request_pixels"]),
                             jpeg_draft=parameters.get("jpeg_draft", "false").lower() in ("1", "true")),
            threads=int(parameters["decode_threads"]))
        labels = {"model": args["model_name"], "version": args["model_version"]}
        # The families must outlive their metrics: keep both.
        self.metric_families = [
            pb_utils.MetricFamily(
                name="image_preprocess_decode_duration_us",
                description="Cumulative time decoding images to RGB (header checks, decompression, "
                            "mode conversion)",
                kind=pb_utils.MetricFamily.COUNTER),
            pb_utils.MetricFamily(
                name="image_preprocess_transform_duration_us",
                description="Cumulative time resizing, cropping and normalizing decoded images",
                kind=pb_utils.MetricFamily.COUNTER),
        ]
        self.decode_us, self.transform_us = (family.Metric(labels=labels) for family in self.metric_families)

    def execute(self, requests):
        try:
            result = self.preprocessor.run(
                [pb_utils.get_input_tensor_by_name(request, "image").as_numpy() for request in requests])
        except Exception as error:  # a bug must fail this batch, not the stub
            return [error_response(RuntimeError(f"image_preprocess failed: {error}")) for _ in requests]
        self.decode_us.increment(result.timing.decode_s * 1e6)
        self.transform_us.increment(result.timing.transform_s * 1e6)
        return [
            error_response(output) if isinstance(output, Exception)
            else pb_utils.InferenceResponse([pb_utils.Tensor("pixel_values", output)])
            for output in result.outputs
        ]

    def finalize(self):
        self.preprocessor.close()
