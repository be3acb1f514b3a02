"""The ``wheel`` fixture: the project's wheel, built once per module that asks for it (the builder
installed non-editable, the Python 3.10 serving venv). A plugin of tests/conftest.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import PROJECT_ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of what the Dockerfile copies (setuptools writes its
    build/lib next to build/repo_builder: not in the working tree)."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    shutil.copy2(PROJECT_ROOT / "pyproject.toml", source)
    shutil.copytree(PROJECT_ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(PROJECT_ROOT / "build" / "repo_builder", source / "build" / "repo_builder",
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(source)], check=True, capture_output=True, timeout=300)
    (found,) = out.glob("triton_pipelines-*.whl")
    return found
