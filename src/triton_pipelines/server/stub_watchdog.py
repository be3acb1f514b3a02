"""Triton does not restart a Python-backend stub that died (OOM kill, a crash in a native library,
``kill -9``): the model stays READY while every request to it fails with "Stub process ... is not
healthy", and ``load`` is a no-op for it. ``StubWatchdog`` compares the stubs each READY model had
with the live ones (``/proc``), and reloads a model that lost one with its own config plus a new
``watchdog_generation`` parameter: a changed config makes Triton load new instances and swap them in
(no moment without the model, so ensembles calling it never see it missing). Triton 2.51 never
releases the old instance once its dead stub has failed a request (its unload waits forever): those
models are remembered as ``leaked`` so the stop does not wait for them.

One watchdog per replica; the replica's reconcile pass (``replicas.py``) calls ``detect`` and, while
the replica is DEGRADED, ``repair`` in a thread of its own.
"""

from __future__ import annotations

import time
import urllib.error
from typing import Callable

from triton_pipelines.server.control import ControlClient, ControlError
from triton_pipelines.server.processes import Stub, find_stubs
from triton_pipelines.server.status import LauncherMetrics


class StubWatchdog:
    """Finds models whose Python stubs died (``detect``) and reloads them (``repair``); the replica's
    reconcile pass calls both, and routes around a replica with a dead stub meanwhile."""

    def __init__(self, control: ControlClient, server_pid: Callable[[], int], metrics: LauncherMetrics,
                 log: Callable[[str], None], replica: str = "0", reload_timeout_s: float = 120.0,
                 confirm_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.control = control
        self.server_pid = server_pid
        self.metrics = metrics
        self.log = log
        self.replica = replica
        self.reload_timeout_s = reload_timeout_s
        # A stub missing this long is dead: a reload by someone else (a config change unloads the old
        # instance, then starts the new one's stub) leaves a gap of a fraction of a second.
        self.confirm_s = confirm_s
        self.clock = clock
        # (model, version) → identities of the stubs it had while READY
        self.expected: dict[tuple[str, str], set[tuple[str, str, str]]] = {}
        self.missing_since: dict[tuple[str, str, str], float] = {}
        self.dead: dict[str, list[str]] = {}  # model → dead instance names (until repaired)
        self.leaked: set[str] = set()  # models with an instance Triton will never finish unloading
        self.generation = 0

    def reset(self) -> None:
        """A new server process: nothing is expected of it yet."""
        self.expected.clear()
        self.missing_since.clear()
        self.dead.clear()
        self.leaked.clear()

    def reload(self, model: str) -> None:
        """Load ``model`` again with its config and a new generation: new instances replace the old."""
        config = self.control.config(model)
        self.generation += 1
        config.setdefault("parameters", {})["watchdog_generation"] = {"string_value": str(self.generation)}
        self.control.load(model, config=config, timeout_s=self.reload_timeout_s)

    def _ready_versions(self) -> set[tuple[str, str]]:
        return {(m["name"], str(m.get("version", ""))) for m in self.control.index() if m.get("state") == "READY"}

    def _still_configured(self, model: str, instance: str) -> bool:
        """An instance name ``<model>_<group>_<index>`` is still expected by the model's config
        (a reload with fewer instances is not a death)."""
        try:
            groups = self.control.config(model).get("instance_group", [])
            group, index = (int(part) for part in instance[len(model) + 1:].split("_")[-2:])
        except (ControlError, ValueError, OSError):
            return True
        return group < len(groups) and index < int(groups[group].get("count", 1))

    def detect(self) -> dict[str, list[str]]:
        """Models with a stub missing for ``confirm_s`` while READY → their dead instance names."""
        ready = self._ready_versions()
        stubs: list[Stub] = [stub for stub in find_stubs(self.server_pid()) if stub.serves_requests]
        ready_again = self._ready_versions()  # a model that was reloaded meanwhile is not judged
        alive = {stub.identity for stub in stubs}
        for key in list(self.expected):
            if key not in ready or key not in ready_again:
                del self.expected[key]
        for stub in stubs:
            key = (stub.model, stub.version)
            if key in ready and key in ready_again:
                self.expected.setdefault(key, set()).add(stub.identity)
        now = self.clock()
        missing = {identity for identities in self.expected.values() for identity in identities - alive}
        self.missing_since = {i: self.missing_since.get(i, now) for i in missing}
        dead: dict[str, list[str]] = {}
        for identity, since in self.missing_since.items():
            if now - since < self.confirm_s:
                continue
            if self._still_configured(identity[0], identity[2]):
                dead.setdefault(identity[0], []).append(identity[2])
            else:
                self.expected.get(identity[:2], set()).discard(identity)
        self.metrics.set_ready(self.replica, {key: int(key[0] not in dead) for key in ready})
        self.dead = dead
        return dead

    def repair(self) -> list[str]:
        """Reload every model found dead; returns those reloaded."""
        repaired = []
        for model, instances in sorted(self.dead.items()):
            self.log(f"watchdog: Python stub(s) {', '.join(sorted(instances))} of model '{model}' died; "
                     f"reloading '{model}'")
            started = self.clock()
            self.leaked.add(model)
            try:
                self.reload(model)
            except (ControlError, OSError, urllib.error.URLError) as error:
                self.log(f"watchdog: reloading '{model}' failed: {error}; will retry")
                continue
            for key in [k for k in self.expected if k[0] == model]:
                del self.expected[key]
            self.missing_since = {i: t for i, t in self.missing_since.items() if i[0] != model}
            with self.metrics.lock:
                self.metrics.stub_restarts[model] += 1
            self.dead.pop(model, None)
            repaired.append(model)
            self.log(f"watchdog: '{model}' reloaded in {self.clock() - started:.1f} s")
        return repaired

    def missing_now(self) -> dict[str, list[str]]:
        """Models with a stub that was running at the last pass and is gone now (one /proc scan, no
        control call, nothing changed): readiness says so at once, before ``detect`` confirms it."""
        expected = [identity for identities in list(self.expected.values()) for identity in identities]
        if not expected:
            return {}
        alive = {stub.identity for stub in find_stubs(self.server_pid()) if stub.serves_requests}
        missing: dict[str, list[str]] = {}
        for identity in expected:
            if identity not in alive:
                missing.setdefault(identity[0], []).append(identity[2])
        return missing

    def problems(self) -> list[str]:
        dead = self.dead or self.missing_now()
        return [f"model '{m}': Python stub(s) {', '.join(sorted(i))} died (reloading)"
                for m, i in sorted(dead.items())]
