"""Model variants generated from the single compute-model description.

Latency classes
    The compute model ``<name>`` is the ``realtime`` class: its description's own batching.
    Each ``LatencyVariant`` adds ``<name>_<suffix>`` (by default ``<name>_batch``: preferred batch
    sizes 16/32, a 20 ms queue delay, ``preserve_ordering``) serving the SAME files: every file of
    ``<name>/<version>/`` is a relative symlink in ``<name>_<suffix>/<version>/``.

Canary versions
    ``ComputeModel.extra_versions`` = ``((2, "int8_dynamic"),)`` puts version 2 next to version 1
    (derived from version 1's ONNX by a build in ``VERSION_BUILDS``) and writes
    ``version_policy { specific { versions: [1, 2] } }`` so both are loaded together.

Python-model latency classes
    A pipeline whose compute models are driven by a BLS loop (speech: ``whisper_decode`` calls the
    Whisper models itself) batches in the loop model, not in the compute models. Its pipeline declares
    ``python_latency_variants``: ``<model>_<suffix>`` is the same Python model (its version folder
    symlinked) with the variant's dynamic batching.

Ensemble variants
    For every ensemble that reaches such a model (through nested ensembles too), the builder writes
    ``<ensemble>_<suffix>`` (steps point at the ``_<suffix>`` compute models and nested variants)
    and ``<ensemble>[_<suffix>]_v<N>`` (the canary model's step pinned to version N). The ensemble
    itself pins the canary model to version 1, so existing ensembles keep serving what they served.
    The latency-class variants keep the source's ``response_cache``; the ``_v<N>`` ones have none.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Callable

from tritonclient.grpc import model_config_pb2 as mc

from triton_pipelines.repository.ensemble_graph import EnsembleGraph
from triton_pipelines.repository.contract import STABLE_VERSION, variant_name

from .compute import ComputeModel, LatencyVariant
from .files import hash_files, is_fresh, mark_fresh, read_config, write_config
from .pipeline import BuildContext


def quantize_int8_dynamic(source: Path, target: Path) -> None:
    """ONNX Runtime dynamic quantization: int8 weights, activations quantized per call."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8)


def same_weights(source: Path, target: Path) -> None:
    shutil.copy2(source, target)


VERSION_BUILDS: dict[str, Callable[[Path, Path], None]] = {
    "int8_dynamic": quantize_int8_dynamic,
    "same_weights": same_weights,
}


def build_extra_versions(model: ComputeModel, context: BuildContext, runner: Path, log) -> None:
    """Version N > 1 of a compute model, derived from version 1's ``model.onnx``."""
    model_dir = context.output / model.name
    source = model_dir / "1" / "model.onnx"
    wanted = {str(number) for number in model.versions}
    for stale in model_dir.iterdir():
        if stale.is_dir() and stale.name.isdigit() and stale.name not in wanted:
            shutil.rmtree(stale)
    for number, build in model.extra_versions:
        if build not in VERSION_BUILDS:
            raise ValueError(f"{model.name} version {number}: unknown build {build!r}; known: {list(VERSION_BUILDS)}")
        version_dir = model_dir / str(number)
        version_dir.mkdir(exist_ok=True)
        key = f"{build}:{hash_files(source)}"
        if not is_fresh(version_dir, key):
            VERSION_BUILDS[build](source, version_dir / "model.onnx")
            mark_fresh(version_dir, key)
            log(f"{model.name}: built version {number} ({build})")
        if context.target == "embedded":
            shutil.copy2(runner, version_dir / "model.py")
        elif (version_dir / "model.py").exists():
            (version_dir / "model.py").unlink()


def preferred_sizes(variant: LatencyVariant, max_batch_size: int) -> tuple[int, ...]:
    """The variant's preferred batch sizes that the model allows (Triton rejects larger ones)."""
    return tuple(b for b in variant.preferred_batch_sizes if b <= max_batch_size) or (max_batch_size,)


def variant_model(model: ComputeModel, suffix: str) -> ComputeModel:
    variant = next(v for v in model.latency_variants if v.suffix == suffix)
    return dataclasses.replace(
        model, name=variant_name(model.name, suffix),
        preferred_batch_sizes=preferred_sizes(variant, model.max_batch_size),
        max_queue_delay_microseconds=variant.max_queue_delay_microseconds,
        preserve_ordering=variant.preserve_ordering, latency_variants=())


def build_latency_variants(model: ComputeModel, context: BuildContext, runner: Path) -> list[str]:
    """``<name>_<suffix>`` for each latency variant: symlinks to ``<name>``'s files, its own config."""
    names = []
    for latency in model.latency_variants:
        variant = variant_model(model, latency.suffix)
        variant_dir = context.output / variant.name
        if variant_dir.exists():
            shutil.rmtree(variant_dir)
        for number in model.versions:
            source_dir = context.output / model.name / str(number)
            target_dir = variant_dir / str(number)
            target_dir.mkdir(parents=True)
            for file in sorted(source_dir.iterdir()):
                if file.name in ("model.py", ".content-hash") or not file.is_file():
                    continue
                (target_dir / file.name).symlink_to(Path("..") / ".." / model.name / str(number) / file.name)
            if context.target == "embedded":
                shutil.copy2(runner, target_dir / "model.py")
        write_config(variant_dir / "config.pbtxt",
                     variant.config(context.target, context.args.embedded_execution_providers))
        names.append(variant.name)
    return names


def build_python_latency_variants(name: str, variants: tuple[LatencyVariant, ...],
                                  context: BuildContext) -> list[str]:
    """``<name>_<suffix>``: the built Python model ``<name>`` (files symlinked) with the variant's batching."""
    source = context.output / name
    config = read_config(source / "config.pbtxt")
    names = []
    for variant in variants:
        variant_dir = context.output / variant_name(name, variant.suffix)
        if variant_dir.exists():
            shutil.rmtree(variant_dir)
        (variant_dir / "1").mkdir(parents=True)
        for file in sorted((source / "1").iterdir()):
            if file.is_file() and file.name != ".content-hash":
                (variant_dir / "1" / file.name).symlink_to(Path("..") / ".." / name / "1" / file.name)
        batched = mc.ModelConfig()
        batched.CopyFrom(config)
        batched.name = variant_dir.name
        batching = batched.dynamic_batching
        del batching.preferred_batch_size[:]
        batching.preferred_batch_size.extend(preferred_sizes(variant, config.max_batch_size))
        batching.max_queue_delay_microseconds = variant.max_queue_delay_microseconds
        batching.preserve_ordering = variant.preserve_ordering
        write_config(variant_dir / "config.pbtxt", batched)
        names.append(variant_dir.name)
    return names


class EnsembleVariants:
    """Plans and writes the latency-class and canary variants of the built ensembles."""

    def __init__(self, context: BuildContext, compute_models: list[ComputeModel], ensembles: list[str],
                 python_variants: dict[str, tuple[LatencyVariant, ...]] | None = None):
        self.context = context
        self.compute = {m.name: m for m in compute_models}
        # Every model with latency variants: compute models and BLS-loop Python models.
        self.variants = {m.name: m.latency_variants for m in compute_models} | (python_variants or {})
        self.configs = {name: read_config(context.output / name / "config.pbtxt") for name in ensembles}
        # The models with variants each ensemble reaches through its steps and nested ensembles (the
        # rewrite below renames steps; a BLS model's calls are its own parameters).
        graph = EnsembleGraph.from_configs(self.configs)
        self.reaches = {name: graph.reached(name, through_bls=False) & set(self.variants) for name in self.configs}

    def classes(self, name: str) -> list[str]:
        return sorted({v.suffix for m in self.reaches[name] for v in self.variants[m]})

    def canary_model(self, name: str) -> ComputeModel | None:
        models = sorted(m for m in self.reaches[name] if m in self.compute and self.compute[m].extra_versions)
        if len(models) > 1:
            raise ValueError(f"ensemble {name} reaches several canary models {models}: one at most")
        return self.compute[models[0]] if models else None

    def variant_name(self, name: str, suffix: str | None, version: int | None) -> str:
        """``contract.variant_name`` with the class only if the ensemble has it, the version only if it
        reaches a canary model."""
        return variant_name(name, suffix if suffix in self.classes(name) else None,
                            version if self.canary_model(name) else None)

    def rewrite(self, name: str, suffix: str | None, version: int | None) -> mc.ModelConfig:
        config = mc.ModelConfig()
        config.CopyFrom(self.configs[name])
        config.name = self.variant_name(name, suffix, version)
        if version is not None:
            # A canary's requests must reach its version: the rollout's gate judges what that
            # version served (requests, p99), and cached answers would never reach it.
            config.ClearField("response_cache")
        for step in config.ensemble_scheduling.step:
            if step.model_name in self.variants:
                model = self.compute.get(step.model_name)
                if model is not None and model.extra_versions:
                    step.model_version = version or STABLE_VERSION
                if suffix and any(v.suffix == suffix for v in self.variants[step.model_name]):
                    step.model_name = variant_name(step.model_name, suffix)
            elif step.model_name in self.configs:
                step.model_name = self.variant_name(step.model_name, suffix, version)
        return config

    def build(self) -> list[str]:
        written = []
        for name in self.configs:
            canary = self.canary_model(name)
            versions = [None] + ([n for n, _ in canary.extra_versions] if canary else [])
            for suffix in [None] + self.classes(name):
                for version in versions:
                    config = self.rewrite(name, suffix, version)
                    write_config(self.context.output / config.name / "config.pbtxt", config)
                    (self.context.output / config.name / "1").mkdir(exist_ok=True)
                    if config.name != name:
                        written.append(config.name)
        return written
