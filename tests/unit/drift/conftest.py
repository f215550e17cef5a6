"""Reports shaped exactly like recover_report's (built by the callback's own report_of from fact-pass facts), and a
stand-in for ansible-runner that main() runs against."""

import json
import re
import sys
import time
import types
from pathlib import Path

import pytest
from ansible.module_utils import _internal as module_internal
from jsonschema import Draft202012Validator

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "plugins" / "callback"))
controller = module_internal.is_controller
import recover_report  # noqa: E402

# Importing controller code makes module_utils act as on the controller; the module tests need module semantics.
module_internal.is_controller = controller

RUN_ID = "20261203T080000Z-abc123"
GPU0 = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
# A real H200's GPU as the fact pass read it and the report callback wrote it (docs/hardware: check mode, two
# processes of 8.8 GiB on it): every health field nvidia-smi gives, as the reports carry them.
H200_REPORTS = ROOT / "docs" / "hardware" / "2026-12-05" / "recover-reports.json"
H200_GPU = json.loads(H200_REPORTS.read_text())[0]["gpus"][0]
# The JSON Schemas users validate reports and summaries with (docs/schema): every report and summary these tests
# make or the runner writes is checked against them (make_report, and the autouse fixture below).
SCHEMAS = {
    name: Draft202012Validator(json.loads((ROOT / "docs" / "schema" / f"{name}.schema.json").read_text()))
    for name in ("report", "summary")
}


def schema_errors(name, document):
    """``["steps.gpu_processes.status: 'done' is not one of [...]", ...]``: where ``document`` breaks its schema."""
    found = sorted(SCHEMAS[name].iter_errors(document), key=lambda error: list(error.absolute_path))
    return [f"{'.'.join(map(str, error.absolute_path)) or '(top)'}: {error.message[:300]}" for error in found]


def schema_of(document):
    """Which schema a JSON file the tests left follows: a report of version 1, a summary of version 1, or None
    (another version on purpose, a state file, an inventory...)."""
    if not isinstance(document, dict):
        return None
    if {"target", "run_id", "tasks"} <= set(document) and document.get("schema_version") == 1:
        return "report"  # (one without the field is from before it: docs/hardware keeps such reports)
    if {"mode", "targets", "runs"} <= set(document) and document.get("version") == 1:
        return "summary"
    return None


@pytest.fixture(autouse=True)
def documents_follow_their_schemas(tmp_path):
    """After each test, every report and summary it left under its tmp_path follows docs/schema."""
    yield
    for path in sorted(tmp_path.rglob("*.json")):
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # a test's deliberately broken file
        name = schema_of(document)
        if name:
            assert not schema_errors(name, document), f"{path} breaks docs/schema/{name}.schema.json: " + "; ".join(
                schema_errors(name, document)
            )


def step_facts(changes=(), problems=(), pending=None, **extra):
    """One step's facts as evaluate_step returns them (plugins/module_utils/steps/registry.py)."""
    return {
        "changes": list(changes),
        "problems": list(problems),
        "diff": {"before": "", "after": ""},
        "pending": bool(changes) if pending is None else pending,
        "seconds": 0.01,
        **extra,
    }


def fact_pass(**steps):
    """ansible_facts.pve_gpu_recover of a CT: preflight's and the given steps' facts (a step left out is off)."""
    steps = {"preflight": step_facts(gpus=[{"uuid": GPU0, "index": 0, "memory_used_mib": 0}]), **steps}
    return {
        "run_id": RUN_ID,
        "target": {"label": "CT 200 on pve1", "vmid": 200, "node": "pve1", "hostname": "train"},
        "lock": {"path": "/run/lock/pve-gpu-recover/200.lock", "held": False, "action": "taken"},
        "pending": [name for name, facts in steps.items() if facts["pending"]],
        "problems": [problem for facts in steps.values() for problem in facts["problems"]],
        "seconds": 0.2,
        **steps,
    }


def task(step, status="ok", changed=False, action=None, remote=True):
    return {
        "step": step,
        "task": f"{step} : a task",
        "action": action or step,
        "status": status,
        "changed": changed,
        "remote": remote,
        "seconds": 0.1,
    }


def make_report(name, before, *, check_mode=True, results=None, error=None, failed_step=None, valid=True):
    """The report recover_report writes for ``name``: the fact pass, then each step's acting task.

    A step with work ran its module (changed in check mode too, as the modules report truthfully); one without
    was skipped; ``results`` are the acting modules' results; ``failed_step`` is where ``error`` happened, whose
    ``action`` is, unless it says, the failed task's (the fact pass's, its assert's, the step's module). The report
    must follow docs/schema/report.schema.json unless ``valid`` is False (what a lying CT could make of one).
    """
    results = results or {}
    if error is not None and "action" not in error:
        failed = "target_facts" if not before else "assert" if failed_step == "preflight" else failed_step
        error = dict(error, action=failed)
    tasks = [task("preflight", action="validate_argument_spec", remote=False)]
    if before:
        tasks.append(task("preflight", action="target_facts"))
    for step in ("gpu_processes", "training_code", "training_venv", "compile_cache"):
        if step == failed_step:
            tasks.append(task(step, status="failed"))
            break
        if not before or error:
            break
        facts = before.get(step)
        if facts is None:
            tasks.append(task(step, status="skipped"))
            continue
        changed = bool(results.get(step, {}).get("changed", facts["pending"]))
        tasks.append(task(step, status="ok" if facts["pending"] else "skipped", changed=changed))
    if failed_step == "preflight":
        tasks.append(task("preflight", status="failed", action="assert", remote=False))
    callback = recover_report.CallbackModule.__new__(recover_report.CallbackModule)
    callback.run_id = RUN_ID
    callback.started = time.time() - 3
    host = {"tasks": tasks, "results": dict(results), "before": before, "error": error, "first": time.time()}
    # Round-trip through JSON as the callback writes it.
    report = json.loads(json.dumps(callback.report_of(name, host, check_mode), default=str))
    assert not valid or not schema_errors("report", report), schema_errors("report", report)
    return report


def write_report(directory, report):
    """Where the callback puts it: <report dir>/<target>/<run id>.json."""
    path = directory / report["target"] / f"{report['run_id']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=True))
    return path


@pytest.fixture
def runner():
    from drift import runner as module  # noqa: PLC0415 (after ROOT is on sys.path)

    return module


def event(kind, host=None, **data):
    return {"event": kind, "event_data": dict(data, **({"host": host} if host else {}))}


def run_main(runner, argv, capsys, **kwargs):
    code = runner.main(argv, **kwargs)
    out, err = capsys.readouterr()
    return code, out, err


class FakeAnsibleRunner:
    """ansible_runner.run as the runner calls it: writes the phase's reports where PVE_GPU_RECOVER_REPORT_DIR says,
    feeds the events to event_handler, and returns what ansible-runner returns."""

    def __init__(self, phases):
        # phase ident -> (reports, events, status, rc); --correct's probe of the checkout (ident "unattended")
        # answers as a checkout that runs its steps unattended unless told otherwise.
        self.phases = {"unattended": ([], probe_events(), "successful", 0), **phases}
        self.calls = []

    def get_inventory(self, **kwargs):
        """ansible-runner's own (a real ansible-inventory of the test's inventory): where a target lives."""
        import ansible_runner  # noqa: PLC0415 (only the tests that need it pay for the import)

        self.calls.append(dict(kwargs, ident="inventory"))
        return ansible_runner.get_inventory(**kwargs)

    def run(self, **kwargs):
        self.calls.append(kwargs)
        reports, events, status, rc = self.phases[kwargs["ident"]]
        directory = Path(kwargs["envvars"]["PVE_GPU_RECOVER_REPORT_DIR"])
        for report in reports:
            write_report(directory, report)
        for item in events:
            kwargs["event_handler"](item)
        artifacts = Path(kwargs["private_data_dir"]) / "artifacts" / kwargs["ident"]
        artifacts.mkdir(parents=True)
        (artifacts / "stdout").write_text(f"PLAY RECAP ({kwargs['ident']})\n")
        return types.SimpleNamespace(status=status, rc=rc, config=types.SimpleNamespace(artifact_dir=str(artifacts)))


def probe_events(unattended=True):
    """The stand-in modules' results of drift/unattended.py's check run: what each module got."""
    from drift.unattended import UNATTENDED_STEPS  # noqa: PLC0415 (after ROOT is on sys.path)

    steps = {step: {"unattended": unattended} for step in UNATTENDED_STEPS}
    calls = [("target_facts", {"steps": {"preflight": {}, **steps}})]
    calls += [(step, {"unattended": unattended}) for step in steps]
    return [
        event("runner_on_ok", "unattended-probe", res={"pve_gpu_recover_probe": {"module": name, "params": params}})
        for name, params in calls
    ]


def project_with_unattended(tmp_path):
    project = tmp_path / "project"
    (project / "plugins" / "callback").mkdir(parents=True)
    (project / "recover.yml").write_text("- hosts: gpu_targets\n  vars: {recover_unattended: false}\n")
    (project / "ansible.cfg").write_text("[defaults]\n")
    inventory = tmp_path / "hosts.yml"
    inventory.write_text("all: {}\n")
    return project, inventory


# -- the textfile ---------------------------------------------------------------------------------------------------
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(,|$)')


def parse_exposition(text):
    """A small parser of Prometheus' text format: {name: {"help", "type", "samples": [(labels, value)]}}.

    Fails on a sample without HELP and TYPE before it, a label value with an unescaped quote or newline, an
    unknown escape, a value that is not a float, a family declared twice.
    """
    families = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            _, kind, name, rest = line.split(" ", 3)
            family = families.setdefault(name, {"help": None, "type": None, "samples": []})
            key = kind.lower()
            assert family[key] is None, f"{key} of {name} twice"
            assert not family["samples"], f"{key} of {name} after its samples"
            family[key] = rest
            continue
        match = SAMPLE.match(line)
        assert match, line
        family = families.get(match["name"])
        assert family and family["help"] and family["type"] == "gauge", f"no HELP/TYPE before {line}"
        labels, rest = {}, match["labels"] or ""
        while rest:
            label = LABEL.match(rest)
            assert label, f"bad labels in {line}"
            assert re.fullmatch(r'(?:[^\\]|\\[\\"n])*', label[2]), f"bad escape in {line}"
            labels[label[1]] = re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m[1], m[1]), label[2])
            rest = rest[label.end() :]
        family["samples"].append((labels, float(match["value"])))
    return families


def summary_of(runner, targets, exit_code=None, *, finished=1796371200.5, errors=()):
    """The summary keys the textfile is rendered from (drift/metrics.py)."""
    return {
        "targets": targets,
        "finished_timestamp": finished,
        "duration_seconds": 12.25,
        "exit_code": runner.exit_code(targets, list(errors)) if exit_code is None else exit_code,
        "counts": runner.count_statuses(targets),
        "run_ids": [RUN_ID],
        "errors": list(errors),
    }
