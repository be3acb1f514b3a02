"""Logits → top-k (labels, scores, class_ids); k from the request parameter "top_k".
Class names are read from labels.txt, written by the repository builder."""

from triton_pipelines.stub.model_args import model_parameters, version_dir
from triton_pipelines.stub.responses import input_array, request_parameters, respond
from triton_pipelines.pipelines.vision import Classifier, load_labels, parse_top_k


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        self.default_k = int(parameters["default_top_k"])
        self.max_k = int(parameters["max_top_k"])
        self.classifier = Classifier(load_labels(version_dir(args) / "labels.txt"))

    def execute(self, requests):
        return respond(requests, self.classify)

    def classify(self, request):
        k = parse_top_k(request_parameters(request), self.default_k, self.max_k)
        labels, scores, class_ids = self.classifier.classify(input_array(request, "logits"), k)
        return {"labels": labels, "scores": scores, "class_ids": class_ids}
