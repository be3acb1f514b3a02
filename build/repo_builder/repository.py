"""Assemble a Triton model repository for one target.

Layout written to ``output``::

    <model>/config.pbtxt            generated (compute) or copied from python_models/, ensembles/
    <model>/1/model.onnx            compute models (exported once, re-exported when their hash changes)
    <model>/1/model.py              Python models (and, on the embedded target, compute runners)
    <model>/1/<assets>              tokenizer.json, prototypes, label files ...
    .built                          JSON (triton_pipelines.repository.contract.BuiltManifest): target, the models,
                                    what the launcher, the rollout and the planner read (public models,
                                    compute-model facts, the /dev/shm the stubs may hold)
"""

from __future__ import annotations

import importlib.util
import inspect
import py_compile
import shutil
import time
from importlib.metadata import version
from pathlib import Path

from triton_pipelines.repository.contract import BuiltManifest, ComputeModelFacts, variant_name

from .compute import ComputeModel
from .files import is_fresh, make_readable, mark_fresh, read_config, replace_dir, write_config
from .pipeline import BuildContext, Pipeline
from .tuning import apply_tuning
from .variants import (EnsembleVariants, build_extra_versions, build_latency_variants, build_python_latency_variants,
                       variant_model)


# The embedded target's compute models: the model.py the builder copies into each version folder.
ONNX_RUNNER_TEMPLATE = Path(__file__).parent / "templates" / "onnx_runtime_runner.py"


def log(message: str) -> None:
    print(f"[repo_builder] {message}", flush=True)


def build_compute_model(model: ComputeModel, context: BuildContext) -> list[str]:
    """The model (and its canary versions), then its latency-class variants; returns their names."""
    model_dir = context.output / model.name
    # The exporter's whole module (repo_builder.export.*) is hashed: a change to export code
    # re-exports its models. export_onnx is the export function, or a functools.partial of it.
    exporter = getattr(model.export_onnx, "func", model.export_onnx)
    exporter_source = Path(inspect.getsourcefile(exporter)).read_text()
    key = model.content_hash(version("torch"), version("transformers"), exporter_source)
    onnx_dir = model_dir / "1"
    if not is_fresh(model_dir, key):
        started = time.monotonic()
        replace_dir(model_dir, lambda tmp: _export(model, tmp))
        mark_fresh(model_dir, key)
        log(f"{model.name}: exported ONNX in {time.monotonic() - started:.1f} s")
    else:
        log(f"{model.name}: up to date")
    write_config(model_dir / "config.pbtxt", model.config(context.target, context.args.embedded_execution_providers))
    runner = onnx_dir / "model.py"
    if context.target == "embedded":
        shutil.copy2(ONNX_RUNNER_TEMPLATE, runner)
    elif runner.exists():
        runner.unlink()
    # gpu + tensorrt_plan: the trtexec flags for docker/build_trt_engines.sh, which writes model.plan.
    trtexec_args = onnx_dir / "trtexec.args"
    if context.target == "gpu" and model.gpu_backend == "tensorrt_plan":
        trtexec_args.write_text("\n".join(model.trtexec_args()) + "\n")
    elif trtexec_args.exists():
        trtexec_args.unlink()
    build_extra_versions(model, context, ONNX_RUNNER_TEMPLATE, log)
    return [model.name] + build_latency_variants(model, context, ONNX_RUNNER_TEMPLATE)


def compile_model_files(output: Path) -> None:
    """Byte-compile every version's ``model.py`` in place (``__pycache__`` beside it, for this
    interpreter, which the embedded stub shares). Otherwise the stub writes it on the first load,
    the version folder's modification time changes, and Triton's next ``load`` of the model reloads
    that version from scratch (new instances) whatever the config says: a rollout's version change,
    a watchdog repair. Up-to-date files are left alone, so a rebuild changes nothing."""
    for source in sorted(output.glob("*/[0-9]*/model.py")):
        cached = Path(importlib.util.cache_from_source(str(source)))
        if not cached.exists() or cached.stat().st_mtime < source.stat().st_mtime:
            py_compile.compile(str(source), cfile=str(cached), doraise=True)


def compute_model_facts(model: ComputeModel) -> ComputeModelFacts:
    """What the rollout and the memory planner read from ``.built``: the versions built, the
    latency-class variants serving the same files, the sequence bound of its -1 dimensions."""
    return ComputeModelFacts(versions=list(model.versions),
                             latency_variants=[variant_name(model.name, v.suffix) for v in model.latency_variants],
                             max_sequence_length=model.max_sequence_length)


def _export(model: ComputeModel, model_dir: Path) -> None:
    (model_dir / "1").mkdir(parents=True)
    model.export_onnx(model_dir / "1" / "model.onnx")


def build_python_model(name: str, pipeline: Pipeline, context: BuildContext) -> None:
    source = context.root / "python_models" / name
    model_dir = context.output / name
    version_dir = model_dir / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    config = read_config(source / "config.pbtxt")
    pipeline.configure(config, context)
    write_config(model_dir / "config.pbtxt", config)
    shutil.copy2(source / "model.py", version_dir / "model.py")
    pipeline.write_assets(name, version_dir, context)


def build_ensemble(name: str, pipeline: Pipeline, context: BuildContext) -> None:
    model_dir = context.output / name
    config = read_config(context.root / "ensembles" / name / "config.pbtxt")
    pipeline.configure(config, context)
    write_config(model_dir / "config.pbtxt", config)
    (model_dir / "1").mkdir(exist_ok=True)  # Triton needs a version folder, even an empty one


def compute_models_of(context: BuildContext, pipelines: list[Pipeline]) -> list[ComputeModel]:
    """Every pipeline's compute models as the build makes them (other pipelines' adjustments, the recorded tuning)."""
    models = []
    for pipeline in pipelines:
        for model in pipeline.compute_models(context):
            for other in pipelines:  # e.g. the router's route file adds canary versions
                model = other.adjust_compute_model(model, context)
            models.append(apply_tuning(model, context.root))  # the config search's choice, if recorded
    return models


def planned_shm(context: BuildContext, pipelines: list[Pipeline]) -> dict[str, int]:
    """``planner.shm.shm_needs`` of the repository this context would build, from the descriptions and
    source configs alone (nothing exported): how the committed /dev/shm sizes of docker-compose.yml
    and deploy/k8s are checked for a target this machine does not build (gpu, Whisper large-v3)."""
    from .planner.shm import shm_needs

    configs, bounds = {}, {}
    for model in compute_models_of(context, pipelines):
        for described in [model, *(variant_model(model, v.suffix) for v in model.latency_variants)]:
            configs[described.name] = described.config(context.target, context.args.embedded_execution_providers)
            bounds[described.name] = {"": model.max_sequence_length} if model.max_sequence_length else {}
    for pipeline in pipelines:
        for name in pipeline.python_models:
            config = read_config(context.root / "python_models" / name / "config.pbtxt")
            pipeline.configure(config, context)
            configs[name] = config
            for variant in pipeline.python_latency_variants.get(name, ()):
                renamed = type(config)()
                renamed.CopyFrom(config)
                renamed.name = variant_name(name, variant.suffix)
                configs[renamed.name] = renamed
    return shm_needs(configs, bounds)


def is_ensemble(model_dir: Path) -> bool:
    return read_config(model_dir / "config.pbtxt").platform == "ensemble"


def build_repository(context: BuildContext, pipelines: list[Pipeline]) -> list[str]:
    started = time.monotonic()
    context.output.mkdir(parents=True, exist_ok=True)
    built: list[str] = []
    compute_models = compute_models_of(context, pipelines)
    for model in compute_models:
        built.extend(build_compute_model(model, context))
    for pipeline in pipelines:
        for name in pipeline.python_models:
            build_python_model(name, pipeline, context)
            built.append(name)
        for name in pipeline.ensembles:
            build_ensemble(name, pipeline, context)
            built.append(name)
    python_variants = {name: variants for pipeline in pipelines
                       for name, variants in pipeline.python_latency_variants.items()}
    for name, variants in python_variants.items():
        built.extend(build_python_latency_variants(name, variants, context))
    # Latency-class and canary variants of the ensembles (see variants.py).
    built.extend(EnsembleVariants(context, compute_models, [n for p in pipelines for n in p.ensembles],
                                  python_variants).build())
    for stale in sorted(p for p in context.output.iterdir() if p.is_dir() and p.name not in built):
        if (stale / "config.pbtxt").exists():
            log(f"removing {stale.name}: no longer built")
            shutil.rmtree(stale)
    compile_model_files(context.output)
    rows = [row for pipeline in pipelines for row in pipeline.model_table(context)]
    for row in rows:  # which weights each compute model serves, and why
        log(f"{row['model']}: {row['weights']}" + (f" ({row['reason']})" if row.get("reason") else ""))
    entry_points = {name for pipeline in pipelines for name in pipeline.entry_points}
    public = sorted(name for name in built if name in entry_points or is_ensemble(context.output / name))
    stamp = BuiltManifest(target=context.target, models=built, public_models=public, model_table=rows,
                          compute_models={model.name: compute_model_facts(model) for model in compute_models})
    stamp.write(context.output)
    # The stubs' /dev/shm, from what was just written (the planner reads configs and the stamp).
    from .planner.estimates import Repository
    from .planner.shm import shm_size_text
    from .planner.sizes import gib

    stamp.shm_bytes = sum(Repository(context.output).shm_needs().values())
    stamp.write(context.output)
    # The servers run as another user (uid 1000) than the builder (root in its container): every
    # folder traversable and every file readable, including those of earlier builds kept as fresh.
    make_readable(context.output)
    log(f"{context.target} repository at {context.output}: {len(built)} models "
        f"in {time.monotonic() - started:.1f} s; its Python-backend stubs may hold up to "
        f"{gib(stamp.shm_bytes)} GiB of /dev/shm at full batches (compose: TRITON_SHM_SIZE="
        f"{shm_size_text(stamp.shm_bytes)}; Kubernetes: the dshm volume's sizeLimit)")
    return built
