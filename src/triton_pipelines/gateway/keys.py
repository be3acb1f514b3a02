"""API keys: the keys file named by ``$TRITON_API_KEYS_FILE`` and the lookup of a bearer secret.

The file (YAML)::

    keys:
      - key: "sk-team-a-..."        # the secret a client sends as `Authorization: Bearer <key>`
        name: team-a                # what logs, metrics, the spend ledger and error messages show
        max_budget_usd: 25          # optional: refused (429) once the period's spend reaches it
        budget_period: 30d          # optional: the budget's window (<n>s|m|h|d); absent: never resets
        soft_budget_usd: 20         # optional: an alert, not a refusal
        rpm: 600                    # optional: requests per minute
        tpm: 200000                 # optional: tokens (prompt + completion) per minute
        models: [gpt-4.1]           # optional: the gateway models this key may call

One owner for what a key is: the OpenAI-compatible frontend authenticates with it, the gateway's
budgets and limits read it, the spend ledger stores ``key_id`` (a SHA-256 of the secret), never the
secret. Secrets are never formatted into an exception, a log line or ``repr``.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Iterator, Mapping

from triton_pipelines.errors import ConfigError

KEYS_FILE_ENV = "TRITON_API_KEYS_FILE"
# The request screen resolves a router request's `Authorization: Bearer <key>` and forwards only
# this header, the key's id, which tritonserver (--http/grpc-header-forward-pattern) hands the
# router as a request parameter of the same name. A client's own copy (header or parameter) never
# reaches Triton.
KEY_ID_PARAMETER = "x-api-key-id"
# A secret shorter than this is a typo or a guessable placeholder.
MIN_SECRET_CHARS = 16
MAX_SECRET_CHARS = 512
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_PERIOD = re.compile(r"^([1-9][0-9]{0,5})([smhd])$")
_PERIOD_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_FIELDS = {"key", "name", "max_budget_usd", "budget_period", "soft_budget_usd", "rpm", "tpm", "models"}


class KeysFileError(ConfigError):
    """The keys file is malformed; the message names the entry (by index and name) and the field."""


def key_id(secret: str) -> str:
    """What is stored and compared instead of the secret: hex SHA-256."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def period_seconds(text: str) -> int:
    """``"30d"`` → 2592000. Raises ValueError naming the accepted form."""
    match = _PERIOD.match(str(text).strip())
    if not match:
        raise ValueError(f"budget_period {text!r} must look like 1h, 1d or 30d (<n> then s, m, h or d)")
    return int(match.group(1)) * _PERIOD_UNIT_S[match.group(2)]


@dataclass(frozen=True)
class ApiKey:
    name: str
    key_id: str = field(repr=False)
    max_budget_usd: Decimal | None = None
    budget_period_s: int | None = None
    soft_budget_usd: Decimal | None = None
    rpm: int | None = None
    tpm: int | None = None
    models: tuple[str, ...] | None = None

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models


def _money(value: Any, where: str) -> Decimal:
    try:
        amount = Decimal(str(value))
    except InvalidOperation:
        raise KeysFileError(f"{where} must be a number of US dollars, not {value!r}") from None
    if not amount.is_finite() or amount < 0:
        raise KeysFileError(f"{where} must be a non-negative number of US dollars, not {value!r}")
    return amount


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KeysFileError(f"{where} must be a whole number ≥ 1, not {value!r}")
    return value


def _entry(raw: Any, index: int, source: str) -> tuple[str, ApiKey]:
    where = f"{source}: keys[{index}]"
    if not isinstance(raw, Mapping):
        raise KeysFileError(f"{where} must be a mapping with `key` and `name`")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise KeysFileError(f"{where}: `name` must be 1-64 letters, digits, '_', '.' or '-', "
                            f"starting with a letter or digit")
    where = f"{where} ({name})"
    unknown = sorted(str(k) for k in raw if k not in _FIELDS)
    if unknown:
        raise KeysFileError(f"{where}: unknown field(s) {unknown}; known: {sorted(_FIELDS)}")
    secret = raw.get("key")
    if not isinstance(secret, str) or not MIN_SECRET_CHARS <= len(secret) <= MAX_SECRET_CHARS \
            or not secret.isascii() or not secret.isprintable() or " " in secret:
        # never echo the secret
        raise KeysFileError(f"{where}: `key` must be {MIN_SECRET_CHARS}-{MAX_SECRET_CHARS} printable "
                            f"ASCII characters without spaces")
    budget = _money(raw["max_budget_usd"], f"{where}: max_budget_usd") if "max_budget_usd" in raw else None
    soft = _money(raw["soft_budget_usd"], f"{where}: soft_budget_usd") if "soft_budget_usd" in raw else None
    period = None
    if "budget_period" in raw:
        try:
            period = period_seconds(raw["budget_period"])
        except ValueError as error:
            raise KeysFileError(f"{where}: {error}") from None
        if budget is None and soft is None:
            raise KeysFileError(f"{where}: budget_period needs max_budget_usd or soft_budget_usd")
    models = None
    if "models" in raw:
        listed = raw["models"]
        if not isinstance(listed, list) or not listed or not all(isinstance(m, str) and m for m in listed):
            raise KeysFileError(f"{where}: models must be a non-empty list of model names")
        models = tuple(listed)
    return secret, ApiKey(
        name=name, key_id=key_id(secret), max_budget_usd=budget, budget_period_s=period, soft_budget_usd=soft,
        rpm=_count(raw["rpm"], f"{where}: rpm") if "rpm" in raw else None,
        tpm=_count(raw["tpm"], f"{where}: tpm") if "tpm" in raw else None,
        models=models)


class KeyRing:
    """The keys of one keys file, looked up by secret (through its hash) or by ``key_id``."""

    def __init__(self, keys: Mapping[str, ApiKey]):
        self._by_id = dict(keys)

    def __repr__(self) -> str:
        return f"KeyRing({sorted(k.name for k in self._by_id.values())})"

    def __iter__(self) -> Iterator[ApiKey]:
        return iter(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)

    @classmethod
    def from_document(cls, document: Any, source: str = "keys file") -> "KeyRing":
        if not isinstance(document, Mapping) or set(document) != {"keys"} or not isinstance(document["keys"], list):
            raise KeysFileError(f"{source}: must be a mapping with one field, `keys`, a list of keys")
        keys: dict[str, ApiKey] = {}
        names: set[str] = set()
        for index, raw in enumerate(document["keys"]):
            _, api_key = _entry(raw, index, source)
            if api_key.key_id in keys:
                raise KeysFileError(f"{source}: keys[{index}] ({api_key.name}) repeats the secret of "
                                    f"{keys[api_key.key_id].name}")
            if api_key.name in names:
                raise KeysFileError(f"{source}: keys[{index}]: name {api_key.name!r} is used twice")
            keys[api_key.key_id] = api_key
            names.add(api_key.name)
        if not keys:
            raise KeysFileError(f"{source}: `keys` is empty; unset {KEYS_FILE_ENV} to serve without keys")
        return cls(keys)

    @classmethod
    def load(cls, path: Path | str) -> "KeyRing":
        import yaml

        try:
            document = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except yaml.YAMLError as error:
            # the parser's message may quote a line of the file, a secret among them
            mark = getattr(error, "problem_mark", None)
            line = f" at line {mark.line + 1}" if mark is not None else ""
            raise KeysFileError(f"{path}: not valid YAML{line}") from None
        return cls.from_document(document, source=str(path))

    def lookup(self, secret: str) -> ApiKey | None:
        """The key whose secret this is, or None. Compares hashes (a dict lookup on SHA-256 leaks
        nothing useful about the secret through timing)."""
        if not secret or len(secret) > MAX_SECRET_CHARS or not (secret.isascii() and secret.isprintable()):
            return None  # every key file's secret is printable ASCII: anything else is no key (never hashed)
        return self._by_id.get(key_id(secret))

    def by_id(self, identifier: str) -> ApiKey | None:
        return self._by_id.get(identifier)


def bearer_secret(authorization: str | None) -> str | None:
    """``Authorization: Bearer <secret>`` → the secret; anything else → None."""
    if not authorization:
        return None
    scheme, _, secret = authorization.strip().partition(" ")
    secret = secret.strip()
    return secret if scheme.lower() == "bearer" and secret else None


def keys_from_environment(environ: Mapping[str, str] | None = None) -> KeyRing | None:
    """The key ring named by ``$TRITON_API_KEYS_FILE``, or None when it is unset or empty (open,
    like the native endpoints). A named file that is missing or malformed raises: serving open by
    accident because of a typo in a path is the failure to avoid."""
    path = (os.environ if environ is None else environ).get(KEYS_FILE_ENV, "").strip()
    if not path:
        return None
    if not Path(path).is_file():
        raise KeysFileError(f"{KEYS_FILE_ENV}={path}: no such file")
    return KeyRing.load(path)
