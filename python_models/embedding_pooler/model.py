"""Encoder states → sentence embedding: masked mean pooling and unit L2 norm."""

from triton_pipelines.stub.responses import input_array, respond
from triton_pipelines.text import mean_pool_normalize


class TritonPythonModel:
    def execute(self, requests):
        return respond(requests, lambda request: {"embedding": mean_pool_normalize(
            input_array(request, "last_hidden_state"), input_array(request, "attention_mask"))})
