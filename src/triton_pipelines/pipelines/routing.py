"""The router's logic: route table, request parsing, canary splits, tiers and cost.

The ``router`` BLS model (``python_models/router/model.py``) is a thin adapter over this module:
it reads ``task``/``payload``/``latency_class``, asks ``Router.prepare`` for a ``RoutedRequest``,
does the BLS call (or hands a gateway request to ``gateway.GatewayClient``) and turns the outputs
into the ``result`` JSON with ``Router.triton_result`` / ``Router.gateway_result``.
Nothing here imports Triton, so it is unit-tested without a server.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import random
import re
import threading
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from triton_pipelines.limits import SELF_HOSTED_DEADLINE_S, TEXT_MAX_BATCH
from triton_pipelines.errors import InputError, as_bytes, decode_utf8
# The variant names the builder writes; STABLE_VERSION: the version every plain ensemble pins and
# the router serves by default (canary versions are 2, 3, ...).
from triton_pipelines.repository.contract import LATENCY_CLASSES, STABLE_VERSION, variant_name

TIERS = ("cheapest", "balanced", "best")
MESSAGE_ROLES = ("system", "user", "assistant", "developer", "tool")
# What a vision_llm image may claim to be (it becomes a data: URL sent upstream).
IMAGE_MIME_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")
# A JSON escape of a UTF-16 surrogate: only then can a parsed string hold a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


# ----------------------------------------------------------------------------------- route table
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
    # ledger (charged at its reserved cost): spend_ledger.py.
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

        return cls.from_document(yaml.safe_load(Path(path).read_text(encoding="utf-8")), source=str(path))

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
                    raise ValueError(f"{source}: task {task} needs inputs (text|base64) and outputs; got {spec}")
                if entry.canary and entry.canary not in canaries:
                    raise ValueError(f"{source}: task {task} names canary {entry.canary!r}, not under canaries")
            elif route == "gateway":
                models = tuple(str(m) for m in spec.get("models") or ())
                entry = TaskRoute(task, route, models=models, default_model=str(spec.get("default_model") or models[0]),
                                  deadline_s=_deadline(spec, task, source),
                                  fallbacks=tuple(str(m) for m in spec.get("fallbacks") or ()))
                unpriced = [m for m in models if m not in prices]
                if not models or unpriced or entry.default_model not in models:
                    raise ValueError(f"{source}: task {task}: models {list(models)} need prices "
                                     f"(missing {unpriced}) and default_model among them")
                outside = [m for m in entry.fallbacks if m not in models]
                if outside:
                    raise ValueError(f"{source}: task {task}: fallbacks {outside} are not among its models "
                                     f"{list(models)}")
            else:
                raise ValueError(f"{source}: task {task}: route must be 'triton' or 'gateway', not {route!r}")
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
            raise ValueError(f"{source}: gateway_models.{name} has no price under prices")
        window = (spec or {}).get("context_window")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"{source}: gateway_models.{name}.context_window must be a whole number of tokens")
        fallbacks = tuple(str(m) for m in (spec or {}).get("fallbacks") or ())
        unknown = [m for m in fallbacks if m not in prices or m == name]
        if unknown:
            raise ValueError(f"{source}: gateway_models.{name}.fallbacks {unknown} must be other priced models")
        models[name] = GatewayModel(name, window, fallbacks)
    return models


def _deadline(spec: Mapping[str, Any], task: str, source: str) -> float | None:
    value = spec.get("deadline_s")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{source}: task {task}: deadline_s must be a positive number of seconds, not {value!r}")
    return float(value)


def validate_split(split: Mapping[Any, Any], versions: tuple[int, ...], where: str) -> dict[int, float]:
    """``{version: share}`` with known versions and non-negative shares summing to more than 0.
    Shares are relative (90/10 and 9/1 are the same split)."""
    try:
        parsed = {int(v): float(s) for v, s in split.items()}
    except (TypeError, ValueError, AttributeError):
        raise ValueError(f"{where}: split must map version numbers to shares, got {split!r}") from None
    unknown = sorted(set(parsed) - set(versions))
    if unknown or any(s < 0 for s in parsed.values()) or sum(parsed.values()) <= 0:
        raise ValueError(f"{where}: split {split!r} needs versions among {list(versions)} "
                         f"and non-negative shares with a positive sum")
    return parsed


# ----------------------------------------------------------------------------------- canary
def split_point(task: str, key: str | None) -> float:
    """A number in [0, 1): the same for the same (task, key), uniform over keys; random without one."""
    if not key:
        return random.random()
    digest = hashlib.sha256(f"{task}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def choose_version(split: Mapping[int, float], point: float) -> int:
    total = sum(split.values())
    cumulative = 0.0
    for version in sorted(split):
        cumulative += split[version] / total
        if point < cumulative and split[version] > 0:
            return version
    return max(v for v, s in split.items() if s > 0)


class SplitFile:
    """Run-time canary shares: a small JSON file re-read when its mtime or size changes.

    ``{"text_encoder": {"1": 50, "2": 50}}`` overrides the route file's default split of that
    canary. A missing file means the defaults; an invalid file keeps the last valid shares and is
    reported by ``error`` (the router logs it).
    """

    def __init__(self, path: Path | str | None, canaries: Mapping[str, Canary]):
        self.path = Path(path) if path else None
        self.canaries = canaries
        self._stamp: tuple[int, int] | None = None
        self._overrides: dict[str, dict[int, float]] = {}
        self.error = ""
        self._lock = threading.Lock()

    def _read(self) -> None:
        if self.path is None:
            return
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._stamp, self._overrides, self.error = None, {}, ""
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            document = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(document, dict):
                raise ValueError("the split file must be a JSON object: {canary model: {version: share}}")
            overrides = {}
            for model, split in document.items():
                if model not in self.canaries:
                    raise ValueError(f"unknown canary model {model!r}; known: {sorted(self.canaries)}")
                overrides[model] = validate_split(split, self.canaries[model].versions, f"{self.path}: {model}")
            self._overrides, self.error = overrides, ""
        except (ValueError, OSError) as error:
            self.error = f"{self.path}: {error}; keeping the previous split"

    def split(self, canary: str) -> dict[int, float]:
        with self._lock:
            self._read()
            return dict(self._overrides.get(canary) or self.canaries[canary].split)


# ----------------------------------------------------------------------------------- prices
def cost_usd(price: Price, input_tokens: int, output_tokens: int) -> float:
    """Input and output tokens priced separately, in exact decimal arithmetic, then a float."""
    cost = (Decimal(input_tokens) * price.input_per_million
            + Decimal(output_tokens) * price.output_per_million) / Decimal(1_000_000)
    return float(cost)


def estimate_prompt_tokens(messages: list[dict], image_tokens: int = 2500) -> int:
    """An upper bound of a chat prompt's tokens, for the spend ledger's reservation: every text's
    UTF-8 bytes (no tokenizer makes more tokens than bytes), ``image_tokens`` per image part, and
    8 per message for the role and framing."""
    total = 16
    for message in messages:
        total += 8
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content.encode("utf-8", "replace"))
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    total += len(str(part.get("text", "")).encode("utf-8", "replace"))
                else:
                    total += image_tokens
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


def _number(payload: Mapping, key: str, kind, low, high):
    value = payload.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise InputError(f"payload field '{key}' must be {'an integer' if kind is int else 'a number'}, "
                         f"not {type(value).__name__}")
    if not low <= value <= high:
        raise InputError(f"payload field '{key}' must be between {low} and {high}, got {value}")
    return kind(value)


def gateway_messages(payload: Mapping) -> list[dict]:
    """``{"messages": [...]}`` (OpenAI chat format) or ``{"text": "..."}`` (one user message;
    with ``image`` base64 for vision, an image part is added)."""
    if "messages" in payload:
        messages = payload["messages"]
        if not isinstance(messages, list) or not messages:
            raise InputError("payload field 'messages' must be a non-empty list of {role, content}")
        for index, message in enumerate(messages):
            if (not isinstance(message, dict) or message.get("role") not in MESSAGE_ROLES
                    or not isinstance(message.get("content"), (str, list))):
                raise InputError(f"payload 'messages'[{index}] must be an object with 'role' "
                                 f"({'|'.join(MESSAGE_ROLES)}) and 'content' (a string or a list of parts)")
        return messages
    if "text" in payload:
        text = payload["text"]
        if not isinstance(text, str) or not text:
            raise InputError("payload field 'text' must be a non-empty string")
        if "image" in payload:
            image = payload["image"]
            if not isinstance(image, str):
                raise InputError("payload field 'image' must be a base64 string")
            _decode_base64(image, "image")
            mime = payload.get("image_mime", "image/png")
            if mime not in IMAGE_MIME_TYPES:
                raise InputError(f"payload field 'image_mime' must be one of {', '.join(IMAGE_MIME_TYPES)}, "
                                 f"not {str(mime)[:40]!r}")
            return [{"role": "user", "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{image}"}}]}]
        return [{"role": "user", "content": text}]
    raise InputError("a gateway task's payload needs 'messages' (a list) or 'text' (a string)")


def parse_payload(raw: bytes) -> dict:
    """The payload's JSON object, or InputError: not JSON, nested too deeply for Python's parser
    (RecursionError), or holding a lone UTF-16 surrogate (``"\\ud800"``: not Unicode text)."""
    try:
        payload = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"payload is not valid JSON: {error}") from None
    except RecursionError:
        raise InputError("payload is nested too deeply to parse") from None
    if not isinstance(payload, dict):
        raise InputError(f"payload must be a JSON object, not {type(payload).__name__}")
    if _SURROGATE_ESCAPE.search(raw):
        _check_unicode(payload, "payload")
    return payload


def _check_unicode(value: Any, where: str) -> None:
    """Every string (keys too) encodes to UTF-8; iterative, so depth costs no recursion."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                raise InputError(f"{path} holds a lone UTF-16 surrogate ({item[error.start]!a} at "
                                 f"index {error.start}): not valid Unicode text") from None
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, f"{path} key"))
                stack.append((child, f"{path}.{key}" if isinstance(key, str) and key.isidentifier() else path))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))


def _decode_base64(value: str, name: str) -> bytes:
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InputError(f"payload field '{name}' is not valid base64") from None
    if not data:
        raise InputError(f"payload field '{name}' is empty")
    return data


class Router:
    def __init__(self, table: RouteTable, split_file: SplitFile | None = None):
        self.table = table
        self.split_file = split_file or SplitFile(None, table.canaries)

    def known_tasks(self) -> list[str]:
        return sorted(self.table.tasks)

    def prepare(self, task_raw: Any, payload_raw: Any, latency_class_raw: Any = None,
                key: str | None = None) -> RoutedRequest:
        """Validate one request and decide where it goes. Raises InputError with a clear message."""
        task = decode_utf8(task_raw, "input 'task'").strip()
        route = self.table.tasks.get(task)
        if route is None:
            raise InputError(f"unknown task {task!r}; known tasks: {', '.join(self.known_tasks())}")
        latency_class = "realtime"
        if latency_class_raw is not None:
            latency_class = decode_utf8(latency_class_raw, "input 'latency_class'").strip() or "realtime"
            if latency_class not in LATENCY_CLASSES:
                raise InputError(f"latency_class must be one of {', '.join(LATENCY_CLASSES)}, not {latency_class!r}")
        raw = as_bytes(payload_raw)
        if len(raw) > self.table.max_payload_bytes:
            raise InputError(f"payload is {len(raw)} bytes; the limit is {self.table.max_payload_bytes} bytes")
        payload = parse_payload(raw)
        user = payload.get("user")
        if user is not None and not isinstance(user, str):
            raise InputError("payload field 'user' must be a string")
        key = user or key
        if route.route == "triton":
            return self._prepare_triton(route, payload, latency_class, key)
        return self._prepare_gateway(route, payload, latency_class)

    def _prepare_triton(self, route: TaskRoute, payload: dict, latency_class: str, key: str | None) -> RoutedRequest:
        inputs = {}
        for name, encoding in route.inputs.items():
            if name not in payload:
                raise InputError(f"task {route.task} needs payload field '{name}' "
                                 f"({'a string' if encoding == 'text' else 'base64-encoded bytes'})")
            value = payload[name]
            if not isinstance(value, str):
                raise InputError(f"payload field '{name}' must be a string, not {type(value).__name__}")
            data = value.encode() if encoding == "text" else _decode_base64(value, name)
            inputs[name] = np.array([[data]], dtype=np.object_)
        version = None
        if route.canary:
            version = choose_version(self.split_file.split(route.canary), split_point(route.task, key))
        return RoutedRequest(route.task, "triton", latency_class, variant_name(route.model, latency_class, version),
                             route.model, model_version=version, canary=route.canary, inputs=inputs,
                             outputs=route.outputs, realtime_target=variant_name(route.model, version=version))

    @staticmethod
    def without_batch_variant(routed: RoutedRequest) -> RoutedRequest | None:
        """The same request for the realtime model, when the ``_batch`` variant is not loaded (an
        ensemble with no compute step of its own has none); None if it already is realtime."""
        if routed.target == routed.realtime_target:
            return None
        return dataclasses.replace(routed, target=routed.realtime_target, latency_class="realtime",
                                   note=f"{routed.target} is not loaded: served by the realtime model")

    def _prepare_gateway(self, route: TaskRoute, payload: dict, latency_class: str) -> RoutedRequest:
        messages = gateway_messages(payload)
        tier = payload.get("tier")
        if tier is not None and tier not in TIERS:
            raise InputError(f"payload field 'tier' must be one of {', '.join(TIERS)}, not {tier!r}")
        settings = self.table.gateway
        temperature = _number(payload, "temperature", float, 0.0, 2.0)
        max_tokens = _number(payload, "max_tokens", int, 1, settings.max_tokens_limit) or settings.default_max_tokens
        model = choose_model(route, self.table.prices, tier)
        return RoutedRequest(route.task, "gateway", latency_class, model, model, messages=messages,
                             temperature=temperature, max_tokens=max_tokens, tier=tier)

    # ------------------------------------------------------------------------------- results
    def triton_result(self, routed: RoutedRequest, outputs: Mapping[str, np.ndarray]) -> dict:
        result = {
            "task": routed.task, "route": "triton", "model": routed.model,
            "model_version": str(routed.model_version or STABLE_VERSION),
            "served_by": routed.target, "latency_class": routed.latency_class,
            "output": {name: tensor_to_json(outputs[name]) for name in routed.outputs},
            "usage": {},
        }
        if routed.canary:
            result["canary"] = {"model": routed.canary, "version": routed.model_version}
        if routed.note:
            result["note"] = routed.note
        return result

    def gateway_result(self, routed: RoutedRequest, text: str, input_tokens: int, output_tokens: int) -> dict:
        price = self.table.prices[routed.target]
        return {
            "task": routed.task, "route": "gateway", "model": routed.target, "model_version": None,
            "tier": routed.tier, "latency_class": routed.latency_class,
            "output": {"text": text},
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                      "cost_usd": cost_usd(price, input_tokens, output_tokens)},
        }


def tensor_to_json(array: np.ndarray) -> Any:
    """One request row of an output tensor as JSON: strings for BYTES, numbers otherwise; a
    single-element row becomes a scalar, e.g. ``label`` [1] → ``"refund"``, ``embedding`` → list."""
    row = array[0] if array.ndim > 0 and array.shape[0] == 1 else array
    if array.dtype == np.object_ or array.dtype.kind in "SU":
        converted = np.vectorize(lambda v: v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v),
                                 otypes=[object])(row) if np.size(row) else np.asarray(row, dtype=object)
        values = converted.tolist() if isinstance(converted, np.ndarray) else converted
    else:
        values = np.asarray(row).tolist()
    if isinstance(values, list) and len(values) == 1 and not isinstance(values[0], list):
        return values[0]
    return values


def json_bytes(document: Mapping) -> bytes:
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()
