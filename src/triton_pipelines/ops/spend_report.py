"""Spend reports from the gateway's spend ledger: by key, model and day, and what is left of each
key's budget.

    python -m triton_pipelines spend                         # table: spend by key, model, day; budgets
    python -m triton_pipelines spend --by key --since 2026-12-01 --format csv
    python -m triton_pipelines spend --format json --keys-file keys.yaml
    python -m triton_pipelines spend --calls 20                # the last 20 calls, with their trace ids

The ledger: ``--database`` or ``$SPEND_DATABASE_URL``, else ``spend.db`` in the launcher's state
folder (``--state-dir``, ``$TRITON_STATE_DIR`` or ``.triton/8000``). Budgets need the keys file
(``--keys-file`` or ``$TRITON_API_KEYS_FILE``); secrets are never printed, only key names.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
import time
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any, Sequence

from triton_pipelines.gateway.keys import KEYS_FILE_ENV, KeyRing
from triton_pipelines.server.state import STATE_ENV, resolve_state_dir
from triton_pipelines.gateway.ledger import KeyLimits, SpendLedger, usd
from triton_pipelines.gateway.ledger_db import database_url, redacted_url

GROUPS = ("key", "model", "task", "day", "status")
# What --calls shows of each of the last calls: its trace id leads to its trace (docs/operations.md).
CALL_COLUMNS = ("request_id", "trace_id", "key_name", "task", "model", "status", "input_tokens", "output_tokens",
                "cost_usd", "latency_s", "outcome", "started_at")


def recent_calls(ledger: SpendLedger, count: int) -> list[dict]:
    """The ledger's last ``count`` rows (one per attempt), oldest first."""
    rows = ledger.rows("WHERE id > (SELECT COALESCE(MAX(id), 0) FROM spend_log) - ?", (count,))
    for row in rows:
        row["cost_usd"] = usd(int(row["cost_nusd"] or 0))
        row["started_at"] = _when(row["started_at"])
    return [{name: row.get(name) for name in CALL_COLUMNS} for row in rows]


def _day(text: str) -> float:
    try:
        return datetime.strptime(text, "%Y-%m-%d").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a date (YYYY-MM-DD, UTC)") from None


def _when(timestamp: float | None) -> str | None:
    return None if timestamp is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))


def budgets(ledger: SpendLedger, keys: KeyRing) -> list[dict]:
    """Per key: its budget, the current window, spent, reserved (in flight) and remaining."""
    rows = []
    for key in sorted(keys, key=lambda k: k.name):
        spend = ledger.key_spend(KeyLimits.of(key))
        committed = usd(spend.committed_nusd)
        rows.append({
            "key": key.name,
            "max_budget_usd": key.max_budget_usd,
            "budget_period_s": key.budget_period_s,
            "window_start": _when(spend.window_start) if key.budget_period_s else None,
            "window_end": _when(spend.window_end),
            "spent_usd": usd(spend.spent_nusd),
            "reserved_usd": usd(spend.reserved_nusd),
            "remaining_usd": None if key.max_budget_usd is None else max(key.max_budget_usd - committed, Decimal(0)),
            "soft_budget_usd": key.soft_budget_usd,
            "over_soft_budget": key.soft_budget_usd is not None and committed >= key.soft_budget_usd,
            "rpm": key.rpm, "tpm": key.tpm,
        })
    return rows


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, Decimal):
        return f"{value:.9f}".rstrip("0").rstrip(".") if value else "0"
    return str(value)


def table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    columns = list(rows[0])
    cells = [[_text(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) if _numeric(v) else v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines) + "\n"


def _numeric(text: str) -> bool:
    return text.replace(".", "", 1).isdigit()


def render(report: dict, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(report, indent=2, default=lambda v: str(v) if isinstance(v, Decimal) else v) + "\n"
    if fmt == "csv":
        out = io.StringIO()
        for name in ("spend", "budgets", "calls"):
            rows = report.get(name) or []
            if not rows:
                continue
            out.write(f"# {name}\n")
            writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
        return out.getvalue()
    text = f"spend ({report['database']})\n" + table(report["spend"])
    if report.get("budgets") is not None:
        text += "\nbudgets\n" + table(report["budgets"])
    if report.get("calls") is not None:
        text += "\ncalls\n" + table(report["calls"])
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m triton_pipelines spend", description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", help="ledger URL (default $SPEND_DATABASE_URL, else <state dir>/spend.db)")
    parser.add_argument("--state-dir", type=Path, help=f"the launcher's state folder (default ${STATE_ENV} or "
                                                       f".triton/8000)")
    parser.add_argument("--keys-file", type=Path, help=f"the keys file, for budgets (default ${KEYS_FILE_ENV})")
    parser.add_argument("--by", default="key,model,day",
                        help=f"comma-separated grouping among {', '.join(GROUPS)} (default key,model,day)")
    parser.add_argument("--since", type=_day, help="first day (YYYY-MM-DD, UTC)")
    parser.add_argument("--until", type=_day, help="day after the last (YYYY-MM-DD, UTC)")
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table")
    parser.add_argument("--calls", type=int, default=0, metavar="N",
                        help="also the last N calls, each with its request id and trace id")
    args = parser.parse_args(argv)
    state_dir = resolve_state_dir(args.state_dir)
    url = args.database or database_url(state_dir)
    if url.startswith("sqlite:///") and not Path(url[len("sqlite:///"):]).exists():
        parser.error(f"no spend ledger at {url[len('sqlite:///'):]} (pass --database, --state-dir or set "
                     f"SPEND_DATABASE_URL)")
    groups = [g.strip() for g in args.by.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        parser.error(f"--by: unknown grouping {unknown}; choose among {', '.join(GROUPS)}")
    keys_path = args.keys_file or (Path(os.environ[KEYS_FILE_ENV]) if os.environ.get(KEYS_FILE_ENV) else None)
    ledger = SpendLedger(url)
    try:
        ledger.reap()  # reservations past their deadline count as abandoned, at their reserved cost
        report = {"database": redacted_url(url), "spend": ledger.summary(groups, args.since, args.until),
                  "budgets": budgets(ledger, KeyRing.load(keys_path)) if keys_path else None,
                  "calls": recent_calls(ledger, args.calls) if args.calls > 0 else None}
    finally:
        ledger.close()
    sys.stdout.write(render(report, args.format))
    return 0


if __name__ == "__main__":
    sys.exit(main())
