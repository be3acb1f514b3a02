"""Template, not a served model: the builder copies this file into every compute model's version
folder on the embedded target (``model_repository/<model>/<version>/model.py``). There the Python
backend runs the model's ONNX file with ONNX Runtime on the CPU, with the same name, tensors and
batching as the native ``onnxruntime_onnx`` model of the gpu target (the embedded tritonserver has
no ONNX Runtime backend). The builder generates the config. Logic, the input cache included:
``triton_pipelines.pipelines.onnx_runner.EmbeddedComputeModel``."""

import json

from triton_pipelines.pipelines.onnx_runner import EmbeddedComputeModel
from triton_pipelines.stub.heap import keep_freed_heap
from triton_pipelines.stub.model_args import model_parameters, version_dir
from triton_pipelines.stub.responses import input_array, request_parameters, respond


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        keep_freed_heap(parameters)
        self.model = EmbeddedComputeModel.from_config(args["model_name"], json.loads(args["model_config"]),
                                                      parameters, version_dir(args))

    def execute(self, requests):
        return respond(requests, self.parse, self.run)

    def parse(self, request):
        given = {name: input_array(request, name) for name in self.model.input_names}
        feeds = self.model.feeds({name: array for name, array in given.items() if array is not None},
                                 request_parameters(request))
        return feeds, request.requested_output_names()

    def run(self, works):
        return self.model.run([feeds for feeds, _ in works], [wanted for _, wanted in works])
