"""Logits → top-k (labels, scores, class_ids); k from the request parameter "top_k".
Class names are read from labels.txt, written by the repository builder."""

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from triton_pipelines.backend import error_response, model_parameters
from triton_pipelines.errors import InputError
from triton_pipelines.vision import Classifier, load_labels, parse_top_k


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        self.default_k = int(parameters["default_top_k"])
        self.max_k = int(parameters["max_top_k"])
        version_dir = Path(args["model_repository"]) / args["model_version"]
        self.classifier = Classifier(load_labels(version_dir / "labels.txt"))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                k = parse_top_k(json.loads(request.parameters() or "{}"), self.default_k, self.max_k)
                logits = pb_utils.get_input_tensor_by_name(request, "logits").as_numpy()
                labels, scores, class_ids = self.classifier.classify(logits, k)
            except InputError as error:
                responses.append(error_response(error))
                continue
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("labels", labels),
                pb_utils.Tensor("scores", scores),
                pb_utils.Tensor("class_ids", class_ids),
            ]))
        return responses
