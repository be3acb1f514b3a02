"""The ``router`` BLS model: its route file, and the canary versions the route file asks
for (added to the named compute models, e.g. ``text_encoder`` version 2 = int8 dynamic quantization).
Latency-class variants (``<model>_batch``) come with every compute model (see variants.py)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from triton_pipelines.repository.routes import RouteTable

from .compute import ComputeModel
from .pipeline import BuildContext, Pipeline

ROUTES_FILE = Path("data") / "routes.yaml"  # in the project


def canary_versions(routes_file: Path) -> dict[str, tuple[tuple[int, str], ...]]:
    """Per canary model, its versions beyond 1 and the build that derives each (``variants.VERSION_BUILDS``)."""
    return {name: tuple(sorted(canary.builds.items())) for name, canary in RouteTable.load(routes_file).canaries.items()}


class RouterPipeline(Pipeline):
    python_models = ("router",)
    entry_points = ("router",)

    def adjust_compute_model(self, model: ComputeModel, context: BuildContext) -> ComputeModel:
        versions = canary_versions(context.root / ROUTES_FILE).get(model.name)
        return dataclasses.replace(model, extra_versions=versions) if versions else model

    def write_assets(self, model_name: str, version_dir: Path, context: BuildContext) -> None:
        if model_name == "router":
            routes = context.root / ROUTES_FILE
            RouteTable.load(routes)  # fail the build, not the server, on a bad route file
            shutil.copy2(routes, version_dir / "routes.yaml")

    def model_table(self, context: BuildContext) -> list[dict]:
        rows = [{"model": "router", "architecture": "Python BLS router (task dispatch, latency classes, "
                 "canary split, OpenAI-compatible gateway)", "weights": "none (route file data/routes.yaml)"}]
        for model, versions in canary_versions(context.root / ROUTES_FILE).items():
            rows.append({"model": f"{model} version {', '.join(str(n) for n, _ in versions)}",
                         "architecture": f"canary of {model}: {', '.join(b for _, b in versions)} of version 1",
                         "weights": f"derived from {model} version 1 at build time"})
        return rows
