"""What a pipeline contributes to the repository: compute models, Python models, ensembles, assets.

Each pipeline (text, vision, speech, routing) is one ``Part`` in its own module, registered in
``repo_builder.parts.PARTS``. The assembly in ``repository.py`` is the same for all of them.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from .compute import ComputeModel, LatencyVariant

ROOT_ENV = "TRITON_PIPELINES_ROOT"
# What makes a folder the project: the sources the builder assembles the repository from.
PROJECT_MARKERS = ("python_models", "ensembles", "data")


def is_project_root(path: Path) -> bool:
    return all((path / marker).is_dir() for marker in PROJECT_MARKERS)


def find_project_root(explicit: Path | None = None, environ=os.environ, cwd: Path | None = None) -> Path:
    """``--project-root``, else ``$TRITON_PIPELINES_ROOT``, else the working directory or the nearest
    parent of it that holds python_models/, ensembles/ and data/. Never the builder's install location
    (a non-editable install, as in the builder image, lives in site-packages)."""
    given = explicit or (Path(environ[ROOT_ENV]) if environ.get(ROOT_ENV) else None)
    if given is not None:
        if not is_project_root(given):
            raise FileNotFoundError(f"{given} is not the project: it lacks {', '.join(PROJECT_MARKERS)}")
        return given.resolve()
    here = (cwd or Path.cwd()).resolve()
    for candidate in (here, *here.parents):
        if is_project_root(candidate):
            return candidate
    raise FileNotFoundError(f"no project found at or above {here} (a folder with {', '.join(PROJECT_MARKERS)}): "
                            f"run from the project, or pass --project-root / set {ROOT_ENV}")


@dataclass
class BuildContext:
    target: str
    output: Path
    args: argparse.Namespace
    root: Path  # the project: python_models/, ensembles/, data/

    def compute_dir(self, name: str) -> Path:
        return self.output / name / "1"


class Part:
    # Folders under python_models/ and ensembles/ that this part owns.
    python_models: tuple[str, ...] = ()
    ensembles: tuple[str, ...] = ()
    # Latency classes of Python models that drive compute models through BLS (see variants.py).
    python_latency_variants: dict[str, tuple[LatencyVariant, ...]] = {}

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Builder flags of this part (weights sources, optional models)."""

    def compute_models(self, context: BuildContext) -> list[ComputeModel]:
        return []

    def adjust_compute_model(self, model: ComputeModel, context: BuildContext) -> ComputeModel:
        """Called with every part's compute models (e.g. the router adds canary versions)."""
        return model

    def patch_config(self, config: mc.ModelConfig, context: BuildContext) -> None:
        """Adjust a Python model's or ensemble's config to what was built (e.g. embedding width)."""

    def write_assets(self, model_name: str, version_dir: Path, context: BuildContext) -> None:
        """Put the files a Python model loads at ``initialize`` into its version folder.
        Called after every compute model is exported."""

    def model_table(self, context: BuildContext) -> list[dict]:
        """Rows for the README's model table: name, architecture, weights."""
        return []
