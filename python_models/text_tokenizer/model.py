"""Text → BERT token ids, padded to a length bucket so Triton batches mixed lengths together."""

from pathlib import Path

import triton_python_backend_utils as pb_utils

from triton_pipelines.backend import error_response, model_parameters
from triton_pipelines.errors import InputError
from triton_pipelines.text import TextTokenizer, decode_texts, parse_buckets


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        self.max_text_bytes = int(parameters["max_text_bytes"])
        version_dir = Path(args["model_repository"]) / args["model_version"]
        self.tokenizer = TextTokenizer(version_dir / "tokenizer.json",
                                       max_length=int(parameters["max_sequence_length"]),
                                       buckets=parse_buckets(parameters["length_buckets"]))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                texts = decode_texts(pb_utils.get_input_tensor_by_name(request, "text").as_numpy(),
                                     max_bytes=self.max_text_bytes)
            except InputError as error:
                responses.append(error_response(error))
                continue
            tokens = self.tokenizer.encode(texts)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("input_ids", tokens.input_ids),
                pb_utils.Tensor("attention_mask", tokens.attention_mask),
            ]))
        return responses
