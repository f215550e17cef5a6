"""monitoring/: the alert rules are drift/rules.py's output (the defaults checked in, other settings written the
same way), pass `promtool check rules` and their unit tests (`promtool test rules`) for the defaults and for
changed settings (a 15-minute timer, a selector, another severity, a runbook URL), and every query of the rules and
of the Grafana dashboard names only metrics and labels that the textfile the runner renders really holds. The
dashboard imports with Grafana's data source prompt; its series join prometheus-pve-exporter's and dcgm-exporter's
with their real label names."""

import json
import re
import shutil
import subprocess

import pytest
import yaml

from drift import metrics, rules
from tests.conftest import ROOT, unavailable
from tests.unit.drift.conftest import H200_GPU, event, fact_pass, make_report, step_facts, summary_of, write_report

MONITORING = ROOT / "monitoring"
RULES = MONITORING / "prometheus" / "pve_gpu_recover.rules.yml"
RULE_TESTS = MONITORING / "prometheus" / "pve_gpu_recover.rules.test.yml"
DASHBOARD = MONITORING / "grafana" / "pve-gpu-recover.json"
RUNBOOK = MONITORING / "runbook.md"
PROMTOOL = shutil.which("promtool")
METRIC = re.compile(r"\b(pve_gpu_recover_[a-z0-9_]+)\b")
# Label names a query uses: in a selector's braces, after by/without/on/ignoring/group_left, in label_values().
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
LABEL_VALUES = re.compile(r"label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\)")
SCRAPE_LABELS = {"instance", "job"}  # what Prometheus adds to every series it scrapes from node_exporter
SICK_UUID = "GPU-11111111-2222-3333-4444-555555555555"
# The runner's infrastructure (not a target): never critical by default.
RUNNER_ALERTS = ("PveGpuRecoverRunnerNotRunning", "PveGpuRecoverRunnerAbsent", "PveGpuRecoverRunnerFailing")


# -- the textfile the runner really writes -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """``{metric name: [labels of each sample]}`` of the textfile rendered from a fleet the tests build: reports
    written as the callback writes them (a drifting target with a real H200 and a sick GPU, a busy, a failed and an
    unreachable one), summarized by the runner, rendered by drift/metrics.py, read back by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    from drift import runner  # noqa: PLC0415

    directory = tmp_path_factory.mktemp("reports")
    sick = dict(H200_GPU, index=1, uuid=SICK_UUID, recovery_action="Reset", retired_pages_pending=True)
    sick.update(ecc_uncorrected_aggregate=2, xid_events=[{"xid": 79, "count": 1, "last_timestamp": 1796600000.0}])
    drifting = fact_pass(
        preflight=step_facts(gpus=[H200_GPU, sick]),
        training_venv=step_facts(["torch 2.11.0+cu130 -> 2.11.0+cu128"], needs_window=["pid 4242 runs from it"]),
    )
    stopped = fact_pass(preflight=step_facts(problems=["CT 203 on pve1: not running"]))
    reports = [
        make_report("train200", drifting),
        make_report("bad203", stopped, error={"step": "preflight", "task": "t", "msg": "m"}, failed_step="preflight"),
    ]
    for report in reports:
        write_report(directory, report)
    locked = {"failed": True, "msg": "locked by run X", "error": "locked", "lock": {"holder": {"run_id": "X"}}}
    events = [
        event("runner_on_failed", "busy201", task="Read", task_action="target_facts", res=locked),
        event("runner_on_unreachable", "down202", task="Read", res={"msg": "Connection refused"}),
    ]
    targets = runner.summarize_phase(runner.load_reports(directory), events)
    targets["down202"].update(node="pve2", vmid=202)  # as the runner names it from the inventory
    text, _ = metrics.render_textfile(summary_of(runner, targets))
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample.labels)
    return found


def test_the_fleet_renders_a_sample_of_every_family(written):
    """Else a query on a family would be checked against nothing."""
    assert set(written) == set(metrics.names())


def check_query(query, written):
    """Every metric a query names has samples in the rendered textfile, and every label it uses is on them."""
    named = set(METRIC.findall(query))
    assert named, f"names no metric of the runner: {query}"
    unknown = named - set(written)
    assert not unknown, f"names metrics the runner does not write: {sorted(unknown)} in {query}"
    labels = {label for name in named for sample in written[name] for label in sample} | SCRAPE_LABELS
    used = set(MATCHER.findall(query))
    for group in GROUPING.findall(query):
        used |= {label.strip() for label in group.split(",") if label.strip()}
    for _, label in LABEL_VALUES.findall(query):
        used.add(label)
    assert used <= labels, f"uses labels {sorted(used - labels)} that {sorted(named)} do not have: {query}"


# -- the rules: written from settings ---------------------------------------------------------------------------------
def rules_of(text):
    return [rule for group in yaml.safe_load(text)["groups"] for rule in group["rules"]]


def promtool(*args, cwd):
    if not PROMTOOL:
        unavailable("promtool is not installed (Debian package prometheus; `make system-deps`)")
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, check=False, cwd=cwd)


def test_the_checked_in_rules_are_the_generators_output_for_the_defaults():
    assert RULES.read_text() == rules.render()
    done = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "drift" / "rules.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout) == (0, RULES.read_text()), done.stderr


def test_promtool_checks_and_unit_tests_the_default_rules():
    done = promtool("check", "rules", str(RULES), cwd=RULES.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules_of(RULES.read_text()))} rules found" in done.stdout
    done = promtool("test", "rules", str(RULE_TESTS), cwd=RULES.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_the_defaults_keep_the_hourly_thresholds_and_the_runners_own_alerts_are_not_critical():
    found = {rule["alert"]: rule for rule in rules_of(RULES.read_text())}
    assert {name: found[name]["for"] for name in found} == {
        "PveGpuRecoverDrift": "3h",
        "PveGpuRecoverNeedsWindow": "24h",
        "PveGpuRecoverTargetFailed": "1h30m",
        "PveGpuRecoverTargetUnreachable": "1h30m",
        "PveGpuRecoverTargetBusy": "3h",
        "PveGpuRecoverTargetNotChecked": "15m",
        "PveGpuRecoverRunnerNotRunning": "15m",
        "PveGpuRecoverRunnerAbsent": "2h",
        "PveGpuRecoverRunnerFailing": "15m",
        "PveGpuRecoverGpuRecoveryAction": "30m",
        "PveGpuRecoverGpuEccUncorrected": "30m",
        "PveGpuRecoverGpuRemapFailed": "30m",
        "PveGpuRecoverGpuResetPending": "30m",
        "PveGpuRecoverGpuPcieLinkDegraded": "1h30m",
        "PveGpuRecoverGpuPersistenceOff": "1h30m",
        "PveGpuRecoverGpuXid": "30m",
    }
    assert "> 21600" in found["PveGpuRecoverTargetNotChecked"]["expr"]
    assert '{xid=~"48|61|62|64|74|79|95|119|120|140"} < 7200' in found["PveGpuRecoverGpuXid"]["expr"]
    assert "> 7200" in found["PveGpuRecoverRunnerNotRunning"]["expr"]
    assert {found[name]["labels"]["severity"] for name in RUNNER_ALERTS} == {"warning"}
    # No runbook_url until a setting says where the runbook is served (no link to a page that does not exist).
    assert not any("runbook_url" in rule["annotations"] for rule in found.values())


def test_each_rule_has_a_for_a_severity_a_runbook_and_a_section_of_the_runbook(written):
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", line[3:].strip().lower()).replace(" ", "-")
        for line in RUNBOOK.read_text().splitlines()
        if line.startswith("## ")
    }
    url = "https://wiki.example.org/pve-gpu-recover/runbook.md"
    for rule in rules_of(rules.render({"runbook_url": url})):
        name = rule["alert"]
        assert re.fullmatch(r"(\d+h)?(\d+m)?(\d+s)?", rule.get("for", "")) and rule["for"], f"{name} has no for:"
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        annotations = rule["annotations"]
        assert {"summary", "description", "runbook", "runbook_url"} <= set(annotations), name
        assert "\n" not in annotations["runbook"], f"{name}: the runbook annotation is one line"
        assert annotations["runbook_url"] == f"{url}#{name.lower()}"
        assert name.lower() in anchors, f"{name}: no section {name} in {RUNBOOK.name}"
        check_query(rule["expr"], written)


def test_every_alert_is_unit_tested_firing_and_silent():
    tested = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    cases = [case for test in tested for case in test["alert_rule_test"]]
    names = {rule["alert"] for rule in rules_of(RULES.read_text())}
    assert {case["alertname"] for case in cases if case["exp_alerts"]} == names
    assert {case["alertname"] for case in cases if not case["exp_alerts"]} == names


def test_a_setting_that_cannot_make_rules_is_refused_naming_it():
    for settings, said in (
        ({"period": "an hour"}, "period is 'an hour': expected a duration"),
        ({"selector": "job=node"}, "selector is 'job=node': expected label matchers"),
        ({"runbook_url": "runbook.md#top"}, "runbook_url is 'runbook.md#top'"),
        ({"alerts": {"PveGpuRecoverDrfit": {}}}, "unknown alert 'PveGpuRecoverDrfit'"),
        ({"alerts": {"PveGpuRecoverDrift": {"severity": "very bad"}}}, "severity is 'very bad'"),
        ({"alerts": {"PveGpuRecoverDrift": {"after": 3}}}, "PveGpuRecoverDrift has no age threshold"),
        ({"alerts": {"PveGpuRecoverDrift": {"for": 0}}}, "for is 0: expected a positive number of periods"),
        ({"perod": "1h"}, "unknown setting(s) perod"),
        ({"xids": ["79"]}, "xids is ['79']: expected a list of Xid codes"),
        ({"xids": []}, "xids is []: expected a list of Xid codes"),
    ):
        with pytest.raises(rules.RulesError) as error:
            rules.render(settings)
        assert said in str(error.value)
    done = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "drift" / "rules.py"), "--settings", '{"period": "1x"}'],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == "drift/rules.py: period is '1x': expected a duration such as 15m, 1h or 1h30m\n"


# A 15-minute timer on a Prometheus that scrapes more than the drift controller: its job selected, a failed target
# pages, the runbook served on a wiki, and the persistence alert left out.
CHANGED = {
    "period": "15m",
    "selector": 'job="drift"',
    "runbook_url": "https://wiki.example.org/pve-gpu-recover/runbook.md",
    "alerts": {
        "PveGpuRecoverTargetFailed": {"severity": "page"},
        "PveGpuRecoverNeedsWindow": {"for": "12h"},
        "PveGpuRecoverGpuPersistenceOff": {"enabled": False},
    },
    "xids": [79, 13],  # an application's fault alerted on too, here
}
# When each alert of CHANGED must fire, not before: (quiet at, firing at), as a person counts it for a 15-minute
# timer (3 runs of drift = 45 min; 2 runs of a failure = 22m30s; a GPU's reading kept half a period = 7m30s), and
# what it then says.
WIKI = CHANGED["runbook_url"]
CT200 = "ct200 (CT 200 on pve1)"
CHANGED_ALERTS = {
    "PveGpuRecoverDrift": (
        "44m",
        "46m",
        'pve_gpu_recover_drift{target="ct200",node="pve1",vmid="200",step="training_venv"}',
        {
            "summary": "ct200: training_venv out of spec for 45 min",
            "description": f"The drift check has found training_venv of {CT200} out of its known-good state for "
            "45 min.",
        },
    ),
    "PveGpuRecoverNeedsWindow": (
        "11h59m",
        "12h1m",
        'pve_gpu_recover_needs_window{target="ct200",node="pve1",vmid="200",step="training_venv"}',
        {
            "summary": "ct200: training_venv has waited for a maintenance window for 12 h",
            "description": "1 thing(s) of training_venv on ct200 wait for a window: --correct leaves them while the "
            "job runs.",
        },
    ),
    "PveGpuRecoverTargetFailed": (
        "22m",
        "23m",
        'pve_gpu_recover_target_failed{target="ct200",node="pve1",vmid="200",kind="problems"}',
        {
            "summary": "ct200: the drift check fails (problems)",
            "description": f"The drift runner's last runs failed on {CT200}, kind problems; its drift values are "
            "those of its last successful check.",
        },
    ),
    "PveGpuRecoverTargetUnreachable": (
        "22m",
        "23m",
        'pve_gpu_recover_target_status{target="ct200",node="pve1",vmid="200",status="unreachable"}',
        {
            "summary": "ct200: its node pve1 does not answer",
            "description": "The drift runner could not reach ct200's node pve1 over ssh in its last runs.",
        },
    ),
    "PveGpuRecoverTargetBusy": (
        "44m",
        "46m",
        'pve_gpu_recover_target_status{target="ct200",node="pve1",vmid="200",status="busy"}',
        {
            "summary": "ct200: held by another recover run for 45 min",
            "description": "Every drift check of ct200 for 45 min found its run lock held by another run.",
        },
    ),
    "PveGpuRecoverGpuRecoveryAction": (
        "7m",
        "8m",
        f'pve_gpu_recover_gpu_recovery_action{{target="ct200",node="pve1",vmid="200",index="0",uuid="{H200_GPU["uuid"]}",'
        'name="NVIDIA H200"}',
        {
            "summary": "ct200: GPU 0 needs a recovery action (1)",
            "description": "The driver asks for recovery action 1 (1 GPU reset, 2 node reboot, 3 drain peer-to-peer, 4 "
            f"drain and reset, -1 another) on GPU 0 ({H200_GPU['uuid']}, NVIDIA H200) of {CT200}.",
        },
    ),
    # Logged at 1 s; alerted on for two periods (30 min) once it was seen for half of one.
    "PveGpuRecoverGpuXid": (
        "7m",
        "8m",
        f'pve_gpu_recover_gpu_xid_last_timestamp_seconds{{target="ct200",node="pve1",vmid="200",index="0",'
        f'uuid="{H200_GPU["uuid"]}",name="NVIDIA H200",xid="13"}}',
        {
            "summary": "ct200: GPU 0 had Xid 13",
            "description": f"The node's kernel logged Xid 13 of GPU 0 ({H200_GPU['uuid']}) of {CT200} 7m 59s ago.",
        },
    ),
}


def annotations_of(alert, said):
    """What an alert of the CHANGED rules says: ``said`` (summary, description), its runbook line, its URL."""
    return {**said, "runbook": rules.ALERTS[alert]["runbook"], "runbook_url": f"{WIKI}#{alert.lower()}"}


def changed_rule_tests():
    """promtool unit tests of the rules written from CHANGED: each alert fires at its own time for the series of
    job "drift" and never for the same series of another job (the selector), with its severity and runbook_url."""
    tests = []
    for alert, (quiet, firing, series, said) in CHANGED_ALERTS.items():
        name, labels = re.match(r"^(\w+)\{(.*)\}$", series).groups()
        expected = dict(re.findall(r'(\w+)="([^"]*)"', labels), instance="ctl:9100", job="drift")
        expected["severity"] = "page" if alert == "PveGpuRecoverTargetFailed" else rules.ALERTS[alert]["severity"]
        tests.append(
            {
                "name": f"{alert} on a 15-minute timer, job drift only",
                "interval": "1m",
                "input_series": [
                    {"series": f'{name}{{instance="ctl:9100",job="drift",{labels}}}', "values": "1x900"},
                    {"series": f'{name}{{instance="other:9100",job="node",{labels}}}', "values": "1x900"},
                ],
                "alert_rule_test": [
                    {"eval_time": quiet, "alertname": alert, "exp_alerts": []},
                    {
                        "eval_time": firing,
                        "alertname": alert,
                        "exp_alerts": [{"exp_labels": expected, "exp_annotations": annotations_of(alert, said)}],
                    },
                ],
            }
        )
    runner = {"instance": "ctl:9100", "job": "drift"}
    tests.append(
        {
            "name": "a runner that stopped on a 15-minute timer",
            "interval": "1m",
            "input_series": [
                {
                    "series": 'pve_gpu_recover_runner_last_run_timestamp_seconds{instance="ctl:9100",job="drift"}',
                    "values": "0x200",
                },
                {
                    "series": 'pve_gpu_recover_runner_last_run_timestamp_seconds{instance="x:9100",job="node"}',
                    "values": "0+60x200",
                },
            ],
            "alert_rule_test": [
                # Two periods without a run (30 min), then its 15 minutes: 45 min.
                {"eval_time": "44m", "alertname": "PveGpuRecoverRunnerNotRunning", "exp_alerts": []},
                {
                    "eval_time": "47m",
                    "alertname": "PveGpuRecoverRunnerNotRunning",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "warning", **runner},
                            "exp_annotations": annotations_of(
                                "PveGpuRecoverRunnerNotRunning",
                                {
                                    "summary": "the drift runner has not run for 30 min",
                                    "description": "The drift runner on ctl:9100 last finished 47m 0s ago.",
                                },
                            ),
                        }
                    ],
                },
            ],
        }
    )
    tests.append(
        {
            "name": "no textfile of job drift, though another job has one",
            "interval": "1m",
            "input_series": [
                {
                    "series": 'pve_gpu_recover_runner_last_run_timestamp_seconds{instance="x:9100",job="node"}',
                    "values": "0+60x200",
                },
            ],
            "alert_rule_test": [
                {"eval_time": "29m", "alertname": "PveGpuRecoverRunnerAbsent", "exp_alerts": []},
                {
                    "eval_time": "31m",
                    "alertname": "PveGpuRecoverRunnerAbsent",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "warning", "job": "drift"},
                            "exp_annotations": annotations_of(
                                "PveGpuRecoverRunnerAbsent",
                                {
                                    "summary": "no metrics from the drift runner",
                                    "description": "No node_exporter scraped by this Prometheus has "
                                    "pve_gpu_recover_runner_last_run_timestamp_seconds for 30 min.",
                                },
                            ),
                        }
                    ],
                },
            ],
        }
    )
    return {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests}


def test_rules_written_for_a_15_minute_timer_a_selector_and_other_severities_pass_promtool(tmp_path):
    text = rules.render(CHANGED)
    found = {rule["alert"]: rule for rule in rules_of(text)}
    assert "PveGpuRecoverGpuPersistenceOff" not in found
    assert 'xid=~"13|79"} < 1800' in found["PveGpuRecoverGpuXid"]["expr"]
    assert found["PveGpuRecoverTargetFailed"]["labels"]["severity"] == "page"
    assert found["PveGpuRecoverDrift"]["expr"] == 'pve_gpu_recover_drift{job="drift"} == 1'
    assert found["PveGpuRecoverTargetNotChecked"]["expr"] == (
        'time() - pve_gpu_recover_last_success_timestamp_seconds{job="drift"} > 5400'
    )
    for rule in found.values():
        assert rule["annotations"]["runbook_url"] == f"{CHANGED['runbook_url']}#{rule['alert'].lower()}"
        for selector in re.findall(r"pve_gpu_recover_\w+(\{[^}]*\})?", rule["expr"]):
            assert selector.startswith('{job="drift"'), rule["expr"]
    (tmp_path / "rules.yml").write_text(text)
    (tmp_path / "rules.test.yml").write_text(yaml.safe_dump(changed_rule_tests(), sort_keys=False))
    done = promtool("check", "rules", "rules.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    done = promtool("test", "rules", "rules.test.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


# -- the dashboard ---------------------------------------------------------------------------------------------------
def dashboard_queries(dashboard):
    found = []
    for panel in dashboard["panels"]:
        found.extend((panel["title"], t["expr"]) for t in panel.get("targets", []))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found.append((variable["name"], variable["query"]["query"]))
    return found


def test_every_query_of_the_dashboard_names_metrics_and_labels_the_textfile_holds(written):
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 20
    for title, query in queries:
        try:
            check_query(query, written)
        except AssertionError as error:
            raise AssertionError(f"{title}: {error}") from None


def datasources(node):
    """Every ``datasource`` value anywhere in the dashboard."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield value
            else:
                yield from datasources(value)
    elif isinstance(node, list):
        for item in node:
            yield from datasources(item)


def test_the_dashboard_imports_asking_for_its_data_source():
    dashboard = json.loads(DASHBOARD.read_text())
    inputs = {item["name"]: item for item in dashboard["__inputs"]}
    assert inputs["DS_PROMETHEUS"] | {"label": None, "description": None} == {
        "name": "DS_PROMETHEUS",
        "label": None,
        "description": None,
        "type": "datasource",
        "pluginId": "prometheus",
        "pluginName": "Prometheus",
    }
    text = DASHBOARD.read_text()
    # Every data source (panels, their queries, the variables) is the one the import asks for.
    sources = list(datasources(dashboard))
    assert len(sources) > 40
    assert all(source == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"} for source in sources), sources
    assert "${datasource}" not in text
    # Every variable a query or link uses is defined (or is an input of the import).
    defined = {v["name"] for v in dashboard["templating"]["list"]} | set(inputs)
    used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text)) - {"__interval", "__rate_interval"}
    assert used <= defined, sorted(used - defined)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_the_dashboard_shows_fleet_state_why_drift_gpu_health_and_last_success():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    shown = {name for _, query in dashboard_queries(dashboard) for name in METRIC.findall(query)}
    for needed in (
        "pve_gpu_recover_targets",
        "pve_gpu_recover_target_status",
        "pve_gpu_recover_target_failed",
        "pve_gpu_recover_drift",
        "pve_gpu_recover_run_duration_seconds",
        "pve_gpu_recover_last_success_timestamp_seconds",
        "pve_gpu_recover_runner_last_run_timestamp_seconds",
        *(metrics.metric_name(family) for family in metrics.GPU_VALUES),
        "pve_gpu_recover_gpu_read_timestamp_seconds",
    ):
        assert needed in shown, needed
    for panel in panels:
        assert panel["targets"] and panel["description"], panel["title"]


def test_no_panel_shows_the_age_of_a_timestamp_that_never_was():
    """time() - 0 is 56 years: every age the dashboard computes leaves out a timestamp of 0 (never checked)."""
    ages = [q for _, q in dashboard_queries(json.loads(DASHBOARD.read_text())) if "time() -" in q]
    assert len(ages) >= 4
    for query in ages:
        assert re.search(r"_timestamp_seconds\{[^}]*\}\s*> 0\)", query), query


def test_the_ages_and_joins_of_the_dashboard_and_docs_hold_in_prometheus(tmp_path):
    """Against promtool's PromQL engine: a target never checked has no age (not 56 years), a checked one its
    own; target_info joins prometheus-pve-exporter's pve_up and pve_guest_info by id (their labels as the
    exporter writes them), and a GPU's series join dcgm-exporter's by UUID (its label as dcgm-exporter writes it)."""
    dashboard = json.loads(DASHBOARD.read_text())
    (age,) = [t["expr"] for p in dashboard["panels"] if p["title"] == "Last successful check" for t in p["targets"]]
    age = age.replace("$instance", ".*").replace("$node", ".*").replace("$target", ".*")
    ct = 'instance="ctl:9100",job="node"'
    ct200, ct201 = (f'{ct},target="ct{n}",node="pve1",vmid="{n}"' for n in (200, 201))
    pve = 'instance="pve1:9221",job="pve"'
    guest = 'id="lxc/200",name="train",node="pve1",tags="gpu",template="0",type="lxc"'
    dcgm = 'instance="pve1:9400",job="dcgm",gpu="3",device="nvidia3",modelName="NVIDIA H200",Hostname="pve1"'
    uuid = H200_GPU["uuid"]
    gpu = f'UUID="{uuid}",pci_bus_id="00000000:00:06.0"'

    def series(name, labels, values):
        return {"series": f"{name}{{{labels}}}", "values": values}

    def sample(labels, value, name=""):
        return {"labels": f"{name}{{{labels}}}", "value": value}

    test = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    series("pve_gpu_recover_last_success_timestamp_seconds", ct200, "0x20"),
                    series("pve_gpu_recover_last_success_timestamp_seconds", ct201, "60x20"),
                    series("pve_gpu_recover_target_info", f'{ct200},id="lxc/200"', "1x20"),
                    series("pve_up", f'{pve},id="lxc/200"', "0x20"),
                    series("pve_guest_info", f"{pve},{guest}", "1x20"),
                    series("pve_gpu_recover_gpu_info", f'{ct200},index="0",uuid="{uuid}",name="NVIDIA H200"', "1x20"),
                    series("DCGM_FI_DEV_XID_ERRORS", f"{dcgm},{gpu}", "79x20"),
                ],
                "promql_expr_test": [
                    {"expr": age, "eval_time": "10m", "exp_samples": [sample('target="ct201"', 540)]},
                    {
                        "expr": "pve_up == 0 and on (id) pve_gpu_recover_target_info",
                        "eval_time": "10m",
                        "exp_samples": [sample(f'{pve},id="lxc/200"', 0, "pve_up")],
                    },
                    {
                        "expr": "pve_guest_info * on (id) group_left (target) pve_gpu_recover_target_info",
                        "eval_time": "10m",
                        "exp_samples": [sample(f'{pve},{guest},target="ct200"', 1)],
                    },
                    {
                        "expr": DCGM_JOIN,
                        "eval_time": "10m",
                        "exp_samples": [sample(f'{dcgm},{gpu},target="ct200",vmid="200"', 79)],
                    },
                ],
            }
        ],
    }
    (tmp_path / "joins.test.yml").write_text(yaml.safe_dump(test, sort_keys=False))
    done = promtool("test", "rules", "joins.test.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    readme = (ROOT / "README.md").read_text()
    assert DCGM_JOIN in readme, "README.md, Monitoring, gives the join this test runs"


DCGM_JOIN = (
    'DCGM_FI_DEV_XID_ERRORS * on (UUID) group_left (target, vmid) label_replace(pve_gpu_recover_gpu_info, "UUID", '
    '"$1", "uuid", "(.+)")'
)
