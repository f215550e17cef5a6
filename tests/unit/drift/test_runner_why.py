"""drift/runner.py: why a target failed, one word of a fixed set (drift/failures.py), and where a target the run
never reached lives, from its inventory (drift/inventory.py, a real ansible-inventory through ansible-runner)."""

import json

import pytest

from drift import failures
from tests.unit.drift.conftest import (
    FakeAnsibleRunner,
    event,
    fact_pass,
    make_report,
    parse_exposition,
    project_with_unattended,
    run_main,
    step_facts,
)
from tests.unit.drift.test_runner import CT_STOPPED, DRIFT, READ_TASK, UNREACHABLE, locked_result, summarize


# -- why: the failure kind, one of a fixed set --------------------------------------------------------------------
def failed_report(error, before=None, failed_step="preflight"):
    return make_report("train200", before or {}, error=error, failed_step=failed_step)


def failed_event(action, kind=None, task="a task"):
    res = {"failed": True, "msg": "it failed", **({"error": kind} if kind else {})}
    return event("runner_on_failed", "train200", task=task, task_action=f"pve_gpu.recover.{action}", res=res)


KIND_CASES = {
    "in spec": ([make_report("train200", fact_pass())], [], "successful", "none"),
    "drift": ([make_report("train200", fact_pass(**DRIFT))], [], "successful", "none"),
    "unreachable": (
        [],
        [event("runner_on_unreachable", "train200", task="Read", res={"msg": UNREACHABLE})],
        "failed",
        "unreachable",
    ),
    "another run's lock": (
        [],
        [event("runner_on_failed", "train200", task=READ_TASK, task_action="target_facts", res=locked_result())],
        "failed",
        "busy",
    ),
    "a fact-pass problem (the CT stopped)": (
        [
            failed_report(
                {"step": "preflight", "task": "preflight : Assert", "msg": CT_STOPPED},
                fact_pass(preflight=step_facts(problems=[CT_STOPPED])),
            )
        ],
        [],
        "failed",
        "problems",
    ),
    "the fact pass's own kind for problems": (
        [
            failed_report(
                {
                    "step": "preflight",
                    "task": READ_TASK,
                    "action": "target_facts",
                    "msg": CT_STOPPED,
                    "kind": "problems",
                },
                fact_pass(preflight=step_facts(problems=[CT_STOPPED])),
            )
        ],
        [],
        "failed",
        "problems",
    ),
    "the known-good spec not proven": (
        [
            failed_report(
                {"step": "preflight", "task": "preflight : Assert", "msg": "torch is 2.11.0+cu130"},
                fact_pass(verify=step_facts(problems=["torch is 2.11.0+cu130"])),
            )
        ],
        [],
        "failed",
        "verify",
    ),
    "verify's module": (
        [
            failed_report(
                {"step": "verify", "task": "verify : Prove", "action": "verify", "msg": "m", "kind": "torch"},
                fact_pass(),
                "verify",
            )
        ],
        [],
        "failed",
        "verify",
    ),
    "pct: the CT is not running": (
        [
            failed_report(
                {"step": "preflight", "task": READ_TASK, "action": "target_facts", "msg": CT_STOPPED, "kind": "stopped"}
            )
        ],
        [],
        "failed",
        "stopped",
    ),
    "a step's acting module": (
        [
            failed_report(
                {"step": "training_venv", "task": "Build", "action": "training_venv", "msg": "m", "kind": "tls"},
                fact_pass(),
                "training_venv",
            )
        ],
        [],
        "failed",
        "step",
    ),
    "a compile cache in use (not the run lock)": (
        [
            failed_report(
                {"step": "compile_cache", "task": "Purge", "action": "compile_cache", "msg": "m", "kind": "busy"},
                fact_pass(),
                "compile_cache",
            )
        ],
        [],
        "failed",
        "step",
    ),
    "nvidia-smi's own kind": (
        [
            failed_report(
                {
                    "step": "preflight",
                    "task": READ_TASK,
                    "action": "target_facts",
                    "msg": "m",
                    "kind": "nvidia_smi_lost",
                }
            )
        ],
        [],
        "failed",
        "nvidia_smi",
    ),
    "a kind this runner does not know": (
        [failed_report({"step": "preflight", "task": READ_TASK, "msg": "m", "kind": "unsafe"})],
        [],
        "failed",
        "other",
    ),
    "the events alone, a module's kind": ([], [failed_event("target_facts", "timeout")], "failed", "timeout"),
    "the events alone, a task of the user's": ([], [failed_event("fail")], "failed", "other"),
    "the run's timeout": ([], [event("runner_on_start", "train200", task="Read")], "timeout", "timeout"),
    "the run canceled": ([], [event("runner_on_start", "train200", task="Read")], "canceled", "canceled"),
    "no report, nothing says why": ([], [event("runner_on_start", "train200", task="Read")], "failed", "no_report"),
    "a report of a newer schema": (
        [dict(make_report("train200", fact_pass()), schema_version=2)],
        [],
        "successful",
        "schema",
    ),
}


@pytest.mark.parametrize("case", sorted(KIND_CASES))
def test_each_failure_says_why_in_a_word_of_a_fixed_set(runner, tmp_path, case):
    reports, events, run_status, kind = KIND_CASES[case]
    target = summarize(runner, tmp_path, reports, events, run_status=run_status, timeout=600)["train200"]
    assert target["kind"] == kind
    assert kind in failures.KINDS


def test_a_drifting_target_the_correction_never_reached_says_so_and_keeps_where_it_lives(runner, tmp_path):
    checked = summarize(runner, tmp_path, [make_report("train200", fact_pass(**DRIFT))])
    merged = runner.merge_correction(checked, {})["train200"]
    assert (merged["kind"], merged["node"], merged["vmid"]) == ("no_report", "pve1", 200)


# -- where a target the run never reached lives: its inventory -------------------------------------------------------
INVENTORY = {
    "all": {
        "children": {
            "gpu_targets": {
                "hosts": {
                    "down200": {"pve_node": "pve1", "pve_vmid": 200, "ansible_host": "127.0.0.1", "ansible_port": 9},
                    "later201": {"pve_node": "{{ 'pve' ~ 2 }}", "pve_vmid": 201},  # templated: not vouched for
                    "bare202": {"ansible_connection": "local"},  # a bare GPU host: its own name, no vmid
                    "odd203": {"pve_node": "pve3", "pve_vmid": "07"},  # not a CT id
                }
            }
        }
    }
}


def test_the_inventory_says_where_targets_the_run_never_reached_live(runner, tmp_path, capsys):
    project, _ = project_with_unattended(tmp_path)
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(json.dumps(INVENTORY))
    textfile = tmp_path / "pve_gpu_recover.prom"
    down = [
        event("runner_on_unreachable", name, task="Read", res={"msg": UNREACHABLE})
        for name in INVENTORY["all"]["children"]["gpu_targets"]["hosts"]
    ]
    fake = FakeAnsibleRunner({"check": ([], down, "failed", 4)})
    argv = ["-i", str(inventory), "--project", str(project), "--reports-dir", str(tmp_path / "r")]
    code, out, _ = run_main(runner, [*argv, "--textfile", str(textfile)], capsys, ansible_runner=fake)
    assert code == 1
    targets = json.loads(out)["targets"]
    assert {name: (t["node"], t["vmid"]) for name, t in targets.items()} == {
        "down200": ("pve1", 200),
        "later201": (None, None),
        "bare202": ("bare202", None),
        "odd203": (None, None),
    }
    assert [call["ident"] for call in fake.calls] == ["check", "inventory"]  # asked once, for all of them
    info = {
        labels["target"]: labels
        for labels, _ in parse_exposition(textfile.read_text())["pve_gpu_recover_target_info"]["samples"]
    }
    assert info["down200"] == {"target": "down200", "node": "pve1", "vmid": "200", "id": "lxc/200"}
    # A run that reached every target does not ask.
    fake = FakeAnsibleRunner({"check": ([make_report("train200", fact_pass())], [], "successful", 0)})
    code, _, err = run_main(runner, [*argv[:-1], str(tmp_path / "r2")], capsys, ansible_runner=fake)
    assert code == 0, err
    assert [call["ident"] for call in fake.calls] == ["check"]


def test_an_inventory_that_cannot_be_read_costs_the_names_only(runner, tmp_path, capsys):
    project, inventory = project_with_unattended(tmp_path)

    class Broken(FakeAnsibleRunner):
        def get_inventory(self, **kwargs):
            raise RuntimeError("ansible-inventory exploded")

    down = [event("runner_on_unreachable", "down200", task="Read", res={"msg": UNREACHABLE})]
    argv = ["-i", str(inventory), "--project", str(project), "--reports-dir", str(tmp_path / "r")]
    code, out, err = run_main(runner, argv, capsys, ansible_runner=Broken({"check": ([], down, "failed", 4)}))
    assert code == 1
    assert json.loads(out)["targets"]["down200"]["node"] is None
    assert "the inventory could not say where down200 live(s): ansible-inventory exploded" in err
