"""The route file's schema: the route table (tasks, prices, canaries, gateway settings, limits),
what a routed request is, and the price rules (tiers, cost, the spend ledger's prompt estimate).

The router (``pipelines/router/``) and the gateway (``gateway/``) both read it, so it lives in the
repository layer, below both. Nothing here imports Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from triton_pipelines.limits import SELF_HOSTED_DEADLINE_S, TEXT_MAX_BATCH
# STABLE_VERSION: the version every plain ensemble pins and the router serves by default (canary
# versions are 2, 3, ...).
from triton_pipelines.repository.contract import STABLE_VERSION

from triton_pipelines.errors import ConfigError, InputError

TIERS = ("cheapest", "balanced", "best")


# ----------------------------------------------------------------------------------- route table
class RoutesFileError(ConfigError):
    """data/routes.yaml (or a canary split file) breaks a rule of its schema; the message names the
    file, the entry and the rule."""


@dataclass(frozen=True)
class Price:
    input_per_million: Decimal
    output_per_million: Decimal

    @property
    def ranking(self) -> Decimal:
        """What ``tier`` sorts by: the input and output price per million tokens, summed."""
        return self.input_per_million + self.output_per_million


@dataclass(frozen=True)
class TaskRoute:
    task: str
    route: str  # "triton" | "gateway"
    model: str = ""  # triton: the ensemble
    inputs: Mapping[str, str] = field(default_factory=dict)  # name -> "text" | "base64"
    outputs: tuple[str, ...] = ()
    canary: str = ""  # triton: the compute model whose versions are split
    models: tuple[str, ...] = ()  # gateway: allowed models
    default_model: str = ""
    # The whole request's deadline, retries and backoff included (None: the route kind's default).
    deadline_s: float | None = None
    # gateway: the models tried, in order, when the chosen one fails (429, 5xx, time-out, open
    # circuit); empty: the chosen model's own list (``gateway_models.<model>.fallbacks``).
    fallbacks: tuple[str, ...] = ()


@dataclass(frozen=True)
class GatewayModel:
    """``gateway_models.<name>`` in the route file."""
    name: str
    context_window: int  # tokens (prompt + completion) the model takes
    fallbacks: tuple[str, ...]  # models tried, in order, when this one fails
    # The most output tokens it gives a call that names no max_tokens (the provider's limit): what
    # such a call is sent and reserved; None: the gateway's default_max_tokens.
    max_output_tokens: int | None = None


@dataclass(frozen=True)
class GatewaySettings:
    timeout_s: float = 20.0  # one attempt (never more than what is left of the deadline)
    deadline_s: float = 45.0  # a whole gateway request, retries included, unless its task says otherwise
    max_retries: int = 2
    backoff_s: float = 0.5
    max_backoff_s: float = 4.0
    circuit_failure_threshold: int = 5
    circuit_reset_s: float = 30.0
    default_max_tokens: int = 512
    max_tokens_limit: int = 8192
    max_in_flight: int = 64  # gateway calls at once; more are refused at once (UNAVAILABLE)
    # A reservation not settled this long after its request's deadline is abandoned in the spend
    # ledger (charged at its reserved cost): gateway/ledger.py.
    reservation_margin_s: float = 60.0
    # What the spend ledger reserves per image part before the call (the prompt's text is counted
    # in UTF-8 bytes, an upper bound of its tokens).
    image_tokens_estimate: int = 2500


@dataclass(frozen=True)
class Canary:
    model: str
    versions: tuple[int, ...]  # all loaded versions, 1 first
    split: Mapping[int, float]  # version -> share in percent
    builds: Mapping[int, str] = field(default_factory=dict)  # version > 1 -> how the builder derives it from 1


# The route file's ``limits`` section: RouteTable's fields it may set, and their types.
LIMIT_TYPES = {"max_payload_bytes": int, "max_rows_per_request": int, "max_in_flight_triton": int,
               "triton_deadline_s": float}


@dataclass(frozen=True)
class RouteTable:
    tasks: Mapping[str, TaskRoute]
    prices: Mapping[str, Price]
    gateway: GatewaySettings
    canaries: Mapping[str, Canary]
    max_payload_bytes: int = 8 << 20
    max_rows_per_request: int = TEXT_MAX_BATCH
    # Self-hosted requests in flight at once (their queues are bounded downstream too) and their
    # default deadline.
    max_in_flight_triton: int = 256
    triton_deadline_s: float = SELF_HOSTED_DEADLINE_S
    gateway_models: Mapping[str, GatewayModel] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path | str) -> "RouteTable":
        import yaml

        try:
            document = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
            mark = getattr(error, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            raise RoutesFileError(f"{path}: not a readable YAML file{where}: {type(error).__name__}") from None
        try:
            return cls.from_document(document, source=str(path))
        except RoutesFileError:
            raise
        except KeyError as error:
            raise RoutesFileError(f"{path}: an entry lacks its field {error}") from None
        except (TypeError, AttributeError, ValueError, ArithmeticError) as error:
            raise RoutesFileError(f"{path}: an entry has the wrong shape ({type(error).__name__}: {error})") from None

    @classmethod
    def from_document(cls, document: Mapping[str, Any], source: str = "routes") -> "RouteTable":
        prices = {str(name): Price(Decimal(str(p["input"])), Decimal(str(p["output"])))
                  for name, p in (document.get("prices") or {}).items()}
        canaries = {}
        for name, spec in (document.get("canaries") or {}).items():
            builds = {int(v): str(build) for v, build in (spec.get("versions") or {}).items()}
            versions = (STABLE_VERSION,) + tuple(sorted(builds))
            canaries[str(name)] = Canary(str(name), versions, validate_split(spec.get("split") or {}, versions,
                                                                                f"{source}: canary {name}"), builds)
        tasks = {}
        for task, spec in (document.get("tasks") or {}).items():
            route = spec.get("route")
            if route == "triton":
                entry = TaskRoute(task, route, model=str(spec["model"]),
                                  inputs={str(k): str(v) for k, v in (spec.get("inputs") or {}).items()},
                                  outputs=tuple(str(o) for o in spec.get("outputs") or ()),
                                  canary=str(spec.get("canary") or ""), deadline_s=_deadline(spec, task, source))
                bad = {k: v for k, v in entry.inputs.items() if v not in ("text", "base64")}
                if bad or not entry.inputs or not entry.outputs:
                    raise RoutesFileError(f"{source}: task {task} needs inputs (text|base64) and outputs; got {spec}")
                if entry.canary and entry.canary not in canaries:
                    raise RoutesFileError(f"{source}: task {task} names canary {entry.canary!r}, not under canaries")
            elif route == "gateway":
                models = tuple(str(m) for m in spec.get("models") or ())
                entry = TaskRoute(task, route, models=models, default_model=str(spec.get("default_model") or models[0]),
                                  deadline_s=_deadline(spec, task, source),
                                  fallbacks=tuple(str(m) for m in spec.get("fallbacks") or ()))
                unpriced = [m for m in models if m not in prices]
                if not models or unpriced or entry.default_model not in models:
                    raise RoutesFileError(f"{source}: task {task}: models {list(models)} need prices "
                                     f"(missing {unpriced}) and default_model among them")
                outside = [m for m in entry.fallbacks if m not in models]
                if outside:
                    raise RoutesFileError(f"{source}: task {task}: fallbacks {outside} are not among its models "
                                     f"{list(models)}")
            else:
                raise RoutesFileError(f"{source}: task {task}: route must be 'triton' or 'gateway', not {route!r}")
            tasks[str(task)] = entry
        gateway = GatewaySettings(**(document.get("gateway") or {}))
        gateway_models = _gateway_models(document.get("gateway_models") or {}, prices, source)
        limits = document.get("limits") or {}
        # the route file's limits override the defaults above (the fields' own)
        return cls(tasks, prices, gateway, canaries, gateway_models=gateway_models,
                   **{name: kind(limits[name]) for name, kind in LIMIT_TYPES.items() if name in limits})

    def fallback_chain(self, task: str | None, model: str) -> list[str]:
        """The models to try for a request, in order: ``model``, then the task's ``fallbacks``
        (if it has its own list), else the model's; for a task, only among the task's models."""
        route = self.tasks.get(task) if task else None
        listed = route.fallbacks if route is not None and route.fallbacks else (
            self.gateway_models[model].fallbacks if model in self.gateway_models else ())
        chain = [model]
        for name in listed:
            if name not in chain and (route is None or name in route.models):
                chain.append(name)
        return chain

    def context_window(self, model: str) -> int | None:
        entry = self.gateway_models.get(model)
        return entry.context_window if entry else None

    def output_limit(self, model: str) -> int:
        """The output tokens a call to ``model`` that names no ``max_tokens`` is sent and reserved:
        the model's ``max_output_tokens``, else ``gateway.default_max_tokens``; at most
        ``gateway.max_tokens_limit``."""
        entry = self.gateway_models.get(model)
        limit = entry.max_output_tokens if entry and entry.max_output_tokens else self.gateway.default_max_tokens
        return min(limit, self.gateway.max_tokens_limit)

    def larger_window(self, task: str | None, model: str, candidates: list[str]) -> str | None:
        """For a context-window error of ``model``: the first of ``candidates`` (the rest of its
        fallback chain) with a larger window, else the task's (or any) model with the smallest
        larger window; None if there is none."""
        window = self.context_window(model) or 0
        for name in candidates:
            if (self.context_window(name) or 0) > window:
                return name
        route = self.tasks.get(task) if task else None
        pool = route.models if route is not None else tuple(self.gateway_models)
        larger = sorted((self.context_window(m) or 0, m) for m in pool if (self.context_window(m) or 0) > window)
        return larger[0][1] if larger else None

    def deadline_s(self, task: str) -> float:
        route = self.tasks[task]
        if route.deadline_s is not None:
            return route.deadline_s
        return self.gateway.deadline_s if route.route == "gateway" else self.triton_deadline_s


def _gateway_models(section: Mapping[str, Any], prices: Mapping[str, Price], source: str) -> dict[str, GatewayModel]:
    models = {}
    for name, spec in section.items():
        name = str(name)
        if name not in prices:
            raise RoutesFileError(f"{source}: gateway_models.{name} has no price under prices")
        window = (spec or {}).get("context_window")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise RoutesFileError(f"{source}: gateway_models.{name}.context_window must be a whole number of tokens")
        fallbacks = tuple(str(m) for m in (spec or {}).get("fallbacks") or ())
        unknown = [m for m in fallbacks if m not in prices or m == name]
        if unknown:
            raise RoutesFileError(f"{source}: gateway_models.{name}.fallbacks {unknown} must be other priced models")
        output = (spec or {}).get("max_output_tokens")
        if output is not None and (isinstance(output, bool) or not isinstance(output, int) or output < 1):
            raise RoutesFileError(f"{source}: gateway_models.{name}.max_output_tokens must be a whole number of "
                                  f"tokens, not {output!r}")
        models[name] = GatewayModel(name, window, fallbacks, output)
    return models


def _deadline(spec: Mapping[str, Any], task: str, source: str) -> float | None:
    value = spec.get("deadline_s")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise RoutesFileError(f"{source}: task {task}: deadline_s must be a positive number of seconds, not {value!r}")
    return float(value)


def validate_split(split: Mapping[Any, Any], versions: tuple[int, ...], where: str) -> dict[int, float]:
    """``{version: share}`` with known versions and non-negative shares summing to more than 0.
    Shares are relative (90/10 and 9/1 are the same split)."""
    try:
        parsed = {int(v): float(s) for v, s in split.items()}
    except (TypeError, ValueError, AttributeError):
        raise RoutesFileError(f"{where}: split must map version numbers to shares, got {split!r}") from None
    unknown = sorted(set(parsed) - set(versions))
    if unknown or any(s < 0 for s in parsed.values()) or sum(parsed.values()) <= 0:
        raise RoutesFileError(f"{where}: split {split!r} needs versions among {list(versions)} "
                         f"and non-negative shares with a positive sum")
    return parsed



# ----------------------------------------------------------------------------------- prices
def cost_usd(price: Price, input_tokens: int, output_tokens: int) -> float:
    """Input and output tokens priced separately, in exact decimal arithmetic, then a float."""
    cost = (Decimal(input_tokens) * price.input_per_million
            + Decimal(output_tokens) * price.output_per_million) / Decimal(1_000_000)
    return float(cost)


# The content parts a gateway prompt may hold: text (its UTF-8 bytes bound its tokens) and images
# (``gateway.image_tokens_estimate`` each, the route file's stated bound). Audio and file (PDF)
# parts cost tokens no one can bound before the call (a PDF of a thousand pages is one part), so
# no reservation could hold them: they are refused.
PROMPT_PART_TYPES = ("text", "image_url")


def estimate_prompt_tokens(messages: list[dict], image_tokens: int = 2500) -> int:
    """An upper bound of a chat prompt's tokens, for the spend ledger's reservation: every text's
    UTF-8 bytes (no tokenizer makes more tokens than bytes), ``image_tokens`` per image part, and
    8 per message for the role and framing. InputError for a part of another type
    (``PROMPT_PART_TYPES``), naming it."""
    total = 16
    for index, message in enumerate(messages):
        total += 8
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content.encode("utf-8", "replace"))
        elif isinstance(content, list):
            for number, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    total += len(str(part.get("text", "")).encode("utf-8", "replace"))
                elif kind == "image_url":
                    total += image_tokens
                else:
                    what = f"a {repr(kind)[:40]} part" if isinstance(part, dict) else f"a {type(part).__name__}"
                    raise InputError(f"messages[{index}].content[{number}] is {what}: a gateway prompt takes "
                                     f"only {' and '.join(map(repr, PROMPT_PART_TYPES))} parts (what other parts "
                                     f"cost cannot be bounded before the call, so no budget could hold it)")
        for key in ("name", "tool_call_id"):
            if isinstance(message, dict) and isinstance(message.get(key), str):
                total += len(message[key].encode("utf-8", "replace"))
    return total


def choose_model(route: TaskRoute, prices: Mapping[str, Price], tier: str | None) -> str:
    """``cheapest`` / ``best``: lowest / highest input+output price per million among the task's
    models; ``balanced``: the median (lower middle for an even count); no tier: the default."""
    if tier is None:
        return route.default_model
    ranked = sorted(route.models, key=lambda m: (prices[m].ranking, m))
    if tier == "cheapest":
        return ranked[0]
    if tier == "best":
        return ranked[-1]
    return ranked[(len(ranked) - 1) // 2]


# ----------------------------------------------------------------------------------- requests
@dataclass
class RoutedRequest:
    task: str
    route: str
    latency_class: str
    target: str  # triton: the model to call via BLS; gateway: the gateway model name
    model: str  # what ``result.model`` reports
    model_version: int | None = None
    canary: str = ""
    inputs: dict[str, np.ndarray] = field(default_factory=dict)  # triton
    outputs: tuple[str, ...] = ()
    messages: list[dict] = field(default_factory=list)  # gateway
    temperature: float | None = None
    max_tokens: int = 0
    tier: str | None = None
    realtime_target: str = ""  # triton: where a batch-class request goes when there is no _batch variant
    note: str = ""
