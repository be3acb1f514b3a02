"""What a rollout does, decided without a server: the family of a compute model, the ordered actions
of a move (``plan_move``), one hold's numbers (``measure``) and the gate's verdict (``judge``).

``rollout.py`` reads the server's state, hands it to ``plan_move`` and runs the actions it returns
(``Rollout.execute``); everything here is a pure function of what it is given (``Metrics.scrape``
and ``Family.from_repository`` aside, which read an endpoint or the built repository), so the
ordering rule is tested without a server (tests/unit/ops/test_rollout_plan.py):

- the target version is loaded, its ensembles loaded and warmed, before the router's split gives it
  any traffic;
- the plain ensembles (direct callers) move last when moving away from version 1 and first when
  moving to it, so the router never labels a request with a version that did not serve it;
- the old versions are retired only after the split took all traffic from them, the direct callers
  were re-pinned and their requests drained;
- a hold whose numbers breach the gate rolls back to ``Hold.rollback_to``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Union

from triton_pipelines import prometheus_text
from triton_pipelines.errors import INPUT_REASONS
from triton_pipelines.repository.ensemble_graph import EnsembleGraph
from triton_pipelines.repository.contract import STABLE_VERSION, BuiltManifest, parse_variant_name

from triton_pipelines.repository.routes import RouteTable


class RolloutError(RuntimeError):
    pass


# ----------------------------------------------------------------------------------- metrics
@dataclass(frozen=True)
class Metrics:
    """One scrape of a Prometheus text endpoint: (name, labels, value) samples."""
    samples: tuple[tuple[str, dict, float], ...]

    @classmethod
    def parse(cls, text: str) -> "Metrics":
        return cls(tuple(prometheus_text.parse_samples(text)))

    @classmethod
    def scrape(cls, url: str, timeout_s: float = 10.0) -> "Metrics":
        return cls.parse(prometheus_text.scrape(url, timeout_s))

    def total(self, name: str, **labels: str | Iterable[str]) -> float:
        """Sum of ``name`` over samples whose labels match (a label given as a collection matches
        any of its values)."""
        return prometheus_text.total(self.samples, name, **labels)

    def largest(self, name: str, **labels) -> float | None:
        values = [value for sample_name, found, value in self.samples
                  if sample_name == name and all(found.get(k) == v for k, v in labels.items())]
        return max(values) if values else None


# ----------------------------------------------------------------------------------- the family
def route_table(repository: Path) -> RouteTable | None:
    """The router's route file as the builder copied it into the repository (None without a router)."""
    routes_file = repository / "router" / "1" / "routes.yaml"
    return RouteTable.load(routes_file) if routes_file.exists() else None


@dataclass(frozen=True)
class Family:
    """A compute model, its latency-class variants (same files, own configs) and the ensembles
    that reach them, as the builder wrote them into the repository."""
    model: str
    members: tuple[str, ...]
    # plain ensembles (direct callers) → the member whose version they pin
    pinning_ensembles: Mapping[str, str]
    # version → ensembles named ``<ensemble>_v<version>`` that reach the family (nested ones too)
    versioned_ensembles: Mapping[int, tuple[str, ...]]
    # router tasks whose canary is this model
    canary_tasks: tuple[str, ...]
    # versions the router accepts in its split (the route file's canaries)
    router_versions: tuple[int, ...]

    @classmethod
    def from_repository(cls, repository: Path, model: str) -> "Family":
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2 as mc

        if not BuiltManifest.exists(repository):
            raise RolloutError(f"{repository} is not a built repository (no .built): run `make repository`")
        facts = BuiltManifest.read(repository).compute_models.get(model)
        if facts is None:
            raise RolloutError(f"{model} is not a compute model of {repository}")
        configs = [text_format.Parse(path.read_text(), mc.ModelConfig())
                   for path in sorted(repository.glob("*/config.pbtxt"))]
        configs = {config.name: config for config in configs}
        return cls.from_graph(EnsembleGraph.from_configs(configs), model, (model, *facts.latency_variants),
                              route_table(repository))

    @classmethod
    def from_graph(cls, graph: EnsembleGraph, model: str, members: tuple[str, ...],
                   routes: RouteTable | None = None) -> "Family":
        """The ensembles that reach ``members`` along ensemble steps (the builder's variants follow
        those only): ``<ensemble>_v<N>`` beside a plain ``<ensemble>`` serves version N; a plain
        one pins the member it names with a version."""
        pinning, versioned = {}, {}
        for name in graph.ensembles:
            if not graph.reached(name, through_bls=False) & set(members):
                continue
            variant = parse_variant_name(name)
            if variant.version is not None and variant.unversioned in graph.steps:
                versioned.setdefault(variant.version, []).append(name)
                continue
            for step, version in graph.steps[name]:
                if step in members and version > 0:
                    pinning[name] = step
        tasks, router_versions = (), (STABLE_VERSION,)
        if routes is not None:
            tasks = tuple(sorted(task for task, route in routes.tasks.items() if route.canary == model))
            if model in routes.canaries:
                router_versions = routes.canaries[model].versions
        return cls(model, members, pinning, {v: tuple(sorted(n)) for v, n in versioned.items()}, tasks,
                   router_versions)

    def ensembles_serving(self, version: int) -> tuple[str, ...]:
        """The ensembles a version's traffic goes through: ``<ensemble>_v<N>``, and for version 1
        the plain ones (the router's targets for version 1)."""
        if version == STABLE_VERSION:
            return tuple(sorted(self.pinning_ensembles))
        return self.versioned_ensembles.get(version, ())

    @property
    def ensembles(self) -> list[str]:
        """Every ensemble that serves one of the family's versions."""
        return sorted(set(self.pinning_ensembles) | {n for names in self.versioned_ensembles.values() for n in names})


# ----------------------------------------------------------------------------------- gates
@dataclass(frozen=True)
class Gate:
    """When a step's hold must end the rollout. Failures: the router's failures of the canary's
    tasks (client errors excluded) plus Triton's failure counts of the family and its ensembles,
    over the requests they served in the hold. p99: the target version's request time from
    Triton's latency summary (a sliding 60 s window), judged once it served ``min_requests`` in
    the hold (a single slow warm-up request must not decide)."""
    max_failure_ratio: float = 0.0
    max_p99_ms: float | None = None
    max_p99_ratio: float | None = None  # target p99 / the old versions' p99
    min_requests: int = 50


@dataclass
class StepReport:
    share: float
    requests: float = 0.0
    failures: float = 0.0
    target_requests: float = 0.0
    p99_ms: float | None = None
    old_p99_ms: float | None = None
    breach: str = ""

    def line(self) -> str:
        p99 = "n/a" if self.p99_ms is None else f"{self.p99_ms:.1f} ms"
        old = "" if self.old_p99_ms is None else f" (old {self.old_p99_ms:.1f} ms)"
        return (f"{self.share:g}%: {self.requests:.0f} requests, {self.failures:.0f} failed, target served "
                f"{self.target_requests:.0f}, p99 {p99}{old}" + (f"; BREACH: {self.breach}" if self.breach else ""))


def judge(gate: Gate, report: StepReport) -> str:
    """The breach a step's numbers show, or ``""``."""
    if report.requests and report.failures / report.requests > gate.max_failure_ratio:
        return f"{report.failures:.0f} of {report.requests:.0f} requests failed (limit {gate.max_failure_ratio:.2%})"
    if report.failures and not report.requests:
        return f"{report.failures:.0f} failures"
    if report.p99_ms is None or report.target_requests < gate.min_requests:
        return ""
    if gate.max_p99_ms is not None and report.p99_ms > gate.max_p99_ms:
        return f"p99 {report.p99_ms:.1f} ms over {gate.max_p99_ms:g} ms"
    if gate.max_p99_ratio is not None and report.old_p99_ms and report.p99_ms > gate.max_p99_ratio * report.old_p99_ms:
        return f"p99 {report.p99_ms:.1f} ms over {gate.max_p99_ratio:g} x the old {report.old_p99_ms:.1f} ms"
    return ""


def served(metrics: Metrics, family: Family, versions: Iterable[int]) -> float:
    """Requests the family's members answered (or failed) at these versions, since Triton started."""
    wanted = [str(v) for v in versions]
    return sum(metrics.total(name, model=family.members, version=wanted)
               for name in ("nv_inference_request_success", "nv_inference_request_failure"))


def _ms(microseconds: float | None) -> float | None:
    return None if microseconds is None else microseconds / 1000.0


def _largest_p99(metrics: Metrics, family: Family, versions: Iterable[int]) -> float | None:
    """The largest p99 (us) of Triton's latency summary over the members at these versions; NaN
    (no request in the summary's window) counts as none."""
    values = [v for m in family.members for version in versions
              for v in [metrics.largest("nv_inference_request_summary_us", model=m, version=str(version),
                                        quantile="0.99")] if v is not None and v == v]
    return max(values, default=None)


def measure(before: Metrics, after: Metrics, family: Family, share: float, target: int,
            sources: Iterable[int]) -> StepReport:
    """A hold's numbers between two scrapes (the gate's verdict not yet in ``breach``): requests and
    failures of the canary's router tasks (client errors, ``errors.INPUT_REASONS``, are
    not failures) and of the family's ensembles and members; what the target served; the target's
    and the old versions' p99 from the latest scrape."""
    def delta(name, **labels):
        return after.total(name, **labels) - before.total(name, **labels)

    ensembles, tasks = family.ensembles, family.canary_tasks
    router_failures = (delta("router_failures_total", task=tasks)
                       - sum(delta("router_failures_total", task=tasks, reason=r) for r in INPUT_REASONS))
    return StepReport(
        share,
        requests=(delta("router_requests_total", task=tasks) + delta("nv_inference_request_success", model=ensembles)
                  + delta("nv_inference_request_failure", model=ensembles)),
        failures=(router_failures + delta("nv_inference_request_failure", model=ensembles)
                  + delta("nv_inference_request_failure", model=family.members)),
        target_requests=served(after, family, [target]) - served(before, family, [target]),
        p99_ms=_ms(_largest_p99(after, family, [target])),
        old_p99_ms=_ms(_largest_p99(after, family, sources)))


# ----------------------------------------------------------------------------------- actions
# Small frozen values, compared by kind and fields (a ``Pin(2)`` is not a ``Warm(2)``).
@dataclass(frozen=True)
class _OneVersion:
    version: int


@dataclass(frozen=True)
class _Versions:
    versions: frozenset[int]


class LoadEnsembles(_OneVersion):
    """Load the ``<ensemble>_v<version>`` ensembles that are not READY."""


class Pin(_OneVersion):
    """Re-pin the plain ensembles (direct callers) to ``version``."""


class Warm(_OneVersion):
    """One request through each ensemble that serves ``version`` (an error ends the move)."""


class Settle(_OneVersion):
    """The split file holds ``version`` alone (100%): the move is done."""


class WaitDrained(_Versions):
    """Until ``versions`` get no more requests (nor hold pending ones)."""


class WaitUnloaded(_Versions):
    """Until no member holds ``versions`` READY or UNLOADING (bounded; logged past the bound)."""


@dataclass(frozen=True)
class LoadVersions(_Versions):
    """Load every served member of the family with exactly ``versions`` (``added`` is the new one)."""
    added: int


@dataclass(frozen=True)
class Retire(_Versions):
    """Load the members with what is loaded now, plus ``keep``, minus ``versions``."""
    keep: int


@dataclass(frozen=True)
class WriteSplit:
    """The router's shares (percent) for the model, as (version, share) pairs."""
    shares: tuple[tuple[int, float], ...]

    def as_dict(self) -> dict[int, float]:
        return dict(self.shares)


@dataclass(frozen=True)
class Hold:
    """Watch the split for ``hold_s`` (measure and judge); on a breach, roll back to ``rollback_to``."""
    share: float
    hold_s: float
    target: int
    sources: frozenset[int]
    rollback_to: int


Action = Union[LoadVersions, LoadEnsembles, Pin, Warm, WriteSplit, Hold, WaitDrained, Retire, WaitUnloaded, Settle]


def check_steps(steps: Iterable[float]) -> list[float]:
    """The router shares of a move's steps, percent: rising, ending at 100."""
    steps = [float(s) for s in steps]
    if not steps or steps[-1] != 100 or any(not 0 < s <= 100 for s in steps) or steps != sorted(steps):
        raise RolloutError(f"steps must rise to 100 (percent of the router's traffic), got {steps}")
    return steps


def move_sources(current: int, split: Mapping[int, float], target: int) -> set[int]:
    """The versions a move takes traffic from: those with a share, and the plain ensembles' version."""
    return ({v for v, share in split.items() if share > 0} | {current}) - {target}


def rollback_version(current: int, sources: set[int]) -> int:
    """Where a breach goes back to: the plain ensembles' version if it is a source, else the newest source."""
    return current if current in sources or not sources else max(sources)


def plan_move(loaded: set[int], current: int, split: Mapping[int, float], target: int,
              steps: Iterable[float] = (10, 50, 100), hold_s: float = 60.0) -> list[Action]:
    """The actions that move a family from what the server serves to ``target``.

    ``loaded``: the versions READY for every served member; ``current``: the version the plain
    ensembles pin; ``split``: the router's shares now; ``steps``: the target's shares in turn (each
    held ``hold_s``; 0: not held). Traffic leaving the sources keeps their relative shares."""
    steps = check_steps(steps)
    sources = move_sources(current, split, target)
    actions: list[Action] = []
    if target not in loaded:
        actions.append(LoadVersions(frozenset(loaded | {target}), target))
    actions.append(LoadEnsembles(target))
    if target == STABLE_VERSION:
        actions.append(Pin(target))  # the router's version-1 targets are the plain ensembles
    actions.append(Warm(target))
    remaining = {v: split.get(v, 0.0) for v in sources}
    weights = remaining if sum(remaining.values()) > 0 else {v: 1.0 for v in sources}
    for share in steps:
        shares = {target: share} | {v: (100 - share) * w / sum(weights.values()) for v, w in weights.items()}
        actions.append(WriteSplit(tuple(shares.items())))
        if hold_s > 0:
            actions.append(Hold(share, hold_s, target, frozenset(sources), rollback_version(current, sources)))
    if target != STABLE_VERSION:
        actions.append(Pin(target))
    if sources:
        old = frozenset(sources)
        actions += [WaitDrained(old), Retire(old, target), WaitUnloaded(old)]
    actions.append(Settle(target))
    return actions
