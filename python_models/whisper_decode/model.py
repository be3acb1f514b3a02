"""Greedy Whisper decoding driven by BLS calls to ``whisper_encoder`` and ``whisper_decoder``.

All requests of one dynamic batch are decoded together: their windows go through the encoder in
one call (per ``encoder_max_batch_size``), then every decoder step is one call for all windows
still running. The cross-attention K/V do not change between steps: on the gpu target they are
passed on as the encoder response's own (device) tensors; on the embedded target, where every BLS
input is copied into the callee's stub, the first step sends them and later steps name the
decoder's cached copy (``input_cache_key``). Request parsing, the decoding loop and the outputs:
``triton_pipelines.speech`` (``plan_request``, ``GreedyDecoder``, ``transcript_outputs``)."""

import os

import triton_python_backend_utils as pb_utils

from triton_pipelines.speech import (GreedyDecoder, WhisperTokenizer, cross_names, decode_group_size, decode_jobs,
                                     plan_request, transcript_outputs)
from triton_pipelines.stub.bls import call, call_in_batches, gather_rows
from triton_pipelines.stub.model_args import model_parameters, version_dir
from triton_pipelines.stub.responses import input_array, respond

OPTIONAL_INPUTS = ("num_windows", "language", "task", "max_new_tokens")


class TritonPythonModel:
    def initialize(self, args):
        p = model_parameters(args)
        self.encoder_model, self.decoder_model = p["encoder_model"], p["decoder_model"]
        self.defaults = {"default_language": p["default_language"], "default_task": p["default_task"],
                         "default_max_new_tokens": int(p["max_new_tokens"])}
        self.encoder_batch = int(p["encoder_max_batch_size"])
        caches_cross = p.get("decoder_input_cache", "false") == "true"
        self.group_size = decode_group_size(int(p["decoder_max_batch_size"]), self.encoder_batch, caches_cross)
        vocab_size = int(p["vocab_size"])
        self.tokenizer = WhisperTokenizer.for_vocab_size(version_dir(args) / "multilingual.tiktoken", vocab_size)
        self.cross_names = cross_names(int(p["decoder_layers"]))
        # With the cache, the decoder keeps this instance's current group under this key.
        key = f"{args['model_name']}/{args['model_instance_name']}/{os.getpid()}" if caches_cross else None
        self.decoder = GreedyDecoder(self.tokenizer, vocab_size, self.step, gather_rows, cache_key=key)

    def execute(self, requests):
        return respond(requests, self.plan, self.decode)

    def plan(self, request):
        return plan_request(self.tokenizer, input_array(request, "input_features"),
                            *(input_array(request, name) for name in OPTIONAL_INPUTS), **self.defaults)

    def decode(self, jobs):
        return [transcript_outputs(self.tokenizer, items) for items in decode_jobs(jobs, self.group_size, self.group)]

    def group(self, features, prompts, max_new_tokens):
        cross = call_in_batches(self.encoder_model, "input_features", features, self.encoder_batch, self.cross_names)
        _, heads, _, head_dim = cross["cross_value_0"].shape()
        # Finished windows leave the batch when their rows can be gathered here (CPU tensors); with
        # the cross K/V on a GPU they stay in the batch and their tokens are ignored.
        compact = all(tensor.is_cpu() for tensor in cross.values())
        return self.decoder.decode(prompts, max_new_tokens, cross, heads, head_dim, compact)

    def step(self, input_ids, past, cross, parameters):
        inputs = [pb_utils.Tensor("input_ids", input_ids), pb_utils.Tensor("past_self_kv", past), *cross.values()]
        outputs = call(self.decoder_model, inputs, ["logits", "present_self_kv"], cpu_outputs=True,
                       parameters=parameters)
        return outputs["logits"].as_numpy(), outputs["present_self_kv"].as_numpy()
