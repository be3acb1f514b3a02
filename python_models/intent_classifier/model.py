"""Sentence embedding → best customer-support intent and its probability.

The prototypes (one unit vector per intent) are computed by the repository builder with the served
encoder and loaded once here; a request costs one [batch, dim] x [dim, intents] product."""

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from triton_pipelines.text import IntentPrototypes


class TritonPythonModel:
    def initialize(self, args):
        version_dir = Path(args["model_repository"]) / args["model_version"]
        self.prototypes = IntentPrototypes.load(version_dir / "intent_prototypes.npz")

    def execute(self, requests):
        responses = []
        for request in requests:
            embedding = pb_utils.get_input_tensor_by_name(request, "embedding").as_numpy()
            labels, scores = self.prototypes.classify(embedding)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("label", np.array(labels, dtype=np.object_).reshape(-1, 1)),
                pb_utils.Tensor("score", scores.reshape(-1, 1)),
            ]))
        return responses
