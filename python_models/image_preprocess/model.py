"""Encoded images → normalized NCHW FP32 (triton_pipelines.pipelines.vision). All images of the dynamic batch
are decoded in this one execute on the preprocessor's thread pool; a bad image fails only its request.

Custom metrics (Triton's /metrics): image_preprocess_decode_duration_us and
image_preprocess_transform_duration_us, summed over images, split the model's compute time."""

from triton_pipelines.stub.metrics import PreprocessMetrics
from triton_pipelines.stub.model_args import model_parameters
from triton_pipelines.stub.responses import input_array, respond
from triton_pipelines.pipelines.vision import ImagePreprocessor, PreprocessConfig


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        # Every limit is a parameter of config.pbtxt named like its PreprocessConfig field.
        self.preprocessor = ImagePreprocessor(PreprocessConfig.from_parameters(parameters),
                                              threads=int(parameters["decode_threads"]))
        self.metrics = PreprocessMetrics(args["model_name"], args["model_version"])

    def execute(self, requests):
        return respond(requests, lambda request: input_array(request, "image"), self.preprocess,
                       failure="image_preprocess failed")

    def preprocess(self, images):
        result = self.preprocessor.run(images)
        self.metrics.record(result.timing)
        return [output if isinstance(output, Exception) else {"pixel_values": output} for output in result.outputs]

    def finalize(self):
        self.preprocessor.close()
