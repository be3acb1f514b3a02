"""Text → BERT token ids, padded to a length bucket so Triton batches mixed lengths together."""

from triton_pipelines.stub.model_args import model_parameters, version_dir
from triton_pipelines.stub.responses import input_array, respond
from triton_pipelines.text import TextTokenizer, decode_texts, parse_buckets


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        self.max_text_bytes = int(parameters["max_text_bytes"])
        self.tokenizer = TextTokenizer(version_dir(args) / "tokenizer.json",
                                       max_length=int(parameters["max_sequence_length"]),
                                       buckets=parse_buckets(parameters["length_buckets"]))

    def execute(self, requests):
        return respond(requests, self.tokenize)

    def tokenize(self, request):
        tokens = self.tokenizer.encode(decode_texts(input_array(request, "text"), max_bytes=self.max_text_bytes))
        return {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}
