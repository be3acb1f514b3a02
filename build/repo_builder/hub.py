"""Weights named by Hugging Face id (``owner/name[@revision]``) or by local folder, resolved to a
local folder with its provenance (``triton_pipelines.repository.contract.Provenance``).

Interface shared by the pipelines (text, vision, speech): ``resolve_model``. A model that was asked
for and cannot be had raises ``WeightsError``: one line naming the model and the remedy.

(Skeleton: folders only; the hub download through ``huggingface_hub`` is issue 32's next step.)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from triton_pipelines.errors import ConfigError
from triton_pipelines.repository.contract import Provenance

# Weight files whose sha256 goes into the provenance.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pth", "*.pt", "*.onnx")


class WeightsError(ConfigError):
    """A model asked for by id or folder that cannot be had (one line: the model and the remedy)."""


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # a local folder holding the files
    provenance: Provenance


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weight_files(folder: Path, patterns: Sequence[str] = WEIGHT_PATTERNS) -> tuple[tuple[str, str], ...]:
    """(relative file, sha256) of each weight file under ``folder``, sorted."""
    files = sorted({p for pattern in patterns for p in folder.rglob(pattern) if p.is_file()})
    return tuple((str(p.relative_to(folder)), sha256_of(p)) for p in files)


def resolve_model(spec: str, allow_patterns: Sequence[str], *, architecture: str, licence: str = "",
                  parameters: int = 0, flag: str = "--model") -> ResolvedModel:
    """``spec``: an existing folder, or ``owner/name[@revision]`` on the Hugging Face hub.
    ``allow_patterns``: the files a hub download fetches. ``flag``: named in errors."""
    folder = Path(spec).expanduser()
    if folder.is_dir():
        return ResolvedModel(folder.resolve(), Provenance(
            kind="folder", source=str(folder.resolve()), architecture=architecture, parameters=parameters,
            licence=licence, files=weight_files(folder)))
    raise WeightsError(f"{flag} {spec}: no such folder (models by Hugging Face id are not supported yet)")
