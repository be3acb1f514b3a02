"""Changing what a running server serves for a rollout: a family's loaded versions, the ensembles
for a version, the plain ensembles' pin, the warm-up through them, the router's split file, and new
files for a serving version (``replace``). The ``Rollout`` façade (``rollout.py``) decides when."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

from triton_pipelines.ops.rollout_plan import Family, RolloutError
from triton_pipelines.server.control import ControlClient
from triton_pipelines.server.warmup import warm_server


def write_split(split_file: Path, model: str, shares: Mapping[int, float]) -> None:
    """``model``'s shares in the router's split file, atomically: the router stats the file on every
    canary request and must never read half of it."""
    try:
        document = json.loads(split_file.read_text())
        if not isinstance(document, dict):
            document = {}
    except (FileNotFoundError, ValueError):
        document = {}
    document[model] = {str(v): round(s, 6) for v, s in sorted(shares.items()) if s > 0}
    split_file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".splits-", dir=split_file.parent)
    with os.fdopen(fd, "w") as handle:
        json.dump(document, handle)
    os.replace(tmp, split_file)


def without_response_cache(config: dict) -> dict:
    """``config`` with Triton's response cache off. Its key is the model's name and version and the
    inputs only (not what the model's steps or files are), and Triton never evicts an entry for a
    reload, so an ensemble whose answers a rollout changes (a re-pin, new files) would keep serving
    the old ones from the cache: it serves uncached until the server restarts with its built config."""
    if config.get("response_cache", {}).get("enable"):
        config["response_cache"] = {"enable": False}
    return config


@dataclass
class VersionSwap:
    """What a rollout changes on the server for a model's family (the actions ``Rollout.run`` takes)."""

    control: ControlClient
    repository: Path
    model: str
    family: Family
    log: Callable[[str], None]
    members: Callable[[], list[str]]  # the family's models this server serves

    def set_versions(self, versions: set[int]) -> None:
        """Load every member with exactly these versions (the server's own config otherwise)."""
        def load(member: str) -> None:
            config = self.control.config(member)
            config["version_policy"] = {"specific": {"versions": sorted(versions)}}
            self.control.load(member, config=config)

        self._each_member(load)

    def _each_member(self, action: Callable[[str], None]) -> None:
        """``action`` on every served member at once (Triton loads them in parallel, up to
        ``--model-load-thread-count``); the first error is raised once all are done."""
        from concurrent.futures import ThreadPoolExecutor

        members = self.members()
        with ThreadPoolExecutor(len(members)) as pool:
            for future in [pool.submit(action, member) for member in members]:
                future.result()

    def unload_ensembles(self, names: Iterable[str], timeout_s: float = 120.0) -> None:
        """Unload ``names`` and wait until they are gone. Before a version is retired: Triton 2.51
        reloads the ensembles that depend on a model when the model is loaded again, and an ensemble
        whose pinned version is the one going away then fails that reload while the other members
        load in parallel, a race that crashed tritonserver (signal 11, seen in test_rollout under
        load). With the retired versions' ensembles unloaded first, nothing depends on them."""
        states = self.control.states()
        names = [name for name in names if states.get(name) not in (None, "UNAVAILABLE")]
        for name in names:
            self.control.unload(name)
        pending = self.control.wait_unloaded(names, time.monotonic() + timeout_s)
        if pending:
            raise RolloutError(f"ensembles {sorted(pending)} still loaded {timeout_s:g} s after their unload")

    def load_ensembles(self, names: Iterable[str]) -> None:
        states = self.control.states()
        for name in names:
            if states.get(name) != "READY":
                self.control.load(name)

    def pin(self, version: int) -> None:
        """Re-pin the plain ensembles: Triton loads each changed ensemble in the background and
        swaps it in; requests in flight finish on the old one (with their handles on the old version)."""
        for ensemble, member in sorted(self.family.pinning_ensembles.items()):
            config = self.control.config(ensemble)
            steps = config.get("ensemble_scheduling", {}).get("step", [])
            if all(int(s.get("model_version", -1)) == version for s in steps if s["model_name"] == member):
                continue
            for step in steps:
                if step["model_name"] == member:
                    step["model_version"] = version
            self.control.load(ensemble, config=without_response_cache(config))
            self.log(f"{ensemble} now serves {member} version {version}")

    def warm(self, version: int) -> None:
        for warmed in warm_server(self.control, self.family.ensembles_serving(version)):
            self.log(f"warmed {warmed.model} end to end ({warmed.seconds * 1e3:.0f} ms)")

    def replace_files(self, version: int, files: Path, loaded_versions: Callable[[], set[int]],
                      pinned_versions: Callable[[], dict[str, int]]) -> None:
        """Put new files in a serving version's folder and reload it without a failed request.

        Files are copied into a staging folder inside the version folder and renamed into place
        (a load never sees half a file); the latency variants' folders hold symlinks to them, so
        their version folder is touched (Triton decides what to reload by modification times,
        and a symlink to a new file is not a modification). Then each member is loaded with its
        own config named explicitly: Triton loads the changed version in the background and
        swaps it in; the other versions and the ensembles keep serving (they are reloaded in the
        background too). The version's pipelines are warmed end to end afterwards. ``loaded_versions`` and
        ``pinned_versions``: the rollout's view of the server, asked when needed."""
        version_dir = self.repository / self.model / str(version)
        new_files = sorted(p for p in Path(files).iterdir() if p.is_file())
        if not version_dir.is_dir():
            raise RolloutError(f"{version_dir} does not exist: `replace` changes a serving version's files")
        if not new_files:
            raise RolloutError(f"{files} holds no files")
        if version not in loaded_versions():
            raise RolloutError(f"{self.model} version {version} is not loaded: put its files in place and use `start`")
        self._check_onnx(new_files)
        # before the files change: no answer of the old files is served from the cache after it
        self.uncache({e for e, v in pinned_versions().items() if v == version}
                     | set(self.family.versioned_ensembles.get(version, ())))
        staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=version_dir))
        try:
            for path in new_files:
                shutil.copyfile(path, staging / path.name)  # modified now: Triton sees the change
                with open(staging / path.name, "rb") as handle:
                    os.fsync(handle.fileno())
            for path in new_files:
                os.replace(staging / path.name, version_dir / path.name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        for member in self.family.members[1:]:
            os.utime(self.repository / member / str(version))
        self.log(f"{', '.join(p.name for p in new_files)} in place in {version_dir}; reloading version {version}")
        started = time.monotonic()
        self._each_member(lambda member: self.control.load(member, config=self.control.config(member)))
        self.log(f"{', '.join(self.members())} version {version} reloaded in {time.monotonic() - started:.1f} s")
        pinned = {e for e, v in pinned_versions().items() if v == version}
        self.load_ensembles(self.family.versioned_ensembles.get(version, ()))
        warm_server(self.control, sorted(pinned | set(self.family.versioned_ensembles.get(version, ()))))

    def uncache(self, ensembles: Iterable[str]) -> None:
        """Reload the loaded ones of ``ensembles`` whose response cache is on with it off
        (``without_response_cache``): what they answered before new files is in the cache."""
        states = self.control.states()
        for name in sorted(ensembles):
            if states.get(name) != "READY":
                continue
            config = self.control.config(name)
            if config.get("response_cache", {}).get("enable"):
                self.control.load(name, config=without_response_cache(config))
                self.log(f"{name}: response cache off until the server restarts (its answers changed)")

    def _check_onnx(self, files: list[Path]) -> None:
        """A new ``model.onnx`` must take and give the tensors the served config names."""
        onnx_files = [p for p in files if p.name == "model.onnx"]
        if not onnx_files:
            return
        import onnx

        graph = onnx.load(str(onnx_files[0]), load_external_data=False).graph
        config = self.control.config(self.model)
        initializers = {i.name for i in graph.initializer}
        have = ({i.name for i in graph.input} - initializers, {o.name for o in graph.output})
        want = ({i["name"] for i in config.get("input", [])}, {o["name"] for o in config.get("output", [])})
        if not want[0] <= have[0] or not want[1] <= have[1]:
            raise RolloutError(f"{onnx_files[0]} has inputs {sorted(have[0])} and outputs {sorted(have[1])}; "
                               f"{self.model} serves {sorted(want[0])} → {sorted(want[1])}")
