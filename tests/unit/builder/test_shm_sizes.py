"""/dev/shm sizes from the builder: what the Python-backend stubs may hold at full batches (their
own inputs and outputs, and those of their BLS calls), computed from the descriptions and source
configs for targets this machine does not build (gpu: Whisper large-v3, its default where the hub
can be reached), equal to the planner's figure for a built repository, and the committed
docker-compose / Kubernetes sizes in step with the largest default build."""

from __future__ import annotations

import json
import re

import yaml

from repo_builder.__main__ import parse_context
from repo_builder.planner.estimates import Repository
from repo_builder.planner.shm import shm_size_text
from repo_builder.planner.sizes import GiB, MiB
from repo_builder.repository import planned_shm
from repo_builder.speech_pipeline import default_architectures
from triton_pipelines.server.launcher import shm_shortfall
from triton_pipelines.repository.contract import ShmCheck, shm_capacity

from tests.conftest import PROJECT_ROOT, ensure_repository


def planned(target: str, *flags: str) -> dict[str, int]:
    return planned_shm(*parse_context(["--target", target, "--project-root", str(PROJECT_ROOT), *flags]))


def planned_defaults(target: str) -> dict[str, int]:
    """The largest plan among the Whisper models a default build of ``target`` may resolve to
    (gpu: openai/whisper-large-v3 where the cache or the hub has it, else the packaged base),
    planned by their architectures: the /dev/shm plan depends on the dimensions, not the weights,
    and nothing is fetched."""
    plans = [planned(target, "--whisper-model", f"random:{size}") for size in default_architectures(target)]
    return max(plans, key=lambda plan: sum(plan.values()))


def test_the_plan_from_descriptions_equals_the_built_repository():
    built = Repository(ensure_repository())
    assert planned(built.target) == built.shm_needs()
    assert json.loads((built.path / ".built").read_text())["shm_bytes"] == sum(built.shm_needs().values())


def test_whisper_decode_holds_its_bls_calls():
    """gpu: no decoder cache, so every decoder step carries the cross K/V of one encoder call's
    windows (8 x 32 layers x 2 x 20 heads x 1500 x 64 floats for large-v3) and the self-attention K/V
    up to 448 positions: gigabytes, where the stub's own tensors are megabytes."""
    gpu = planned("gpu", "--whisper-model", "random:large-v3")
    cross = 8 * 32 * 2 * 20 * 1500 * 64 * 4
    self_kv = 8 * 2 * (64 * 20 * 448 * 64 * 4)
    assert gpu["whisper_decode"] >= 2 * cross + self_kv  # the encoder's outputs and the decoder's inputs
    assert gpu["whisper_decode"] == gpu["whisper_decode_batch"]
    assert gpu["text_tokenizer"] <= 64 * MiB
    assert "whisper_decoder" not in gpu  # native backend on the gpu target: no stub


def test_the_self_attention_kv_the_decoder_keeps_is_not_planned_in_the_callers_region():
    """Embedded: whisper_decoder keeps the self-attention K/V between a keyed caller's steps
    (``state_inputs``), so whisper_decode's region holds the decoder step's other tensors only."""
    from repo_builder.planner.shm import _shm_region, _tensor_bytes, bls_calls, kept_in_callee, stub_region_bytes

    built = Repository(ensure_repository())
    configs = built.configs()
    caller, callee = configs["whisper_decode"], configs["whisper_decoder"]
    assert kept_in_callee(caller, callee) == {"past_self_kv": 0, "present_self_kv": 0}
    (encoder, windows, _), (_, rows, bounds) = bls_calls(caller)
    without_state = (_tensor_bytes(caller, caller.max_batch_size, {}) + _tensor_bytes(configs[encoder], windows, {})
                     + _tensor_bytes(callee, rows, bounds | {"past_self_kv": 0, "present_self_kv": 0}))
    assert stub_region_bytes(caller, configs, {}) == _shm_region(without_state)
    assert kept_in_callee(configs["whisper_encoder"], callee) == {}  # a caller that does not key its calls


def test_committed_sizes_hold_the_default_builds():
    needs = {target: sum(planned_defaults(target).values()) for target in ("gpu", "embedded")}
    assert needs["gpu"] > sum(planned("gpu", "--whisper-model", "base").values())  # sized for large-v3
    compose = (PROJECT_ROOT / "docker-compose.yml").read_text()
    (default,) = re.findall(r"shm_size: \$\{TRITON_SHM_SIZE:-(\d+)gb\}", compose)
    assert default + "gb" == shm_size_text(max(needs.values())), \
        f"docker-compose.yml's shm_size default should be {shm_size_text(max(needs.values()))} ({needs})"
    documents = yaml.safe_load_all((PROJECT_ROOT / "deploy" / "k8s" / "deployment.yaml").read_text())
    deployment = next(d for d in documents if d and d.get("kind") == "Deployment")
    (dshm,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"]["sizeLimit"] == shm_size_text(needs["gpu"])[:-2] + "Gi"


def test_the_launcher_warns_when_dev_shm_is_smaller(tmp_path):
    (tmp_path / ".built").write_text(json.dumps({"shm_bytes": 64 * GiB}))
    warning = shm_shortfall(tmp_path, replicas=2)
    assert warning and "128.0 GiB" in warning and "TRITON_SHM_SIZE" in warning
    (tmp_path / ".built").write_text(json.dumps({"shm_bytes": 1}))
    assert shm_shortfall(tmp_path) is None


def test_one_check_says_it_for_the_planner_and_the_launcher(tmp_path):
    """layout.ShmCheck: the planner's --check note and the launcher's warning (launcher.shm_shortfall)."""
    short = ShmCheck(size=GiB, needed=3 * GiB, replicas=2)
    assert not short.fits
    assert short.note() == ("note: /dev/shm (1.00 GiB) is SMALLER than what the Python-backend stubs may hold at full "
                            "batches (3.00 GiB; `python -m repo_builder plan --shm` itemizes it)")
    assert short.warning().startswith("WARNING: /dev/shm holds 1.0 GiB; the Python-backend stubs may need up to 3.0 "
                                      "GiB at full batches (2 replica(s);")
    enough = ShmCheck(size=3 * GiB, needed=3 * GiB)
    assert enough.fits and enough.warning() is None and "(3.00 GiB) holds what" in enough.note()
    measured = ShmCheck.measure(5, str(tmp_path), replicas=3)
    assert (measured.size, measured.needed, measured.folder) == (shm_capacity(tmp_path), 15, str(tmp_path))
