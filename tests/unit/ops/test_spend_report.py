"""``python -m triton_pipelines spend``: spend by key, model and day, and the budgets left, as a
table, CSV and JSON, from a real SQLite ledger; never a secret."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from triton_pipelines.gateway.keys import KeyRing
from triton_pipelines.ops.spend_report import main
from triton_pipelines.gateway.ledger import KeyLimits, SpendLedger

SECRET = "sk-report-0123456789abcdef"


def ledger_and_keys(tmp_path: Path) -> tuple[str, Path]:
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [
        {"key": SECRET, "name": "team-a", "max_budget_usd": 0.01, "budget_period": "1d", "soft_budget_usd": 0.0001},
        {"key": "sk-report-other-0123456789", "name": "team-b"}]}))
    url = f"sqlite:///{tmp_path / 'spend.db'}"
    ledger = SpendLedger(url)
    team_a = KeyLimits.of(next(k for k in KeyRing.load(keys) if k.name == "team-a"))
    for model, cost in (("gpt-4.1", 144_000), ("gpt-4.1", 144_000), ("deepseek-v3.2", 16_380)):
        row = ledger.admit(team_a, request_id="r", task="general_llm", model=model, reserved_nusd=500_000,
                           reserved_tokens=100, expires_in_s=60)
        ledger.settle(row, status="success", input_tokens=11, output_tokens=7, cost_nusd=cost)
    ledger.close()
    return url, keys


def test_table_csv_and_json(tmp_path, capsys):
    url, keys = ledger_and_keys(tmp_path)
    assert main(["--database", url, "--keys-file", str(keys), "--by", "key,model"]) == 0
    table = capsys.readouterr().out
    assert "team-a  gpt-4.1" in table and "0.000288" in table and "0.00969562" in table  # remaining
    assert SECRET not in table
    main(["--database", url, "--keys-file", str(keys), "--by", "model", "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert {row["model"]: row["cost_usd"] for row in report["spend"]} == {"deepseek-v3.2": "0.00001638",
                                                                          "gpt-4.1": "0.000288"}
    budget = {row["key"]: row for row in report["budgets"]}
    assert budget["team-a"]["remaining_usd"] == "0.00969562" and budget["team-a"]["over_soft_budget"] is True
    assert budget["team-b"]["remaining_usd"] is None
    main(["--database", url, "--by", "key,day", "--format", "csv"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "# spend" and lines[1] == "key,day,calls,succeeded,input_tokens,output_tokens,cost_usd"
    assert lines[2].startswith("team-a,") and lines[2].endswith(",3,3,33,21,0.00030438")


def test_the_command_runs_as_a_module(tmp_path):
    url, _ = ledger_and_keys(tmp_path)
    out = subprocess.run([sys.executable, "-m", "triton_pipelines", "spend", "--database", url],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("spend (sqlite:///") and "deepseek-v3.2" in out
    missing = subprocess.run([sys.executable, "-m", "triton_pipelines", "spend", "--state-dir", str(tmp_path / "none")],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "no spend ledger" in missing.stderr
