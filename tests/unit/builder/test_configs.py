"""Static checks, no server: every config parses as Triton's ModelConfig, ensembles are wired to
real tensors, and the container runs Triton with the same flags as the embedded launcher."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from repo_builder.__main__ import parse_context
from repo_builder.compute import TARGETS
from triton_pipelines.server.launcher import ServerOptions, pytriton_dir, server_command, server_environment
from tests.support.paths import PROJECT_ROOT

ROOT = PROJECT_ROOT
SOURCE_CONFIGS = sorted((ROOT / "python_models").glob("*/config.pbtxt")) + sorted(
    (ROOT / "ensembles").glob("*/config.pbtxt"))


def parse(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


@pytest.mark.parametrize("path", SOURCE_CONFIGS, ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}")
def test_source_config_parses_and_is_named_after_its_folder(path):
    config = parse(path.read_text())
    assert config.name == path.parent.name
    assert config.backend == "python" or config.platform == "ensemble"


SENTINEL_DIM, SENTINEL_VALUE = 7777, "<from the source>"


def written_by_builder(source: mc.ModelConfig, pipeline, context) -> set[tuple[str, str, int]]:
    """What the builder writes into a hand-written config: patch a copy whose every dim and
    parameter holds a sentinel and see what changed. ("parameter", key, 0) or ("dims", tensor, index)."""
    probe = mc.ModelConfig()
    probe.CopyFrom(source)
    for tensor in [*probe.input, *probe.output]:
        count = len(tensor.dims)
        del tensor.dims[:]
        tensor.dims.extend([SENTINEL_DIM] * count)
    for key in probe.parameters:
        probe.parameters[key].string_value = SENTINEL_VALUE
    pipeline.configure(probe, context)
    written = {("parameter", key, 0) for key, value in probe.parameters.items() if value.string_value != SENTINEL_VALUE}
    return written | {("dims", tensor.name, index) for tensor in [*probe.input, *probe.output]
                      for index, dim in enumerate(tensor.dims) if dim != SENTINEL_DIM}


@pytest.mark.parametrize("target", TARGETS)
def test_source_configs_hold_no_value_the_builder_writes(target):
    """Editing a value the builder overwrites would do nothing: such parameters are absent from the
    sources, such dims are -1 on a line marked "# builder" (the comment at the top says what)."""
    context, pipelines = parse_context(["--target", target])
    owners = {name: pipeline for pipeline in pipelines for name in (*pipeline.python_models, *pipeline.ensembles)}
    assert set(owners) == {path.parent.name for path in SOURCE_CONFIGS}
    found = set()
    for path in SOURCE_CONFIGS:
        source = parse(path.read_text())
        tensors = {tensor.name: tensor for tensor in [*source.input, *source.output]}
        for kind, name, index in written_by_builder(source, owners[source.name], context):
            found.add((source.name, name))
            if kind == "parameter":
                assert name not in source.parameters, f"{path}: parameter {name} is written by the builder: remove it"
                continue
            assert tensors[name].dims[index] == -1, f"{path}: {name} dim {index} is written by the builder: make it -1"
            line = next(line for line in path.read_text().splitlines() if f'name: "{name}"' in line)
            assert "# builder" in line, f"{path}: mark the line of {name} with '# builder'"
    assert {("whisper_decode", "vocab_size"), ("whisper_decode", "input_features"),
            ("text_embedding", "embedding"), ("audio_features", "n_mels")} <= found
    # the input limits and request defaults, from the runtime modules' CONFIG_PARAMETERS
    assert {("image_preprocess", "max_image_pixels"), ("classification_postprocess", "max_top_k"),
            ("text_tokenizer", "max_text_bytes"), ("audio_features", "max_audio_seconds"),
            ("whisper_decode", "max_new_tokens")} <= found


@pytest.mark.parametrize("target", TARGETS)
def test_generated_compute_configs_parse_for_every_target(target):
    context, pipelines = parse_context(["--target", target])
    models = [m for pipeline in pipelines for m in pipeline.compute_models(context)]
    assert models, "no compute models"
    for model in models:
        config = model.config(target)
        reparsed = parse(text_format.MessageToString(config))
        assert reparsed == config
        assert reparsed.max_batch_size == model.max_batch_size
        assert [i.name for i in reparsed.input] == [t.name for t in model.inputs]
        if target == "gpu":
            assert reparsed.platform in ("onnxruntime_onnx", "tensorrt_plan")
            assert all(g.kind == mc.ModelInstanceGroup.KIND_GPU for g in reparsed.instance_group)
        else:
            assert reparsed.backend == "python"


@pytest.mark.parametrize("target", TARGETS)
def test_tokenizer_padding_matches_how_the_text_encoders_batch(target):
    """Embedded: every text encoder (and its variants) takes ragged batches grouped by row length,
    so the tokenizer pads a request to its own longest text only. gpu: the native onnxruntime
    backend batches equal shapes only, so the tokenizer pads to length buckets and no input is
    ragged (it would be concatenated flat, which the padded graph cannot take)."""
    from repo_builder.variants import variant_model
    from triton_pipelines.pipelines.text import LENGTH_BUCKETS, parse_buckets

    context, pipelines = parse_context(["--target", target])
    text_pipeline = next(p for p in pipelines if "text_tokenizer" in p.python_models)
    tokenizer = parse((ROOT / "python_models" / "text_tokenizer" / "config.pbtxt").read_text())
    text_pipeline.configure(tokenizer, context)
    buckets = parse_buckets(tokenizer.parameters["length_buckets"].string_value)
    encoders = [model for model in text_pipeline.compute_models(context)]
    configs = [model.config(target) for model in encoders] + [
        variant_model(model, variant.suffix).config(target) for model in encoders for variant in model.latency_variants]
    ragged = {config.name: {tensor.allow_ragged_batch for tensor in config.input} for config in configs}
    if target == "embedded":
        assert buckets == () and all(flags == {True} for flags in ragged.values()), ragged
        assert all(config.parameters["length_input"].string_value == "attention_mask" for config in configs)
    else:
        assert buckets == LENGTH_BUCKETS and all(flags == {False} for flags in ragged.values()), ragged


@pytest.mark.parametrize("target", TARGETS)
def test_no_model_has_a_queue_policy(target):
    """In Triton 2.51 a queue policy (time-out, timeout override, max_queue_size or priority levels)
    turns off the dynamic batcher's prefetching, and a request that arrives while the instance is
    busy can then wait for the batcher's 500 ms poll (build/repo_builder/compute.py). Measured: 1 in
    8 decoding steps of a Whisper clip stalled 500 ms. Back-pressure is the front's in-flight limit."""
    from repo_builder.variants import variant_model

    context, pipelines = parse_context(["--target", target])
    configs = {p.parent.name: parse(p.read_text()) for p in SOURCE_CONFIGS}
    for model in (m for pipeline in pipelines for m in pipeline.compute_models(context)):
        configs[model.name] = model.config(target)
        for variant in model.latency_variants:
            configs[f"{model.name}_{variant.suffix}"] = variant_model(model, variant.suffix).config(target)
    if target == "embedded" and (ROOT / "model_repository" / ".built").exists():
        configs.update(built_configs())
    with_policy = [name for name, config in configs.items() if config.HasField("dynamic_batching") and (
        config.dynamic_batching.HasField("default_queue_policy") or config.dynamic_batching.priority_levels
        or config.dynamic_batching.priority_queue_policy)]
    assert not with_policy


def built_configs() -> dict[str, mc.ModelConfig]:
    repository = ROOT / "model_repository"
    if not (repository / ".built").exists():
        pytest.skip("model_repository/ not built (make test builds it first)")
    return {p.parent.name: parse(p.read_text()) for p in repository.glob("*/config.pbtxt")}


def test_built_repository_configs_parse():
    configs = built_configs()
    assert {"text_tokenizer", "text_encoder", "text_embedding",
            "intent_classifier", "text_classification"} <= set(configs)


def test_ensemble_steps_map_to_real_tensors():
    configs = built_configs()
    for config in configs.values():
        if config.platform != "ensemble":
            continue
        produced = {i.name for i in config.input}
        for step in config.ensemble_scheduling.step:
            assert step.model_name in configs, f"{config.name}: unknown model {step.model_name}"
            member = configs[step.model_name]
            member_inputs = {i.name for i in member.input}
            member_outputs = {o.name for o in member.output}
            assert set(step.input_map) <= member_inputs, f"{config.name} → {step.model_name} inputs"
            required = {i.name for i in member.input if not i.optional}
            assert required <= set(step.input_map), f"{config.name} → {step.model_name} misses inputs"
            assert set(step.output_map) <= member_outputs, f"{config.name} → {step.model_name} outputs"
            assert set(step.input_map.values()) <= produced, f"{config.name}: unproduced tensor"
            produced |= set(step.output_map.values())
            assert member.max_batch_size >= config.max_batch_size or member.max_batch_size == 0
        assert {o.name for o in config.output} <= produced


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_serves_the_ngc_2_51_image_on_the_native_ports():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "FROM nvcr.io/nvidia/tritonserver:24.10-py3 AS serving" in dockerfile
    triton = compose()["services"]["triton"]
    # the native ports in the container; on the host 8000-8002 unless TRITON_*_PORT says otherwise
    assert triton["ports"] == [f"${{TRITON_{name}_PORT:-{port}}}:{port}"
                               for name, port in (("HTTP", 8000), ("GRPC", 8001), ("METRICS", 8002))]
    assert triton["volumes"][0].startswith("./model_repository:/models")


def compose_launcher_options():
    """The launcher invocation of the compose file, parsed by the launcher's own CLI."""
    from triton_pipelines.server import launcher

    command = compose()["services"]["triton"]["command"]
    assert command[:4] == ["python3", "-m", "triton_pipelines", "serve"]
    captured = {}

    def record(options):
        captured["options"] = options
        raise SystemExit(0)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launcher, "Launcher", record)
        patch.setattr(launcher.Path, "exists", lambda self: True)  # /models/.built is in the container
        with pytest.raises(SystemExit):
            launcher.main(command[4:])
    return captured["options"]


def test_compose_runs_the_launcher_on_the_containers_server_with_valid_flags():
    from triton_pipelines.server import launcher

    options = compose_launcher_options()
    assert options.tritonserver == Path("/opt/tritonserver/bin/tritonserver")
    assert options.backend_dir == Path("/opt/tritonserver/backends")
    assert (options.http_port, options.grpc_port, options.metrics_port) == (8000, 8001, 8002)
    help_text = subprocess.run([str(pytriton_dir() / "bin" / "tritonserver"), "--help"],
                               env=server_environment(), capture_output=True, text=True)
    known = set(re.findall(r"^\s+(--[a-z0-9-]+)", help_text.stdout + help_text.stderr, re.M))
    assert "--model-control-mode" in known
    command = server_command(options, launcher.InternalPorts(1, 2, 3), key="k" * 20, shm_prefix="p_")
    flags = {arg.split("=")[0] for arg in command[1:]}
    assert flags <= known, flags - known


def test_containers_serve_behind_nginx_as_a_non_root_user_on_every_address():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    for stage, service in (("serving", "triton"), ("cpu-serving", "triton-cpu")):
        body = dockerfile.split(f" AS {stage}\n", 1)[1].split("\nFROM ", 1)[0]
        assert "nginx-core" in body and "USER triton-server" in body, stage
        command = compose()["services"][service]["command"]
        assert command[command.index("--listen-address") + 1] == "0.0.0.0"
        # nginx → the launcher's readiness, which sees dead stubs
        assert compose()["services"][service]["healthcheck"]["test"][1:] == [
            "python3", "-m", "triton_pipelines", "health", "--url", "localhost:8000"]


def test_compose_gives_the_drain_time_before_sigkill():
    seconds = int(compose()["services"]["triton"]["stop_grace_period"].rstrip("s"))
    assert seconds > ServerOptions(model_repository=Path("m")).exit_timeout_secs + 30


def test_bls_models_declare_what_they_call_for_the_shutdown_drain():
    from triton_pipelines.server.drain import dependencies

    for model_py in sorted((ROOT / "python_models").glob("*/model.py")):
        source = model_py.read_text()
        if "InferenceRequest(" not in source:
            continue
        config = parse((model_py.parent / "config.pbtxt").read_text())
        declared = dependencies({"parameters": {k: {"string_value": v.string_value}
                                                for k, v in config.parameters.items()}})
        assert declared, f"{config.name} makes BLS calls but declares no bls_dependencies"
        named = {v.string_value for k, v in config.parameters.items() if k.endswith("_model")}
        assert "*" in declared or named <= declared, (config.name, named - declared)
