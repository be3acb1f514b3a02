"""Encoder states → sentence embedding: masked mean pooling and unit L2 norm."""

import triton_python_backend_utils as pb_utils

from triton_pipelines.text import mean_pool_normalize


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            hidden = pb_utils.get_input_tensor_by_name(request, "last_hidden_state").as_numpy()
            mask = pb_utils.get_input_tensor_by_name(request, "attention_mask").as_numpy()
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("embedding", mean_pool_normalize(hidden, mask))]))
        return responses
