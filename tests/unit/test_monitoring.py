"""monitoring/: the alert rules pass `promtool check rules` and their unit tests (`promtool test rules`), each rule
has its `for:` and runbook, and every query of the rules and of the Grafana dashboard names only metrics (and
labels) the drift runner writes (drift/metrics.py FAMILIES)."""

import json
import re
import shutil
import subprocess

import pytest
import yaml

from tests.conftest import ROOT, unavailable

MONITORING = ROOT / "monitoring"
RULES = MONITORING / "prometheus" / "pve_gpu_recover.rules.yml"
RULE_TESTS = MONITORING / "prometheus" / "pve_gpu_recover.rules.test.yml"
DASHBOARD = MONITORING / "grafana" / "pve-gpu-recover.json"
RUNBOOK = MONITORING / "runbook.md"
PROMTOOL = shutil.which("promtool")
METRIC = re.compile(r"\b(pve_gpu_recover_[a-z0-9_]+)\b")
# Label names a query uses: in a selector's braces, or after by/without.
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
SCRAPE_LABELS = {"instance", "job"}  # what Prometheus adds to every series it scrapes from node_exporter


@pytest.fixture(scope="module")
def families():
    """``{metric name: its label names}`` of every family the runner writes."""
    from drift import metrics  # noqa: PLC0415 (drift/ is a package of the checkout, ROOT is on sys.path)

    return {metrics.metric_name(name): set(labels) for name, (_, labels, _) in metrics.FAMILIES.items()}


def check_query(query, families):
    """Every metric a query names is the runner's, and every label it uses is one of those metrics' own."""
    named = set(METRIC.findall(query))
    assert named, f"names no metric of the runner: {query}"
    unknown = named - set(families)
    assert not unknown, f"names metrics the runner does not write: {sorted(unknown)} in {query}"
    labels = set().union(*(families[name] for name in named)) | SCRAPE_LABELS
    used = set(MATCHER.findall(query))
    for group in GROUPING.findall(query):
        used |= {label.strip() for label in group.split(",") if label.strip()}
    assert used <= labels, f"uses labels {sorted(used - labels)} that {sorted(named)} do not have: {query}"


def rules():
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def dashboard_queries(dashboard):
    found = []
    for panel in dashboard["panels"]:
        found.extend((panel["title"], t["expr"]) for t in panel.get("targets", []))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found.append((variable["name"], variable["query"]["query"]))
    return found


# -- promtool ------------------------------------------------------------------------------------------------------
def promtool(*args):
    if not PROMTOOL:
        unavailable("promtool is not installed (Debian package prometheus; `make system-deps`)")
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, check=False, cwd=RULES.parent)


def test_promtool_checks_the_rules():
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_promtool_unit_tests_pass():
    done = promtool("test", "rules", str(RULE_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


# -- the rules -------------------------------------------------------------------------------------------------------
def test_each_rule_has_a_for_a_severity_and_a_runbook_that_exists(families):
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", line[3:].strip().lower()).replace(" ", "-")
        for line in RUNBOOK.read_text().splitlines()
        if line.startswith("## ")
    }
    for rule in rules():
        name = rule["alert"]
        assert re.fullmatch(r"\d+[mh]", rule.get("for", "")), f"{name} has no for:"
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        annotations = rule["annotations"]
        assert {"summary", "description", "runbook", "runbook_url"} <= set(annotations), name
        assert "\n" not in annotations["runbook"], f"{name}: the runbook annotation is one line"
        anchor = annotations["runbook_url"].rsplit("#", 1)[1]
        assert anchor == name.lower() and anchor in anchors, f"{name}: no section {anchor} in {RUNBOOK.name}"
        check_query(rule["expr"], families)


def test_every_alert_is_unit_tested_firing():
    tested = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    firing = {case["alertname"] for test in tested for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert firing == {rule["alert"] for rule in rules()}


# -- the dashboard ---------------------------------------------------------------------------------------------------
def test_every_query_of_the_dashboard_names_metrics_and_labels_the_runner_writes(families):
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 10
    for title, query in queries:
        try:
            check_query(query, families)
        except AssertionError as error:
            raise AssertionError(f"{title}: {error}") from None


def test_the_dashboard_shows_fleet_state_drift_durations_and_last_success():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    shown = {name for _, query in dashboard_queries(dashboard) for name in METRIC.findall(query)}
    for needed in (
        "pve_gpu_recover_targets",
        "pve_gpu_recover_target_status",
        "pve_gpu_recover_drift",
        "pve_gpu_recover_run_duration_seconds",
        "pve_gpu_recover_last_success_timestamp_seconds",
        "pve_gpu_recover_runner_last_run_timestamp_seconds",
    ):
        assert needed in shown, needed
    for panel in panels:
        assert panel["targets"] and panel["description"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
