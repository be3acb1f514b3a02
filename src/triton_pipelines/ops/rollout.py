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
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

from triton_pipelines.server.control import STATE_ENV, ControlClient, ControlError
from triton_pipelines.server.state import ServerState
from triton_pipelines.ops.rollout_plan import (Action, Family, Gate, Hold, LoadEnsembles, LoadVersions, Metrics, Pin, Retire,
                           RolloutError, Settle, StepReport, WaitDrained, WaitUnloaded, Warm, WriteSplit,
                           check_steps, judge, measure, plan_move, route_table, served)
from triton_pipelines.server.warmup import warm_server

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

    # ------------------------------------------------------------------ actions
    def write_split(self, shares: Mapping[int, float]) -> None:
        """Atomically: the router stats the file on every canary request and must never read half of it."""
        try:
            document = json.loads(self.split_file.read_text())
            if not isinstance(document, dict):
                document = {}
        except (FileNotFoundError, ValueError):
            document = {}
        document[self.model] = {str(v): round(s, 6) for v, s in sorted(shares.items()) if s > 0}
        self.split_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".splits-", dir=self.split_file.parent)
        with os.fdopen(fd, "w") as handle:
            json.dump(document, handle)
        os.replace(tmp, self.split_file)

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
            self.control.load(ensemble, config=config)
            self.log(f"{ensemble} now serves {member} version {version}")

    def warm(self, version: int) -> None:
        for warmed in warm_server(self.control, self.family.ensembles_serving(version)):
            self.log(f"warmed {warmed.model} end to end ({warmed.seconds * 1e3:.0f} ms)")

    def wait_drained(self, versions: set[int]) -> None:
        """Until the versions got no request for ``quiet_s`` and nothing is pending on them."""
        deadline = time.monotonic() + self.drain_timeout_s
        last, quiet_since = None, time.monotonic()
        while True:
            metrics = Metrics.scrape(self.metrics_url)
            served_now = served(metrics, self.family, versions)
            pending = metrics.total("nv_inference_pending_request_count", model=self.family.members,
                                    version=[str(v) for v in versions])
            if served_now != last or pending:
                last, quiet_since = served_now, time.monotonic()
            elif time.monotonic() - quiet_since >= self.quiet_s:
                return
            if time.monotonic() > deadline:
                self.log(f"version(s) {sorted(versions)} still get requests after {self.drain_timeout_s:g} s "
                         f"(callers naming the version?); retiring anyway: requests in flight still finish")
                return
            time.sleep(min(self.poll_s, self.quiet_s / 2))

    def wait_unloaded(self, versions: set[int]) -> None:
        deadline = time.monotonic() + self.unload_timeout_s
        while time.monotonic() < deadline:
            busy = [(e["name"], e.get("version")) for e in self.control.index()
                    if e.get("name") in self.family.members and e.get("version")
                    and int(e["version"]) in versions and e.get("state") in ("READY", "UNLOADING")]
            if not busy:
                return
            time.sleep(0.2)
        self.log(f"version(s) {sorted(versions)} are still unloading after {self.unload_timeout_s:g} s")

    def hold(self, share: float, target: int, sources: set[int], hold_s: float, gate: Gate) -> StepReport:
        """Watch a step for ``hold_s``; ends early on a breach."""
        report = StepReport(share)
        start = Metrics.scrape(self.metrics_url)
        ends = time.monotonic() + hold_s
        while True:
            time.sleep(max(0.0, min(self.poll_s, ends - time.monotonic())))
            report = measure(start, Metrics.scrape(self.metrics_url), self.family, share, target, sources)
            report.breach = judge(gate, report)
            if report.breach or time.monotonic() >= ends:
                return report

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
            self.set_versions(set(action.versions))
        elif isinstance(action, LoadEnsembles):
            self.load_ensembles(self.family.versioned_ensembles.get(action.version, ()))
        elif isinstance(action, Pin):
            self.pin(action.version)
        elif isinstance(action, Warm):
            self.warm(action.version)
        elif isinstance(action, WriteSplit):
            shares = action.as_dict()
            self.write_split(shares)
            self.log(f"router split {({v: round(s, 2) for v, s in shares.items() if s > 0})}")
        elif isinstance(action, Hold):
            return self.hold(action.share, action.target, set(action.sources), action.hold_s, gate)
        elif isinstance(action, WaitDrained):
            self.log(f"waiting until version(s) {sorted(action.versions)} get no more requests")
            self.wait_drained(set(action.versions))
        elif isinstance(action, Retire):
            remaining_versions = (self.loaded_versions() | {action.keep}) - action.versions
            self.log(f"retiring version(s) {sorted(action.versions)}: {self.model} now loads "
                     f"{sorted(remaining_versions)}")
            self.set_versions(remaining_versions)
        elif isinstance(action, WaitUnloaded):
            self.wait_unloaded(set(action.versions))
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

    # ------------------------------------------------------------------ same version, new files
    def replace_files(self, version: int, files: Path) -> None:
        """Put new files in a serving version's folder and reload it without a failed request.

        Files are copied into a staging folder inside the version folder and renamed into place
        (a load never sees half a file); the latency variants' folders hold symlinks to them, so
        their version folder is touched (Triton decides what to reload by modification times,
        and a symlink to a new file is not a modification). Then each member is loaded with its
        own config named explicitly: Triton loads the changed version in the background and
        swaps it in; the other versions and the ensembles keep serving (they are reloaded in the
        background too). The version's pipelines are warmed end to end afterwards."""
        version_dir = self.repository / self.model / str(version)
        new_files = sorted(p for p in Path(files).iterdir() if p.is_file())
        if not version_dir.is_dir():
            raise RolloutError(f"{version_dir} does not exist: `replace` changes a serving version's files")
        if not new_files:
            raise RolloutError(f"{files} holds no files")
        if version not in self.loaded_versions():
            raise RolloutError(f"{self.model} version {version} is not loaded: put its files in place and use `start`")
        self._check_onnx(new_files)
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
        pinned = {e for e, v in self.pinned_versions().items() if v == version}
        self.load_ensembles(self.family.versioned_ensembles.get(version, ()))
        warm_server(self.control, sorted(pinned | set(self.family.versioned_ensembles.get(version, ()))))

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
