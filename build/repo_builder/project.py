"""Where the project is: the folder holding the sources the builder assembles the repository from
(``python_models/``, ``ensembles/``, ``data/``), never where the builder is installed."""

from __future__ import annotations

import os
from pathlib import Path

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
