"""Embedded target only: a compute model (same name, tensors and batching as the native
``onnxruntime_onnx`` one) served by the Python backend running ONNX Runtime on the CPU.
The builder generates this model's config from the compute model's description."""

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from triton_pipelines.backend import error_response, model_parameters
from triton_pipelines.onnx_runner import OnnxBatchRunner


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = model_parameters(args)
        self.model_name = args["model_name"]
        version_dir = Path(args["model_repository"]) / args["model_version"]
        self.input_names = [i["name"] for i in config["input"]]
        self.output_names = [o["name"] for o in config["output"]]
        self.runner = OnnxBatchRunner(
            version_dir / parameters.get("onnx_file", "model.onnx"),
            intra_op_threads=int(parameters.get("intra_op_threads", "0")),
            output_names=self.output_names,
            pad_ragged=any(i.get("allow_ragged_batch", False) for i in config["input"]),
        )

    def execute(self, requests):
        feeds = [
            {name: pb_utils.get_input_tensor_by_name(request, name).as_numpy() for name in self.input_names}
            for request in requests
        ]
        try:
            results = self.runner.run(feeds)
        except Exception as error:  # an ONNX Runtime failure fails this batch, not the server
            return [error_response(RuntimeError(f"{self.model_name}: ONNX Runtime failed: {error}"))
                    for _ in requests]
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor(name, result[name]) for name in self.output_names])
            for result in results
        ]
