"""Reading and writing Prometheus text (Triton's ``/metrics`` and the launcher's status server in front of it):
one parser for the rollout's gates, the tests and the benchmarks, one writer of metric families. Standard library only.

Samples are ``name{label="value",...} number``; comments (``# HELP``, ``# TYPE``) and lines whose
value is not a number are left out. Label values keep their escapes (Triton's have none).
(``status_server.merge_metrics`` does not read values: it relabels the text of several replicas as is.)
"""

from __future__ import annotations

import re
import urllib.request
from typing import Iterable, Mapping, NamedTuple

SAMPLE_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


def parse_samples(text: str) -> list[Sample]:
    samples = []
    for line in text.splitlines():
        match = SAMPLE_LINE.match(line)
        if match:
            try:
                value = float(match["value"])
            except ValueError:
                continue
            samples.append(Sample(match["name"], dict(LABEL.findall(match["labels"] or "")), value))
    return samples


def scrape(url: str, timeout_s: float = 10.0) -> str:
    """The text of a metrics endpoint."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


def matches(found: dict[str, str], labels: dict[str, str | Iterable[str]]) -> bool:
    """Whether ``found`` has every label of ``labels`` (one given as a collection matches any of its values)."""
    for key, wanted in labels.items():
        value = found.get(key)
        if isinstance(wanted, str):
            if value != wanted:
                return False
        elif value not in wanted:
            return False
    return True


def total(samples: Iterable[Sample], name: str, **labels: str | Iterable[str]) -> float:
    """Sum of ``name`` over the samples whose labels match (0 when none)."""
    return sum(sample.value for sample in samples if sample.name == name and matches(sample.labels, labels))


# ------------------------------------------------------------------------------------ writing
def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def family(name: str, kind: str, help_text: str, labels: tuple[str, ...], values: Mapping,
           fmt: str = "{}") -> list[str]:
    """One metric family as text lines: HELP, TYPE, then one sample per item of ``values`` (its key a
    tuple of label values, or one value), sorted."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for key, value in sorted(values.items()):
        pairs = ",".join(f'{label}="{escape_label(str(v))}"'
                         for label, v in zip(labels, key if isinstance(key, tuple) else (key,)))
        lines.append(f"{name}{{{pairs}}} {fmt.format(value)}")
    return lines
