"""What Triton hands a Python model's ``initialize(args)``, read the same way by every adapter."""

from __future__ import annotations

import json
from pathlib import Path

from triton_pipelines.stub.tracing import MODEL
from triton_pipelines.telemetry import tracing


def model_parameters(args: dict) -> dict[str, str]:
    """The ``parameters`` of the model's config as plain strings."""
    config = json.loads(args["model_config"])
    MODEL["name"] = args.get("model_name") or config.get("name") or MODEL["name"]  # its spans' name (stub/tracing.py)
    tracing.enabled()  # tracing set up at load (its imports), not in a first traced request
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


def version_dir(args: dict) -> Path:
    """The folder of the version being loaded (``<model>/<version>/``), where the builder puts the
    files the model reads (tokenizer, labels, prototypes, ONNX file ...)."""
    return Path(args["model_repository"]) / args["model_version"]
