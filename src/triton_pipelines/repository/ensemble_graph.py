"""Who calls whom among a repository's models: ``EnsembleGraph``, built from model configs.

Two kinds of calls, both declared in the configs:

- an ensemble calls its steps' models (``ensemble_scheduling.step``, each with the version it pins,
  -1 for the model's own version policy);
- a Python model that calls other models through BLS declares them in its config:
  ``parameters { key: "bls_dependencies" value { string_value: "a,b" } }``, or ``"*"`` for every
  other model (the router).

One graph serves the builder (which ensembles reach a model with latency classes or canary
versions: ``repo_builder.variants``), the rollout (a compute model's family: which ensembles pin or
reach it), the drain (unload callers before the models they call) and the warm-up and lifecycle
tools (every model a pipeline runs). A config is a ``ModelConfig`` protobuf message (the builder,
the rollout) or its JSON form as Triton's config API returns it (the drain): both are read here,
without importing protobuf.

Standard library only, like ``layout.py``: the builder and the launcher import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterable, NamedTuple

BLS_DEPENDENCIES = "bls_dependencies"
# In ``bls_dependencies``: the model may call every other model.
EVERY_MODEL = "*"


class Step(NamedTuple):
    model: str
    version: int  # -1: the step model's own version policy


def ensemble_steps(config: Any) -> tuple[Step, ...]:
    """An ensemble's steps in order (``()`` for any other model)."""
    if isinstance(config, Mapping):
        steps = config.get("ensemble_scheduling", {}).get("step", [])
        return tuple(Step(s["model_name"], int(s.get("model_version", -1))) for s in steps)
    return tuple(Step(s.model_name, int(s.model_version)) for s in config.ensemble_scheduling.step)


def declared_calls(config: Any) -> frozenset[str]:
    """The models a config's ``bls_dependencies`` parameter names (``"*"`` stays ``"*"``)."""
    if isinstance(config, Mapping):
        declared = config.get("parameters", {}).get(BLS_DEPENDENCIES, {}).get("string_value", "")
    else:
        declared = config.parameters[BLS_DEPENDENCIES].string_value if BLS_DEPENDENCIES in config.parameters else ""
    return frozenset(name.strip() for name in declared.split(",") if name.strip())


def config_calls(config: Any) -> set[str]:
    """Every model a config calls: its ensemble steps and its declared BLS calls (``"*"`` kept)."""
    return {step.model for step in ensemble_steps(config)} | declared_calls(config)


class EnsembleGraph:
    """The call graph of a set of models: ensemble steps and declared BLS calls.

    ``models`` are the graph's nodes (the configs it was built from); a call may name a model
    outside them (a step model the server has not loaded): it is an edge to a node with no calls of
    its own, and ``unload_order`` leaves it out."""

    def __init__(self, steps: Mapping[str, Iterable[Step]] | None = None,
                 bls: Mapping[str, Iterable[str]] | None = None, models: Iterable[str] = ()):
        self.steps: dict[str, tuple[Step, ...]] = {name: tuple(Step(*s) for s in found)
                                                   for name, found in (steps or {}).items()}
        self.bls: dict[str, frozenset[str]] = {name: frozenset(found) for name, found in (bls or {}).items() if found}
        self.models: frozenset[str] = frozenset(models) | set(self.steps) | set(self.bls)

    @classmethod
    def from_configs(cls, configs: Mapping[str, Any]) -> "EnsembleGraph":
        """``configs``: model name → its config (a ``ModelConfig`` message or its JSON form)."""
        steps = {name: ensemble_steps(config) for name, config in configs.items()}
        return cls({name: found for name, found in steps.items() if found},
                   {name: declared_calls(config) for name, config in configs.items()}, configs)

    @classmethod
    def from_calls(cls, calls: Mapping[str, Iterable[str]]) -> "EnsembleGraph":
        """From model → the models it calls (``"*"``: every other one), without step versions."""
        return cls(bls=calls, models=calls)

    @property
    def ensembles(self) -> list[str]:
        return sorted(self.steps)

    def calls(self, model: str, through_bls: bool = True) -> frozenset[str]:
        """The models ``model`` calls directly; ``"*"`` is every other model of the graph."""
        called = {step.model for step in self.steps.get(model, ())}
        declared = self.bls.get(model, frozenset()) if through_bls else frozenset()
        if EVERY_MODEL in declared:
            return frozenset(self.models - {model})
        return frozenset(called | declared)

    def reached(self, model: str, through_bls: bool = True) -> set[str]:
        """Every model ``model`` calls, directly or through the models it calls (cycles allowed).
        ``through_bls=False`` follows ensemble steps only (what the builder's variants rewrite)."""
        found: set[str] = set()
        pending = [model]
        while pending:
            for called in self.calls(pending.pop(), through_bls):
                if called not in found:
                    found.add(called)
                    pending.append(called)
        return found

    def reaches(self, caller: str, model: str, through_bls: bool = True) -> bool:
        return model in self.reached(caller, through_bls)

    def callers(self, model: str) -> set[str]:
        """The models that call ``model`` directly."""
        return {name for name in self.models if name != model and model in self.calls(name)}

    def unload_order(self, models: Iterable[str] | None = None) -> list[list[str]]:
        """``models`` (default: the graph's) in layers, each unloaded only after every layer of
        models that call it; a cycle is unloaded together."""
        remaining = set(self.models if models is None else models)
        layers = []
        while remaining:
            called = set()
            for model in remaining:
                called |= (self.calls(model) & remaining) - {model}
            layer = sorted(remaining - called) or sorted(remaining)
            layers.append(layer)
            remaining -= set(layer)
        return layers
