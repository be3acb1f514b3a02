"""What a pipeline contributes to the repository: compute models, Python models, ensembles, assets.

Each pipeline (text, vision, speech, router) is one ``Pipeline`` in its own module
(``<name>_pipeline.py``), registered in ``repo_builder.pipelines.PIPELINES``. The assembly in
``repository.py`` is the same for all of them. How a compute model's ONNX is made (PyTorch export,
graph surgery) lives in ``repo_builder.export``, not here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from tritonclient.grpc import model_config_pb2 as mc

from .compute import ComputeModel, LatencyVariant


@dataclass
class BuildContext:
    target: str
    output: Path
    args: argparse.Namespace
    root: Path  # the project: python_models/, ensembles/, data/ (project.find_project_root)
    # What a pipeline resolved once per build (e.g. weights fetched by id), by the pipeline's key.
    resolved: dict = field(default_factory=dict, repr=False)

    def once(self, key: str, make):
        """``make()`` the first time ``key`` is asked for in this build, the same value after."""
        if key not in self.resolved:
            self.resolved[key] = make()
        return self.resolved[key]

    def compute_dir(self, name: str) -> Path:
        return self.output / name / "1"


class Pipeline:
    # Folders under python_models/ and ensembles/ that this pipeline owns.
    python_models: tuple[str, ...] = ()
    ensembles: tuple[str, ...] = ()
    # Python models clients call directly (besides the ensembles and their variants): the public
    # ports serve inference for these and the ensembles only (``public_models`` in ``.built``).
    entry_points: tuple[str, ...] = ()
    # Latency classes of Python models that drive compute models through BLS (see variants.py).
    python_latency_variants: dict[str, tuple[LatencyVariant, ...]] = {}
    # Python model → the config parameters the builder writes from the runtime module's constants
    # (e.g. ``triton_pipelines.pipelines.vision.CONFIG_PARAMETERS``: input limits and request defaults), the
    # one place those values live; the source configs leave them out.
    runtime_parameters: Mapping[str, Mapping[str, object]] = {}

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Builder flags of this pipeline (weights sources, optional models)."""

    def compute_models(self, context: BuildContext) -> list[ComputeModel]:
        return []

    def adjust_compute_model(self, model: ComputeModel, context: BuildContext) -> ComputeModel:
        """Called with every pipeline's compute models (e.g. the router adds canary versions)."""
        return model

    def configure(self, config: mc.ModelConfig, context: BuildContext) -> None:
        """Everything the builder writes into a hand-written config: ``runtime_parameters``, then
        ``patch_config``. The hand-written sources leave these values out, or -1 on a line marked
        ``# builder`` (tests/unit/builder/test_configs.py checks it)."""
        for key, value in self.runtime_parameters.get(config.name, {}).items():
            config.parameters[key].string_value = parameter_text(value)
        self.patch_config(config, context)

    def patch_config(self, config: mc.ModelConfig, context: BuildContext) -> None:
        """Write into a Python model's or ensemble's config what depends on what was built (e.g. the
        embedding width)."""

    def write_assets(self, model_name: str, version_dir: Path, context: BuildContext) -> None:
        """Put the files a Python model loads at ``initialize`` into its version folder.
        Called after every compute model is exported."""

    def model_table(self, context: BuildContext) -> list[dict]:
        """What was built from which weights (model, architecture, weights), recorded in the
        repository's ``.built`` (the speech tests read it to tell real weights from random ones)."""
        return []


def parameter_text(value: object) -> str:
    """A config parameter's string: ``true``/``false``, a whole float without its ``.0``, a sequence
    comma-separated (what the Python models parse back)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (tuple, list)):
        return ",".join(parameter_text(v) for v in value)
    return str(value)
