"""A sentence-transformers model folder, read as sentence-transformers reads it: what ``text_encoder``
exports (the pooling, the normalisation) and how the tokenizer truncates, from the model's own files.

- ``modules.json``: the modules in order. A ``Transformer`` (the encoder), a ``Pooling`` (its
  folder's ``config.json``: ``pooling_mode_cls_token`` or ``pooling_mode_mean_tokens``), and
  optionally a ``Normalize`` (unit L2 norm). Other modules (``Dense``, ...) are refused in one
  line rather than served wrong.
- No ``modules.json`` (a plain Hugging Face checkpoint): sentence-transformers' own default for
  such a model, mean pooling without normalisation; the table says so.
- The truncation length: ``sentence_bert_config.json``'s ``max_seq_length``, else the tokenizer's
  ``model_max_length`` (``tokenizer_config.json``), else the encoder's ``max_position_embeddings``;
  never more than the latter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .hub import WeightsError

POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean"}
UNSUPPORTED_POOLING = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                       "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")
TRANSFORMER, POOLING, NORMALIZE = "Transformer", "Pooling", "Normalize"
# A tokenizer_config.json without a real limit says so with a huge model_max_length (1e30).
_NO_LIMIT = 1_000_000


def _json(path: Path, what: str) -> dict | list:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise WeightsError(f"{what}: cannot read {path.name} ({type(error).__name__}: {error})") from None


@dataclass(frozen=True)
class SentenceModel:
    pooling: str  # "cls" or "mean"
    normalize: bool
    max_sequence_length: int
    hidden_size: int
    layers: int
    model_type: str
    defaulted: bool = False  # no modules.json: sentence-transformers' defaults for a plain model

    @classmethod
    def read(cls, folder: Path, what: str, fallback_length: int) -> "SentenceModel":
        """``what``: named in errors (the flag and the model). ``fallback_length``: the truncation
        when no file states one."""
        config = _json(folder / "config.json", what)
        hidden = config.get("hidden_size")
        if not isinstance(hidden, int):
            raise WeightsError(f"{what}: config.json has no hidden_size (not a BERT-family encoder)")
        positions = int(config.get("max_position_embeddings") or 0)
        pooling, normalize, defaulted = cls._modules(folder, what)
        length = cls._max_length(folder, what) or positions or fallback_length
        if positions:
            length = min(length, positions)
        return cls(pooling=pooling, normalize=normalize, max_sequence_length=length, hidden_size=hidden,
                   layers=int(config.get("num_hidden_layers") or 0), model_type=str(config.get("model_type", "")),
                   defaulted=defaulted)

    @staticmethod
    def _modules(folder: Path, what: str) -> tuple[str, bool, bool]:
        if not (folder / "modules.json").is_file():
            return "mean", False, True
        modules = _json(folder / "modules.json", what)
        kinds = [str(module.get("type", "")).rsplit(".", 1)[-1] for module in modules]
        unknown = [kind for kind in kinds if kind not in (TRANSFORMER, POOLING, NORMALIZE)]
        if unknown or kinds[:2] != [TRANSFORMER, POOLING] or kinds[2:] not in ([], [NORMALIZE]):
            raise WeightsError(f"{what}: modules.json is {' → '.join(kinds)}; text_encoder serves Transformer → "
                               f"Pooling [→ Normalize] only")
        pooling_dir = folder / modules[1].get("path", "1_Pooling")
        flags = _json(pooling_dir / "config.json", what)
        chosen = [mode for flag, mode in POOLING_FLAGS.items() if flags.get(flag)]
        other = [flag for flag in UNSUPPORTED_POOLING if flags.get(flag)]
        if other or len(chosen) != 1:
            raise WeightsError(f"{what}: {pooling_dir.name}/config.json asks for "
                               f"{', '.join(other + [f for f in POOLING_FLAGS if flags.get(f)]) or 'no pooling'}; "
                               f"text_encoder serves exactly one of {', '.join(POOLING_FLAGS)}")
        return chosen[0], kinds[2:] == [NORMALIZE], False

    @staticmethod
    def _max_length(folder: Path, what: str) -> int:
        if (folder / "sentence_bert_config.json").is_file():
            stated = _json(folder / "sentence_bert_config.json", what).get("max_seq_length")
            if isinstance(stated, int) and stated > 0:
                return stated
        if (folder / "tokenizer_config.json").is_file():
            stated = _json(folder / "tokenizer_config.json", what).get("model_max_length")
            if isinstance(stated, (int, float)) and 0 < stated < _NO_LIMIT:
                return int(stated)
        return 0

    def describe(self, name: str) -> str:
        """The architecture column: e.g. ``BERT all-MiniLM-L6-v2: 6 layers, hidden 384, mean pooling,
        normalized, 256 tokens``."""
        pooling = f"{self.pooling} pooling" + (" (no modules.json: sentence-transformers' default)"
                                               if self.defaulted else "")
        return (f"{(self.model_type or 'bert').upper()} {name}: {self.layers} layers, hidden {self.hidden_size}, "
                f"{pooling}, {'normalized' if self.normalize else 'not normalized'}, "
                f"{self.max_sequence_length} tokens")
