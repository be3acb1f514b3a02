"""The pure parts of `make rehearse` (tools/rehearse/__main__.py, rehearse_steps.py)."""

from __future__ import annotations

import subprocess

import tools.rehearse.__main__ as rehearsal
from tools.rehearse import recipes as rehearse
from tools.rehearse.steps import unreadable


def test_recipe_hash_changes_with_the_recipe_only():
    base = rehearse.python_containerfile("localhost/base:1")
    assert rehearse.recipe_hash(base) == rehearse.recipe_hash(base)
    assert rehearse.recipe_hash(base) != rehearse.recipe_hash(rehearse.python_containerfile("localhost/base:2"))


def test_triton_standin_is_only_what_our_images_rely_on():
    text = rehearse.triton_containerfile("localhost/base:1", "/root/.pyenv/versions/3.10.13")
    assert "useradd --no-create-home --uid 1000" in text  # NGC's triton-server has no home
    assert '! python3 -c "import tritonclient"' in text  # NGC has no tritonclient
    assert "! command -v python" in text  # python3 only
    assert "python_backend_stubs/3.10/triton_python_backend_stub" in text
    assert "/opt/tritonserver/bin/tritonserver" in text and "/opt/tritonserver/backends/python" in text


def test_python_standin_has_python_and_pip_like_the_official_image():
    text = rehearse.python_containerfile("localhost/base:1")
    for package in ("python3-pip", "python3-venv", "python-is-python3", "libpython3.11"):
        assert package in text
    assert "EXTERNALLY-MANAGED" in text


def test_tree_copy_is_what_a_clone_plus_uncommitted_work_holds(tmp_path):
    repo = tmp_path / "repo"
    (repo / "model_repository").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/model_repository/*\n!/model_repository/README.md\n")
    (repo / "model_repository" / "README.md").write_text("readme")
    (repo / "model_repository" / "built.onnx").write_text("big")
    (repo / "new.py").write_text("untracked, not ignored")
    subprocess.run(["git", "-C", str(repo), "add", ".gitignore", "model_repository/README.md"], check=True)
    copy = rehearse.copy_tree(repo, tmp_path / "copy")
    assert sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file()) == [
        ".gitignore", "model_repository/README.md", "new.py"]


def test_unreadable_finds_root_only_folders_and_files(tmp_path):
    (tmp_path / "a").mkdir(mode=0o700)
    (tmp_path / "a").chmod(0o700)
    (tmp_path / "b.txt").write_text("x")
    (tmp_path / "b.txt").chmod(0o600)
    (tmp_path / "c.txt").write_text("x")
    (tmp_path / "c.txt").chmod(0o644)
    tmp_path.chmod(0o755)
    assert sorted(unreadable(tmp_path)) == ["a", "b.txt"]


def test_imported_modules_sees_lazy_imports():
    source = "import os\ndef f():\n    import tritonclient.http\n    from PIL import Image\n"
    assert rehearse.imported_modules(source) == {"os", "tritonclient", "PIL"}


def test_server_imports_follow_the_launcher_to_the_client():
    found = rehearse.server_imports(rehearse.ROOT)
    assert "tritonclient" in found  # launcher -> warm-up -> client (issue 20, item 2)
    assert "numpy" in found


def test_extract_wheel_keeps_execute_bits(tmp_path):
    import zipfile

    wheel = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, mode in (("pkg/bin/server", 0o100777), ("pkg/lib.py", 0o100644)):
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            archive.writestr(info, "x")
    out = rehearse.extract_wheel(wheel, tmp_path / "out")
    assert (out / "pkg/bin/server").stat().st_mode & 0o777 == 0o755
    assert (out / "pkg/lib.py").stat().st_mode & 0o777 == 0o644


def test_triton_standin_checks_its_server_is_executable():
    text = rehearse.triton_containerfile("localhost/base:1", "/root/.pyenv/versions/3.10.13")
    assert "test -x /opt/tritonserver/bin/tritonserver" in text


def test_the_no_gpu_override_drops_only_the_gpu_reservations_and_the_triton_ulimits():
    import sys

    import yaml

    binary = sys.executable.replace("/python", "/docker-compose")

    def config(*files: str) -> dict:
        command = [binary, "--project-directory", str(rehearse.ROOT), "--profile", "gpu"]
        for name in files:
            command += ["-f", str(rehearse.ROOT / name)]
        out = subprocess.run([*command, "config", "--format", "yaml"], capture_output=True, check=True,
                             env={"PATH": "/usr/bin:/bin"}).stdout
        return yaml.safe_load(out)["services"]

    shipped = config("docker-compose.yml")
    rehearsed = config("docker-compose.yml", rehearse.NO_GPU_OVERRIDE)
    for name in ("triton", "trt-engine-builder"):
        assert shipped[name]["deploy"]["resources"]["reservations"]["devices"]
        assert not rehearsed[name].get("deploy")
        shipped[name].pop("deploy")
        rehearsed[name].pop("deploy", None)
    assert shipped["triton"].pop("ulimits") and "ulimits" not in rehearsed["triton"]
    assert rehearsed == shipped


def test_a_failed_step_fails_the_rehearsal_and_only_the_clean_up_runs_after_it(tmp_path, monkeypatch, capsys):
    from tools.rehearse import steps as rehearse_steps

    ran = []

    def step(name, ok=True):
        def function():
            ran.append(name)
            if not ok:
                raise RuntimeError(f"{name} broke")
            return f"{name} done"
        return function

    monkeypatch.setattr(rehearse_steps, "steps", lambda r: [
        ("cpu: compose up", step("up", ok=False)), ("gpu: builder service", step("gpu")),
        (rehearse.CLEANUP_STEP, step("clean"))])
    r = rehearsal.Rehearsal(rehearse.ROOT, tmp_path, tmp_path / "log")
    monkeypatch.setattr(r, "step_podman", step("podman"))
    monkeypatch.setattr(r, "step_standins", step("standins"))
    monkeypatch.setattr(r, "step_container_names", step("names"))
    monkeypatch.setattr(r, "step_build_targets", step("build"))
    assert r.run_all() == 1
    assert ran == ["podman", "standins", "names", "build", "up", "clean"]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rehearse: [")]
    assert len(lines) == 6 and lines[4].startswith("rehearse: [FAIL] cpu: compose up") and "up broke" in lines[4]
