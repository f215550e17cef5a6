"""docs/schema: the JSON Schemas (draft 2020-12) of the run report (plugins/callback/recover_report.py) and of the
drift summary (drift/runner.py). Every report and summary the drift tests make or leave is validated against them
(conftest.py: make_report and an autouse fixture); here the schemas themselves: valid, in step with the code's own
lists, strict enough to fail a wrong document, met by the real H200 run's reports, and shipped in the collection."""

import fnmatch
import json

import pytest
import yaml
from jsonschema import Draft202012Validator

from drift import failures, gpus
from tests.conftest import ROOT
from tests.unit.drift.conftest import (
    H200_GPU,
    H200_REPORTS,
    FakeAnsibleRunner,
    fact_pass,
    make_report,
    project_with_unattended,
    run_main,
    schema_errors,
    step_facts,
)

SCHEMA_DIR = ROOT / "docs" / "schema"
LAB_REPORT = ROOT / "tests" / "fixtures" / "drift" / "lab_ct200_check.json"


def schema(name):
    return json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text())


@pytest.mark.parametrize("name", ["report", "summary"])
def test_each_schema_is_a_valid_draft_2020_12_schema(name):
    document = schema(name)
    assert document["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(document)


def test_the_schemas_name_what_the_code_writes(runner):
    summary = schema("summary")["$defs"]
    assert summary["kind"]["enum"] == list(failures.KINDS)
    assert summary["status"]["enum"] == list(runner.STATUSES)
    codes = sorted(code for code in summary["gpu"]["properties"]["recovery_action"]["enum"] if code is not None)
    assert codes == sorted([*gpus.RECOVERY_ACTIONS.values(), gpus.UNKNOWN_ACTION])
    entry = gpus.gpu_entry(H200_GPU)
    assert set(summary["gpu"]["required"]) == set(entry)
    assert summary["gpu"]["properties"]["name"]["pattern"] == gpus.MODEL.pattern
    report = schema("report")
    assert report["properties"]["schema_version"]["const"] == runner.REPORT_SCHEMA
    assert schema("summary")["properties"]["version"]["const"] == runner.SUMMARY_VERSION


def test_the_real_h200_runs_reports_follow_the_report_schema():
    reports = json.loads(H200_REPORTS.read_text())
    assert len(reports) == 13
    for report in reports:
        assert report["schema_version"] == 1
        assert not schema_errors("report", report), (report["target"], schema_errors("report", report))


def test_a_real_lab_ct_report_follows_the_report_schema_and_reads_as_eight_gpus(runner, tmp_path):
    """What the lab's CT 200 gave the callback (a real recover.yml --check through drift/runner.py: eight stand-in
    H200s, in spec), kept in tests/fixtures/drift."""
    report = json.loads(LAB_REPORT.read_text())
    assert (report["node"], report["vmid"], report["status"]) == ("pve-lab", 200, "ok")
    assert not schema_errors("report", report)
    (tmp_path / "ct200").mkdir()
    (tmp_path / "ct200" / "run.json").write_text(json.dumps(report))
    target = runner.summarize_phase(runner.load_reports(tmp_path), [])["ct200"]
    assert [gpu["index"] for gpu in target["gpus"]] == list(range(8))
    assert {gpu["recovery_action"] for gpu in target["gpus"]} == {0}
    assert {(gpu["pcie_link_width"], gpu["pcie_link_width_max"]) for gpu in target["gpus"]} == {(16, 16)}


def test_a_wrong_report_or_summary_fails_naming_where(runner, tmp_path, capsys):
    report = make_report("train200", fact_pass(preflight=step_facts(gpus=[H200_GPU])))
    broken = dict(report, status="done", gpus=[dict(H200_GPU, memory_used_mib="8811 MiB")])
    del broken["tasks"]
    assert schema_errors("report", broken) == [
        "(top): 'tasks' is a required property",
        "gpus.0.memory_used_mib: '8811 MiB' is not of type 'integer', 'null'",
        "status: 'done' is not one of ['ok', 'changed', 'failed']",
    ]
    project, inventory = project_with_unattended(tmp_path)
    fake = FakeAnsibleRunner({"check": ([report], [], "successful", 0)})
    argv = ["-i", str(inventory), "--project", str(project), "--reports-dir", str(tmp_path / "r")]
    code, out, _ = run_main(runner, argv, capsys, ansible_runner=fake)
    summary = json.loads(out)
    assert code == 0 and not schema_errors("summary", summary)
    assert summary["targets"]["train200"]["gpus"][0]["uuid"] == H200_GPU["uuid"]
    summary["targets"]["train200"]["kind"] = "gremlins"
    del summary["targets"]["train200"]["gpus"][0]["recovery_action"]
    assert [error.split(":")[0] for error in schema_errors("summary", summary)] == [
        "targets.train200.gpus.0",
        "targets.train200.kind",
    ]


def test_the_schemas_ship_in_the_collection_and_the_docs_point_to_them():
    ignored = yaml.safe_load((ROOT / "galaxy.yml").read_text()).get("build_ignore") or []
    for name in ("report", "summary"):
        path = f"docs/schema/{name}.schema.json"
        for part in ("docs", "docs/schema", path):
            assert not any(fnmatch.fnmatch(part, pattern) for pattern in ignored), (part, ignored)
        assert path in (ROOT / "docs" / "reports.md").read_text()
