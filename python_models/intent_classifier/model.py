"""Sentence embedding → best customer-support intent and its probability.

The prototypes (one unit vector per intent) are computed by the repository builder with the served
encoder and loaded once here; a request costs one [batch, dim] x [dim, intents] product."""

from triton_pipelines.stub.model_args import version_dir
from triton_pipelines.stub.responses import input_array, respond
from triton_pipelines.pipelines.text import IntentPrototypes


class TritonPythonModel:
    def initialize(self, args):
        self.prototypes = IntentPrototypes.load(version_dir(args) / "intent_prototypes.npz")

    def execute(self, requests):
        return respond(requests, lambda request: self.prototypes.outputs(input_array(request, "embedding")))
