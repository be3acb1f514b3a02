"""deploy/prometheus with Debian's promtool (no server): the configuration and the rule files are
valid, every alert has unit tests that see it fire and stay quiet, and the rules use only recorded
series and raw metrics that exist (tests/support/prometheus_helpers.py lists them and where each was
checked)."""

from __future__ import annotations

import re

import pytest

from tests.support.prometheus_helpers import (
    PROMETHEUS_DIR, RAW_METRICS, RULE_FILES, RULE_TESTS, alert_names, load_yaml, metric_names, promtool,
    recorded_names, rules, series_names,
)


def test_promtool_check_config_finds_the_rule_files():
    result = promtool("check", "config", "prometheus.yml", cwd=PROMETHEUS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(RULE_FILES)} rule files found" in result.stdout
    assert [PROMETHEUS_DIR / name for name in load_yaml(PROMETHEUS_DIR / "prometheus.yml")["rule_files"]] == RULE_FILES


def test_promtool_check_rules():
    result = promtool("check", "rules", *map(str, RULE_FILES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(RULE_FILES)


@pytest.mark.parametrize("test_file", RULE_TESTS, ids=lambda p: p.name)
def test_promtool_test_rules(test_file):
    result = promtool("test", "rules", test_file.name, cwd=test_file.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_test_that_fires_it_and_one_where_it_stays_quiet():
    fired, quiet = set(), set()
    for test_file in RULE_TESTS:
        for case in load_yaml(test_file)["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    alerts = alert_names()
    assert len(alerts) == len(set(alerts)) >= 11
    assert not set(alerts) - fired, f"alerts no test sees firing: {sorted(set(alerts) - fired)}"
    assert not set(alerts) - quiet, f"alerts no test sees quiet: {sorted(set(alerts) - quiet)}"
    assert not (fired | quiet) - set(alerts), "tests name alerts that do not exist"


def test_every_recording_rule_has_a_promql_test():
    tested = set()
    for test_file in RULE_TESTS:
        for case in load_yaml(test_file)["tests"]:
            for check in case.get("promql_expr_test", []):
                tested |= metric_names(check["expr"])
    # The alert tests exercise the rules their alerts read; everything else needs a value test.
    used_by_alerts = set().union(*(metric_names(rule["expr"]) for rule in rules() if "alert" in rule))
    untested = recorded_names() - tested - used_by_alerts
    assert not untested, f"recording rules without a promtool test: {sorted(untested)}"


def test_rules_read_only_recorded_series_and_known_raw_metrics():
    known = recorded_names() | series_names(RAW_METRICS)
    for rule in rules():
        unknown = metric_names(rule["expr"]) - known
        assert not unknown, f"{rule.get('record') or rule.get('alert')}: unknown metrics {sorted(unknown)}"


def test_recording_rule_names_follow_level_metric_operation():
    for name in recorded_names():
        assert re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", name), name


def test_metric_name_reader():
    assert metric_names('sum by (model) (rate(nv_inference_count{model=~"a|b"}[5m] offset 10m)) / 1e6') == {
        "nv_inference_count"}
    assert metric_names("a:b:c / ignoring (version) group_left () (sum by (task) (x_total) > 0) or vector(20)") == {
        "a:b:c", "x_total"}
    assert metric_names('label_replace(rate(y[1m]), "model", "$1", "task", "(.+)") and on (instance) (up offset 10m)') == {
        "y", "up"}
