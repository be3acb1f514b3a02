"""Greedy Whisper decoding over BLS, shared by ``whisper_decode`` and ``speech_recognition_stream``:
their parameters, the Whisper tokenizer, one encoder pass per group of windows and one
``whisper_decoder`` call per step (``triton_pipelines.pipelines.speech.decoding.GreedyDecoder``).

The cross-attention K/V do not change between steps: on the gpu target they are passed on as the
encoder response's own (device) tensors; on the embedded target, where every BLS input and output
is copied between the stubs, the first step sends them and later steps name the decoder's cached
copy (``input_cache_key``, this instance's slot). There the decoder also keeps the self-attention
K/V between steps: later steps send only the new tokens and get only the logits back."""

from __future__ import annotations

import os

import triton_python_backend_utils as pb_utils

from triton_pipelines.pipelines.speech.decoding import GreedyDecoder, cross_names
from triton_pipelines.pipelines.speech.jobs import decode_group_size
from triton_pipelines.pipelines.speech.tokenizer import WhisperTokenizer
from triton_pipelines.stub.bls import call, gather_rows
from triton_pipelines.stub.heap import keep_freed_heap
from triton_pipelines.stub.model_args import model_parameters, version_dir


class WhisperBls:
    def __init__(self, args: dict):
        p = self.parameters = model_parameters(args)
        keep_freed_heap(p)
        self.encoder_model, self.decoder_model = p["encoder_model"], p["decoder_model"]
        self.defaults = {"default_language": p["default_language"], "default_task": p["default_task"],
                         "default_timestamps": p["default_timestamps"], "default_max_new_tokens": int(p["max_new_tokens"])}
        self.encoder_batch = int(p["encoder_max_batch_size"])
        caches_cross = p.get("decoder_input_cache", "false") == "true"
        self.group_size = decode_group_size(int(p["decoder_max_batch_size"]), self.encoder_batch)
        vocab_size = int(p["vocab_size"])
        self.tokenizer = WhisperTokenizer.for_vocab_size(version_dir(args) / "multilingual.tiktoken", vocab_size)
        self.cross_names = cross_names(int(p["decoder_layers"]))
        # With the cache, the decoder keeps this instance's current group under this key.
        key = f"{args['model_name']}/{args['model_instance_name']}/{os.getpid()}" if caches_cross else None
        self.decoder = GreedyDecoder(self.tokenizer, vocab_size, self.step, gather_rows, cache_key=key, align=self.align)

    def group(self, features, prompts, max_new_tokens, on_step=None):
        """One group of windows (at most one encoder call's worth: ``decode_group_size``): the
        encoder, then the greedy loop → generated ids per window."""
        cross = call(self.encoder_model, [pb_utils.Tensor("input_features", features)], self.cross_names)
        _, heads, _, head_dim = cross["cross_value_0"].shape()
        # Finished windows leave the batch when their rows can be gathered here (CPU tensors); with
        # the cross K/V on a GPU they stay in the batch and their tokens are ignored.
        compact = all(tensor.is_cpu() for tensor in cross.values())
        return self.decoder.decode(prompts, max_new_tokens, cross, heads, head_dim, compact, on_step=on_step)

    def align(self, input_ids, past, cross, parameters):
        """The word-timestamp call (``speech.AlignStep``): every token fed at once, only the
        alignment heads' cross-attention back."""
        inputs = [pb_utils.Tensor("input_ids", input_ids), pb_utils.Tensor("past_self_kv", past), *cross.values()]
        outputs = call(self.decoder_model, inputs, ["alignment_weights"], cpu_outputs=True, parameters=parameters)
        return outputs["alignment_weights"].as_numpy()

    def step(self, input_ids, past, cross, parameters):
        """One decoder call (``speech.DecoderStep``): with an ``input_cache_key`` the decoder keeps
        present_self_kv, so only the logits come back (and ``past`` None is not sent)."""
        inputs = [pb_utils.Tensor("input_ids", input_ids), *cross.values()]
        if past is not None:
            inputs.insert(1, pb_utils.Tensor("past_self_kv", past))
        keeps_state = "input_cache_key" in parameters
        outputs = call(self.decoder_model, inputs, ["logits"] if keeps_state else ["logits", "present_self_kv"],
                       cpu_outputs=True, parameters=parameters)
        return outputs["logits"].as_numpy(), None if keeps_state else outputs["present_self_kv"].as_numpy()
