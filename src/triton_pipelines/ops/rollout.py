"""Move a compute model from one version to another on a running server, without failed requests.

    python -m triton_pipelines rollout status text_encoder
    python -m triton_pipelines rollout start text_encoder --to 2 --steps 10,50,100 --hold-s 60 --max-p99-ms 250
    python -m triton_pipelines rollout rollback text_encoder --to 1
    python -m triton_pipelines rollout replace text_encoder --version 1 --files new_weights/

Everything goes through Triton's model-repository API with the control key (``ControlClient``),
the router's run-time split file and the metrics endpoint. Triton 2.51 has no rollout strategy of
its own (neither a config field nor a server flag; docs/operations.md maps the tutorial's invented
ones); what it does have, and what this builds on (checked against the 2.51 server and its source):

- ``load`` with a config whose ``version_policy`` adds a version loads that version beside the
  serving ones (those are only "updated": no new instances, no pause); ``model_warmup`` runs on
  the new instances before the version is READY. A policy without a version unloads it: requests
  already holding it finish, new requests for it fail.
- An ensemble request takes a handle on every step model when it starts, so a version retired
  under it stays alive until it is done. Loading an ensemble with a changed step version loads the
  new ensemble in the background and swaps it in; in-flight requests finish on the old one.
- Ensembles downstream of a loaded model are re-checked: one pinned to a version that is no longer
  loaded is UNLOADED (so retire a version only after nothing is pinned to it), the others are
  reloaded in the background.
- A ``load`` after a version's files changed reloads that version in the background and swaps it
  in; the other versions are untouched.

The rollout (``Rollout.move``), for a model and its latency-class variants (``text_encoder`` and
``text_encoder_batch``, one "family"), planned without a server by ``rollout_plan.plan_move``
(the actions, their order and the gate are there and unit-tested) and run here against the server
(``Rollout.execute``):

1. load the target version beside the serving ones (Triton warms each instance by config), load the
   ensembles named ``<ensemble>_v<N>`` for it, and send one request through each of them (an
   ensemble cannot be warmed by config, and a version that cannot answer gets no traffic);
2. shift the router's traffic in steps through its split file, holding each step while watching
   the failures and the new version's p99 in the metrics; past a threshold it rolls back (or stops);
3. re-pin the ensembles that direct callers use (``text_embedding``, ``text_embedding_batch``) to
   the target version;
4. wait until the old version gets no requests, then retire it (a version policy without it).

The router sends version 1 to the plain ensembles and version N to ``<ensemble>_v<N>``, so the
plain ensembles are re-pinned last when moving away from version 1 and first when moving to it:
the router never labels a request with a version that did not serve it.

Run-time state: what this changes lives in the server (config overrides) and in the split file. A
restarted server serves the repository's built configs again (both canary versions, plain
ensembles on version 1) with the split file as it was left: run ``start`` again to re-apply.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

from triton_pipelines.server.control import STATE_ENV, ControlClient, ControlError
from triton_pipelines.server.state import ServerState
from triton_pipelines.ops.rollout_plan import (Action, Family, Gate, Hold, LoadEnsembles, LoadVersions, Metrics, Pin, Retire,
                           RolloutError, Settle, StepReport, WaitDrained, WaitUnloaded, Warm, WriteSplit,
                           check_steps, judge, plan_move, route_table)
from triton_pipelines.ops.rollout_replace import VersionSwap, write_split
from triton_pipelines.ops.rollout_watch import RolloutWatch

__all__ = ["Breach", "Family", "Gate", "Metrics", "Rollout", "RolloutError", "StepReport", "judge", "main"]
EXIT_BREACH = 3


class Breach(RolloutError):
    def __init__(self, message: str, steps: list[StepReport], rolled_back: bool):
        super().__init__(message)
        self.steps = steps
        self.rolled_back = rolled_back


# ----------------------------------------------------------------------------------- the rollout
def default_split_file(repository: Path) -> Path:
    """Where the router reads its split (``ROUTER_SPLIT_FILE`` or the repository's router folder)."""
    return Path(os.environ.get("ROUTER_SPLIT_FILE") or repository / "router" / "splits.json")


@dataclass
class Rollout:
    control: ControlClient
    metrics_url: str
    repository: Path
    model: str
    split_file: Path | None = None
    log: Callable[[str], None] = lambda message: print(f"[rollout] {message}", flush=True)
    poll_s: float = 1.0
    # drain: the old version must see no new request for this long (and nothing pending)
    quiet_s: float = 2.0
    drain_timeout_s: float = 120.0
    unload_timeout_s: float = 120.0
    family: Family = field(init=False)

    def __post_init__(self):
        self.repository = Path(self.repository)
        self.family = Family.from_repository(self.repository, self.model)
        self.split_file = Path(self.split_file) if self.split_file else default_split_file(self.repository)

    # ------------------------------------------------------------------ what the server serves
    def _ready(self) -> dict[str, set[int]]:
        ready: dict[str, set[int]] = {m: set() for m in self.family.members}
        for entry in self.control.index():
            if entry.get("name") in ready and entry.get("state") == "READY" and entry.get("version"):
                ready[entry["name"]].add(int(entry["version"]))
        return ready

    def members(self) -> list[str]:
        """The family's models this server serves (a server may load a subset of the repository)."""
        served = [m for m, versions in self._ready().items() if versions]
        if not served:
            raise RolloutError(f"the server serves no version of {self.model}")
        return served

    def loaded_versions(self) -> set[int]:
        """Versions READY for every served member of the family."""
        ready = [versions for versions in self._ready().values() if versions]
        return set.intersection(*ready) if ready else set()

    def pinned_versions(self) -> dict[str, int]:
        """Plain ensemble → the version it serves now (loaded ensembles only)."""
        pins = {}
        for ensemble, member in self.family.pinning_ensembles.items():
            try:
                config = self.control.config(ensemble)
            except ControlError:
                continue
            for step in config.get("ensemble_scheduling", {}).get("step", []):
                if step["model_name"] == member:
                    pins[ensemble] = int(step.get("model_version", -1))
        return pins

    def current_version(self) -> int:
        if not self.family.pinning_ensembles:
            raise RolloutError(f"no ensemble pins a version of {self.model}: only a model with versions side by "
                               f"side (canaries in data/routes.yaml) can be rolled out; `replace` works for any")
        pins = set(self.pinned_versions().values())
        if len(pins) != 1:
            raise RolloutError(f"the plain ensembles of {self.model} pin different versions {self.pinned_versions()}: "
                               f"run `rollback {self.model} --to N` to settle them")
        return pins.pop()

    def split(self) -> dict[int, float]:
        """The router's shares for this model: the split file's, else the route file's default."""
        try:
            document = json.loads(self.split_file.read_text())
            if self.model in document:
                return {int(v): float(s) for v, s in document[self.model].items()}
        except (FileNotFoundError, ValueError):
            pass
        routes = route_table(self.repository)
        if routes is not None and self.model in routes.canaries:
            return dict(routes.canaries[self.model].split)
        return {self.current_version(): 100.0}

    def status(self) -> dict:
        states = {}
        for entry in self.control.index():
            if entry.get("name") in self.family.members or any(
                    entry.get("name") in names for names in self.family.versioned_ensembles.values()):
                states.setdefault(entry["name"], {})[entry.get("version") or "-"] = entry.get("state") or "not loaded"
        return {"model": self.model, "members": list(self.family.members), "loaded_versions": sorted(self.loaded_versions()),
                "plain_ensembles": self.pinned_versions(), "router_split": self.split(),
                "split_file": str(self.split_file), "router_tasks": list(self.family.canary_tasks), "states": states}

    # ------------------------------------------------------------------ collaborators
    @property
    def watch(self) -> RolloutWatch:
        """Holds, drains and unloads watched through the metrics and the model states (``rollout_watch.py``)."""
        return RolloutWatch(self.control, self.metrics_url, self.family, self.log, self.poll_s, self.quiet_s,
                            self.drain_timeout_s, self.unload_timeout_s)

    @property
    def swap(self) -> VersionSwap:
        """Versions, ensembles, pins and files changed on the server (``rollout_replace.py``)."""
        return VersionSwap(self.control, self.repository, self.model, self.family, self.log, self.members)

    def write_split(self, shares: Mapping[int, float]) -> None:
        write_split(self.split_file, self.model, shares)

    def replace_files(self, version: int, files: Path) -> None:
        """New files for a serving version, reloaded without a failed request (``VersionSwap.replace_files``)."""
        self.swap.replace_files(version, files, self.loaded_versions, self.pinned_versions)

    # ------------------------------------------------------------------ actions
    def _check_target(self, version: int) -> None:
        for member in self.family.members:
            folder = self.repository / member / str(version)
            if not folder.is_dir() or not any(folder.iterdir()):
                raise RolloutError(f"{member} version {version} is not built ({folder} is missing): declare it "
                                   f"under canaries in data/routes.yaml and run `make repository`")
        if self.family.canary_tasks and version not in self.family.router_versions:
            raise RolloutError(f"the router does not know {self.model} version {version} (its route file declares "
                               f"{list(self.family.router_versions)}): declare it under canaries and rebuild")

    def move(self, target: int, steps: Iterable[float] = (10, 50, 100), hold_s: float = 60.0,
             gate: Gate = Gate(), on_breach: str = "rollback") -> list[StepReport]:
        """Serve ``target`` instead of the versions serving now (see the module docstring): the
        server's state, ``rollout_plan.plan_move``'s actions, run in order.
        On a breach: ``rollback`` moves everything back at once and raises ``Breach``; ``stop``
        leaves the split where it was and raises ``Breach``."""
        if on_breach not in ("rollback", "stop"):
            raise ValueError("on_breach must be 'rollback' or 'stop'")
        self._check_target(target)
        steps = check_steps(steps)
        loaded, current, split = self.loaded_versions(), self.current_version(), self.split()
        self.log(f"{self.model}: loaded {sorted(loaded)}, plain ensembles on {current}, router split {split}; "
                 f"moving to version {target}")
        return self.execute(plan_move(loaded, current, split, target, steps, hold_s), gate, on_breach)

    def execute(self, actions: Iterable[Action], gate: Gate = Gate(), on_breach: str = "rollback") -> list[StepReport]:
        """Run a plan's actions in order; a hold's report is logged, and a breach ends the plan."""
        reports = []
        for action in actions:
            report = self.run(action, gate)
            if report is None:
                continue
            reports.append(report)
            self.log(report.line())
            if report.breach:
                self._breached(report, reports, action, on_breach)
        return reports

    def run(self, action: Action, gate: Gate = Gate()) -> StepReport | None:
        """One action against the server (a ``Hold`` returns its report)."""
        if isinstance(action, LoadVersions):
            self.log(f"loading {self.model} version {action.added} beside {sorted(action.versions - {action.added})} "
                     f"({', '.join(self.family.members)}; warmed by config before READY)")
            self.swap.set_versions(set(action.versions))
        elif isinstance(action, LoadEnsembles):
            self.swap.load_ensembles(self.family.versioned_ensembles.get(action.version, ()))
        elif isinstance(action, Pin):
            self.swap.pin(action.version)
        elif isinstance(action, Warm):
            self.swap.warm(action.version)
        elif isinstance(action, WriteSplit):
            shares = action.as_dict()
            self.write_split(shares)
            self.log(f"router split {({v: round(s, 2) for v, s in shares.items() if s > 0})}")
        elif isinstance(action, Hold):
            return self.watch.hold(action.share, action.target, set(action.sources), action.hold_s, gate)
        elif isinstance(action, WaitDrained):
            self.log(f"waiting until version(s) {sorted(action.versions)} get no more requests")
            self.watch.wait_drained(set(action.versions))
        elif isinstance(action, Retire):
            remaining_versions = (self.loaded_versions() | {action.keep}) - action.versions
            self.log(f"retiring version(s) {sorted(action.versions)}: {self.model} now loads "
                     f"{sorted(remaining_versions)}")
            self.swap.unload_ensembles([name for version in sorted(action.versions)
                                        for name in self.family.versioned_ensembles.get(version, ())])
            self.swap.set_versions(remaining_versions)
        elif isinstance(action, WaitUnloaded):
            self.watch.wait_unloaded(set(action.versions))
        elif isinstance(action, Settle):
            self.write_split({action.version: 100.0})
            self.log(f"{self.model} version {action.version} serves all traffic")
        else:
            raise TypeError(f"not a rollout action: {action!r}")
        return None

    def _breached(self, report: StepReport, reports: list[StepReport], hold: Hold, on_breach: str):
        if on_breach == "stop":
            raise Breach(f"stopped at {report.share:g}%: {report.breach} (the split stays; `rollback` or "
                         f"`start` again)", reports, rolled_back=False)
        back = hold.rollback_to
        self.log(f"breach at {report.share:g}%: {report.breach}; rolling back to version {back}")
        self.move(back, steps=(100,), hold_s=0)
        raise Breach(f"rolled back to version {back} at {report.share:g}%: {report.breach}", reports, rolled_back=True)

# ----------------------------------------------------------------------------------- CLI
def connect(state_dir: Path | None) -> tuple[ControlClient, str]:
    """The running launcher's control endpoint and Triton's own metrics URL (from ``server.json``)."""
    control = ControlClient.from_state(state_dir)
    server = ServerState.read(state_dir)
    if len(server.replicas) > 1:
        # Each replica is its own tritonserver with its own loaded versions: a rollout moving one of
        # them would leave nginx's round robin serving a mix.
        raise RolloutError(f"the launcher runs {len(server.replicas)} replicas; a rollout moves one server's "
                           "versions: run it with --replicas 1 (several machines: one rollout per machine, "
                           "out of the load balancer while it runs)")
    return control, f"http://{server.triton_metrics}/metrics"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triton_pipelines rollout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-dir", type=Path, help=f"the launcher's state folder (default ${STATE_ENV} or .triton/8000)")
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--split-file", type=Path, help="the router's split file (default $ROUTER_SPLIT_FILE or "
                                                        "<repository>/router/splits.json)")
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="versions loaded, ensemble pins, router split")
    start = commands.add_parser("start", help="roll a version out in steps, watching failures and p99")
    rollback = commands.add_parser("rollback", help="move all traffic back to a version at once")
    replace = commands.add_parser("replace", help="new files for a serving version, reloaded without failures")
    for command in (status, start, rollback, replace):
        command.add_argument("model")
    start.add_argument("--to", type=int, required=True, dest="version")
    start.add_argument("--steps", default="10,50,100", help="router shares in percent (default 10,50,100)")
    start.add_argument("--hold-s", type=float, default=60.0, help="seconds each step is watched (default 60)")
    start.add_argument("--max-failure-ratio", type=float, default=0.0)
    start.add_argument("--max-p99-ms", type=float)
    start.add_argument("--max-p99-ratio", type=float, help="target p99 over the old version's p99")
    start.add_argument("--min-requests", type=int, default=50, help="requests the target serves in a hold before "
                                                                     "its p99 is judged (default 50)")
    start.add_argument("--on-breach", choices=("rollback", "stop"), default="rollback")
    rollback.add_argument("--to", type=int, dest="version", help="default: the version the plain ensembles serve")
    replace.add_argument("--version", type=int, required=True)
    replace.add_argument("--files", type=Path, required=True, help="a folder with the new files (e.g. model.onnx)")
    args = parser.parse_args(argv)
    try:
        control, metrics_url = connect(args.state_dir)
        rollout = Rollout(control, metrics_url, args.repository, args.model, args.split_file)
        if args.command == "status":
            print(json.dumps(rollout.status(), indent=2))
        elif args.command == "start":
            gate = Gate(args.max_failure_ratio, args.max_p99_ms, args.max_p99_ratio, args.min_requests)
            rollout.move(args.version, [float(s) for s in args.steps.split(",")], args.hold_s, gate, args.on_breach)
        elif args.command == "rollback":
            rollout.move(args.version if args.version is not None else rollout.current_version(), (100,), 0)
        else:
            rollout.replace_files(args.version, args.files)
    except Breach as breach:
        print(f"rollout: {breach}", file=sys.stderr)
        return EXIT_BREACH
    except KeyboardInterrupt:
        print("rollout: interrupted; the split and versions stay where they are: `status` shows them, `rollback` "
              "or `start` again continues", file=sys.stderr)
        return 130
    except (RolloutError, ControlError, OSError) as error:
        print(f"rollout: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
