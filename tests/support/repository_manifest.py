"""A manifest of a built model repository, to tell whether a change to the builder or the sources
changed what Triton serves: every path, with the SHA-256 of each text file (configs, ``model.py``,
the stamp, assets) and, for the weights (ONNX, NumPy archives, content-hash keys: content-hashed
by the builder already, and not bit-for-bit stable across machines), only that they are there;
a symlink by its target.

    .venv/bin/python -m tests.support.repository_manifest            # what differs from the committed manifest
    .venv/bin/python -m tests.support.repository_manifest --write    # after a deliberate change: read the diff

tests/unit/builder/test_repository_manifest.py compares the default embedded build (``make repository``) with
``tests/data/repository_manifest.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from tests.support.paths import PROJECT_ROOT

ROOT = PROJECT_ROOT
MANIFEST = ROOT / "tests" / "data" / "repository_manifest.json"
WEIGHTS = (".onnx", ".onnx.data", ".npz", ".plan", ".content-hash")
# Written into the repository after the build: the planner's cache of measured graphs (repo_builder
# plan) and the router's run-time split (the rollout).
NOT_BUILT = {".plan-graphs.json", "router/splits.json"}


def manifest(repository: Path) -> dict[str, str]:
    """Relative path → ``sha256:<hex>``, ``weights`` or ``-> <link target>``."""
    entries = {}
    for path in sorted(repository.rglob("*")):
        relative = path.relative_to(repository)
        if ("__pycache__" in relative.parts or relative.as_posix() in NOT_BUILT
                or (path.is_dir() and not path.is_symlink())):
            continue
        if path.is_symlink():
            entries[relative.as_posix()] = f"-> {path.readlink().as_posix()}"
        elif path.name.endswith(WEIGHTS):
            entries[relative.as_posix()] = "weights"
        else:
            entries[relative.as_posix()] = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    return entries


def differences(expected: dict[str, str], found: dict[str, str]) -> list[str]:
    return ([f"missing: {p}" for p in sorted(set(expected) - set(found))]
            + [f"new: {p}" for p in sorted(set(found) - set(expected))]
            + [f"changed: {p}" for p in sorted(set(expected) & set(found)) if expected[p] != found[p]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.repository_manifest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--write", action="store_true", help=f"write {MANIFEST.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    found = manifest(args.repository)
    if args.write:
        MANIFEST.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
        return 0
    changes = differences(json.loads(MANIFEST.read_text()), found)
    print("\n".join(changes) or "identical")
    return 1 if changes else 0


if __name__ == "__main__":
    sys.exit(main())
