"""Weights named by Hugging Face id (``owner/name[@revision]``) or by local folder, resolved to a
local folder with its provenance (``triton_pipelines.repository.contract.Provenance``).

Interface shared by the pipelines (text, vision, speech):

- ``resolve_model(spec, allow_patterns, *, architecture, ...) -> ResolvedModel(path, provenance)``:
  a model that was asked for by name. One that cannot be had raises ``WeightsError``: one line
  naming the model and the remedy (the cache volume, ``HF_TOKEN``, a local folder, the offline
  default). Never a fall-back to another model.
- ``resolve_optional(spec, allow_patterns, ...) -> ResolvedModel | str``: for a *default* build
  that prefers a hub model and has a packaged one to fall back on. It returns the reason (one
  line, e.g. "hub https://huggingface.co not reachable ...") instead of raising; the caller
  prints it and records it as the packaged provenance's ``reason``. A warm cache is used without
  any request; a cold one only after the hub answers a TCP connect within ``probe_timeout_s``
  (huggingface_hub itself has no connect time-out).

Hub downloads go through ``huggingface_hub.snapshot_download`` into the Hugging Face cache. The
environment is read at each call, with huggingface_hub's names and precedence: ``HF_ENDPOINT``,
``HF_HUB_CACHE`` / ``HF_HOME`` (the cache; compose mounts it as a volume), ``HF_HUB_OFFLINE``,
``HF_TOKEN``. The cache is asked first (``local_files_only=True``), so a second build of the same
model and revision sends no request; the hub only when the cache lacks it. The provenance records
the commit the files came from and the sha256 of each weight file; a weight file whose sha256 is
not the one the hub announced (its LFS etag) or the caller expected (``expected_sha256``) fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence
from urllib.parse import urlsplit

from triton_pipelines.errors import ConfigError
from triton_pipelines.repository.contract import Provenance

# Weight files whose sha256 goes into the provenance.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pth", "*.pt", "*.onnx")
DEFAULT_ENDPOINT = "https://huggingface.co"
# ``owner/name`` (or a legacy ``name``), optionally ``@revision`` (a branch, tag or commit sha).
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?)(?:@(?P<revision>[\w./-]+))?$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class WeightsError(ConfigError):
    """A model asked for by id or folder that cannot be had (one line: the model and the remedy)."""


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # a local folder holding the files
    provenance: Provenance


@dataclass(frozen=True)
class HubSettings:
    """The hub and cache huggingface_hub would use, read from the environment now (its constants
    are read once, at import)."""
    endpoint: str
    cache_dir: Path
    offline: bool
    token: str | None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "HubSettings":
        env = os.environ if environ is None else environ
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                   "huggingface")
        cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
        offline = (env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or "").strip().lower()
        return cls(endpoint=(env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"),
                   cache_dir=Path(os.path.expandvars(os.path.expanduser(cache))),
                   offline=offline in ("1", "on", "yes", "true"),
                   token=env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN") or None)


# (real path, size, mtime) → sha256: a build hashes each weight file once (checks, provenance).
_HASHED: dict[tuple[str, int, int], str] = {}


def sha256_of(path: Path) -> str:
    real = os.path.realpath(path)
    stat = os.stat(real)
    key = (real, stat.st_size, stat.st_mtime_ns)
    if key not in _HASHED:
        digest = hashlib.sha256()
        with open(real, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        _HASHED[key] = digest.hexdigest()
    return _HASHED[key]


def weight_files(folder: Path, patterns: Sequence[str] = WEIGHT_PATTERNS) -> tuple[tuple[str, str], ...]:
    """(relative file, sha256) of each weight file under ``folder``, sorted."""
    files = sorted({p for pattern in patterns for p in folder.rglob(pattern) if p.is_file()})
    return tuple((p.relative_to(folder).as_posix(), sha256_of(p)) for p in files)


def safetensors_parameters(folder: Path) -> int:
    """Parameters in the ``*.safetensors`` files under ``folder`` (from their headers; 0 if none)."""
    total = 0
    for path in folder.rglob("*.safetensors"):
        with open(path, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        for name, tensor in header.items():
            if name != "__metadata__":
                count = 1
                for dim in tensor["shape"]:
                    count *= dim
                total += count
    return total


def card_licence(folder: Path) -> str:
    """The ``license:`` of a model card's YAML front matter (``README.md``), or ""."""
    card = folder / "README.md"
    if not card.is_file():
        return ""
    front = re.match(r"^---\s*\n(.*?)\n---", card.read_text(errors="replace"), re.S)
    found = re.search(r"^licen[sc]e:\s*['\"]?([^'\"\n]+)", front.group(1), re.M) if front else None
    return found.group(1).strip() if found else ""


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """``owner/name[@revision]`` → (repo id, revision or None); None for anything else (a path)."""
    if spec.startswith((".", "/", "~")):
        return None
    match = HUB_ID.match(spec)
    return (match["repo"], match["revision"]) if match else None


def resolve_model(spec: str, allow_patterns: Sequence[str], *, architecture: str, licence: str = "",
                  parameters: int = 0, flag: str = "--model", expected_sha256: Mapping[str, str] | None = None,
                  required_files: Sequence[str] = (), reason: str = "",
                  settings: HubSettings | None = None) -> ResolvedModel:
    """``spec``: an existing folder, or ``owner/name[@revision]`` on the Hugging Face hub.
    ``allow_patterns``: the files a hub download fetches. ``flag``: named in errors.
    ``licence``/``parameters``: when empty, the model card's licence and the safetensors' count.
    ``expected_sha256``: weight file → sha256 it must have. ``required_files``: must be there."""
    settings = settings or HubSettings.from_environ()
    folder = Path(spec).expanduser()
    if folder.is_dir():
        folder = folder.resolve()
        provenance = Provenance(kind="folder", source=str(folder), revision="", reason=reason, **_facts(
            folder, spec, flag, architecture, licence, parameters, expected_sha256, required_files))
        return ResolvedModel(folder, provenance)
    hub_id = parse_hub_id(spec)
    if hub_id is None:
        raise WeightsError(f"{flag} {spec}: no such folder, and not a Hugging Face id (owner/name[@revision])")
    repo_id, revision = hub_id
    snapshot = _snapshot(repo_id, revision, allow_patterns, settings, f"{flag} {spec}")
    _check_announced_hashes(snapshot, f"{flag} {spec}")
    provenance = Provenance(kind="hub", source=repo_id, revision=snapshot.name, reason=reason, **_facts(
        snapshot, spec, flag, architecture, licence, parameters, expected_sha256, required_files))
    return ResolvedModel(snapshot, provenance)


def resolve_optional(spec: str, allow_patterns: Sequence[str], *, probe_timeout_s: float = 5.0,
                     settings: HubSettings | None = None, **kwargs) -> ResolvedModel | str:
    """``resolve_model`` for a default build: the resolved model, or the reason it cannot be had
    (one line) for the caller to fall back on its packaged weights and say why."""
    settings = settings or HubSettings.from_environ()
    hub_id = parse_hub_id(spec)
    if hub_id is not None and not Path(spec).expanduser().is_dir() and not _cached(*hub_id, allow_patterns, settings):
        if settings.offline:
            return f"{spec} is not in the Hugging Face cache ({settings.cache_dir}) and HF_HUB_OFFLINE is set"
        unreachable = hub_unreachable(settings, probe_timeout_s)
        if unreachable:
            return unreachable
    try:
        return resolve_model(spec, allow_patterns, settings=settings, **kwargs)
    except WeightsError as error:
        return str(error)


def hub_unreachable(settings: HubSettings | None = None, timeout_s: float = 5.0) -> str | None:
    """Why the hub cannot be reached (a TCP connect to ``HF_ENDPOINT`` within ``timeout_s``), or None."""
    settings = settings or HubSettings.from_environ()
    if settings.offline:
        return "HF_HUB_OFFLINE is set"
    url = urlsplit(settings.endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout_s).close()
    except OSError as error:
        return f"hub {settings.endpoint} not reachable ({type(error).__name__}: {error})"
    return None


def _facts(folder: Path, spec: str, flag: str, architecture: str, licence: str, parameters: int,
           expected_sha256: Mapping[str, str] | None, required_files: Sequence[str]) -> dict:
    missing = [name for name in required_files if not (folder / name).is_file()]
    if missing:
        raise WeightsError(f"{flag} {spec}: {folder} has no {', '.join(missing)}")
    files = weight_files(folder)
    if not files:
        raise WeightsError(f"{flag} {spec}: no weight file ({', '.join(WEIGHT_PATTERNS)}) in {folder}")
    hashes = dict(files)
    for name, expected in (expected_sha256 or {}).items():
        if hashes.get(name) != expected.lower():
            raise WeightsError(f"{flag} {spec}: sha256 mismatch for {name} (expected {expected}, got "
                               f"{hashes.get(name, 'no such file')}); the file is corrupted or not the one pinned: "
                               f"delete it from the cache ({folder}) and build again, or pin the revision it came from")
    return dict(architecture=architecture, licence=licence or card_licence(folder),
                parameters=parameters or safetensors_parameters(folder), files=files)


def _check_announced_hashes(snapshot: Path, what: str) -> None:
    """A cached LFS file is stored under the sha256 the hub announced (its etag): its bytes must hash to it."""
    for path in sorted(snapshot.rglob("*")):
        if not path.is_file():
            continue
        blob = Path(os.path.realpath(path)).name
        if _SHA256.match(blob) and sha256_of(path) != blob:
            raise WeightsError(f"{what}: {path.relative_to(snapshot).as_posix()} is corrupted (its sha256 is not "
                               f"the hub's {blob}); delete {Path(os.path.realpath(path))} from the Hugging Face cache "
                               f"and build again")


def _cached(repo_id: str, revision: str | None, allow_patterns: Sequence[str], settings: HubSettings) -> bool:
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id, revision=revision, allow_patterns=list(allow_patterns),
                          cache_dir=settings.cache_dir, local_files_only=True)
    except (OSError, ValueError):
        return False
    return True


def _snapshot(repo_id: str, revision: str | None, allow_patterns: Sequence[str], settings: HubSettings,
              what: str) -> Path:
    """The snapshot folder of ``repo_id`` at ``revision``: from the cache when it is whole there
    (no request), else downloaded. Every huggingface_hub failure becomes a one-line WeightsError."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    common = dict(repo_id=repo_id, revision=revision, allow_patterns=list(allow_patterns),
                  cache_dir=settings.cache_dir)
    try:
        return Path(snapshot_download(**common, local_files_only=True))
    except (LocalEntryNotFoundError, OSError):
        pass  # not (wholly) cached
    except ValueError as error:
        raise WeightsError(f"{what}: {error}") from None
    if settings.offline:
        raise WeightsError(
            f"{what}: not in the Hugging Face cache ({settings.cache_dir}) and HF_HUB_OFFLINE is set: build once "
            f"with the hub reachable (the cache volume keeps it), pass a local folder, or leave the flag out for "
            f"the offline default")
    try:
        return Path(snapshot_download(**common, endpoint=settings.endpoint, token=settings.token or None))
    except Exception as error:  # huggingface_hub's, httpx's, OSError: all one line
        raise WeightsError(f"{what}: {_explain(error, repo_id, revision, settings)}") from None


def _explain(error: Exception, repo_id: str, revision: str | None, settings: HubSettings) -> str:
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    hub = settings.endpoint
    if isinstance(error, GatedRepoError):
        return (f"{repo_id} is gated on {hub}: accept its terms there and set HF_TOKEN to a token of that account"
                + (" (the HF_TOKEN set was not accepted)" if settings.token else ""))
    if isinstance(error, RepositoryNotFoundError):
        return (f"no model {repo_id} on {hub} (HTTP {error.response.status_code}): check the id; a private "
                f"model needs HF_TOKEN" + (" (the HF_TOKEN set was not accepted)" if settings.token else ""))
    if isinstance(error, RevisionNotFoundError):
        return f"{repo_id} has no revision {revision!r} on {hub}: name an existing branch, tag or commit sha"
    if isinstance(error, HfHubHTTPError) and error.response is not None and error.response.status_code in (401, 403):
        return f"{hub} refused access (HTTP {error.response.status_code}): set HF_TOKEN to a token allowed to read {repo_id}"
    if isinstance(error, LocalEntryNotFoundError) or _is_connection_error(error):
        cause = error.__cause__ or error
        return (f"hub {hub} not reachable ({type(cause).__name__}) and not in the Hugging Face cache "
                f"({settings.cache_dir}): check the network or HF_ENDPOINT, mount the cache volume of an earlier "
                f"build, pass a local folder, or leave the flag out for the offline default")
    first = str(error).strip().splitlines()
    return f"download from {hub} failed: {type(error).__name__}: {first[0] if first else ''}".rstrip(": ")


def _is_connection_error(error: Exception) -> bool:
    return isinstance(error, (ConnectionError, TimeoutError)) or type(error).__module__.startswith("httpx")
