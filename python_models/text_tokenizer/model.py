"""Text → BERT token ids, padded to the request's longest text, or to a length bucket where the encoder
needs equal shapes (gpu target: src/triton_pipelines/pipelines/text.py)."""

from triton_pipelines.stub.model_args import model_parameters, version_dir
from triton_pipelines.stub.responses import input_array, respond
from triton_pipelines.pipelines.text import TextTokenizer, decode_texts


class TritonPythonModel:
    def initialize(self, args):
        parameters = model_parameters(args)
        self.max_text_bytes = int(parameters["max_text_bytes"])
        self.tokenizer = TextTokenizer.from_parameters(version_dir(args) / "tokenizer.json", parameters)

    def execute(self, requests):
        return respond(requests, self.tokenize)

    def tokenize(self, request):
        tokens = self.tokenizer.encode(decode_texts(input_array(request, "text"), max_bytes=self.max_text_bytes))
        return {"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}
