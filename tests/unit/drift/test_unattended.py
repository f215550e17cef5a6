"""drift/unattended.py: --correct runs only on a checkout whose recover.yml really hands recover_unattended to the
fact pass and to each acting module. The contract's pure parts, then the probe with the real ansible-playbook on
this checkout and on copies of it broken the ways a grep for the variable's name would miss."""

import shutil

import ansible_runner
import pytest

from tests.conftest import ROOT
from tests.unit.drift.conftest import event, probe_events


@pytest.fixture
def unattended(runner):
    from drift import unattended as module  # noqa: PLC0415 (after ROOT is on sys.path)

    return module


def contract(unattended, events):
    return unattended.contract_problems(*unattended.calls_of(events))


# -- pure: the contract -----------------------------------------------------------------------------------------
def test_a_checkout_that_passes_unattended_everywhere_honours_the_contract(unattended):
    assert contract(unattended, probe_events()) == []
    # As the module's bool option reads a templated string.
    assert contract(unattended, probe_events(unattended="True")) == []


def test_unattended_false_anywhere_is_named(unattended):
    problems = contract(unattended, probe_events(unattended="no"))
    assert "the fact pass got gpu_processes's settings with unattended='no'" in problems
    assert "the compile_cache module ran with unattended='no'" in problems
    assert len(problems) == 8


def test_a_module_that_never_ran_or_a_failed_run_is_refused_never_assumed(unattended):
    events = [e for e in probe_events() if e["event_data"]["res"]["pve_gpu_recover_probe"]["module"] != "verify"]
    events = [e for e in events if e["event_data"]["res"]["pve_gpu_recover_probe"]["module"] != "training_venv"]
    events.append(event("runner_on_failed", "unattended-probe", task="Rebuild", res={"msg": "undefined variable"}))
    assert contract(unattended, events) == [
        "the check run failed at Rebuild: undefined variable",
        "the training_venv module never ran with work pending",
    ]
    assert contract(unattended, []) == [
        "the fact pass (target_facts) never ran",
        "the gpu_processes module never ran with work pending",
        "the training_code module never ran with work pending",
        "the training_venv module never ran with work pending",
        "the compile_cache module never ran with work pending",
    ]


def test_the_option_missing_from_a_module_call_is_named(unattended):
    events = probe_events()
    del events[1]["event_data"]["res"]["pve_gpu_recover_probe"]["params"]["unattended"]
    assert contract(unattended, events) == ["the gpu_processes module ran with unattended=None"]


# -- the probe, with the real ansible-playbook ------------------------------------------------------------------
def checkout_copy(tmp_path):
    """This checkout's files recover.yml uses, to break one of them."""
    skip = shutil.ignore_patterns(".git", ".venv", "tests", "docs", "bench", "molecule", "reports", "__pycache__")
    copy = tmp_path / "checkout"
    shutil.copytree(ROOT, copy, symlinks=True, ignore=skip)
    return copy


def test_this_checkout_runs_every_acting_step_unattended(unattended):
    assert unattended.probe(ansible_runner, ROOT) == []


def test_a_role_that_mentions_the_variable_but_never_passes_it_to_its_module_is_refused(runner, tmp_path, capsys):
    """The roles' defaults still name recover_unattended (the old grep accepted this checkout), but the venv
    role no longer hands it to its module: a correction would swap the venv under a live job."""
    copy = checkout_copy(tmp_path)
    tasks = copy / "roles" / "training_venv" / "tasks" / "main.yml"
    text = tasks.read_text()
    assert '        unattended: "{{ training_venv_unattended }}"\n' in text
    tasks.write_text(text.replace('        unattended: "{{ training_venv_unattended }}"\n', ""))
    assert "recover_unattended" in (copy / "roles" / "training_venv" / "defaults" / "main.yml").read_text()
    (tmp_path / "hosts.yml").write_text("all: {}\n")
    argv = ["-i", str(tmp_path / "hosts.yml"), "--project", str(copy), "--correct"]
    argv += ["--reports-dir", str(tmp_path / "r"), "--timeout", "120"]
    code = runner.main(argv, ansible_runner=ansible_runner)
    _, err = capsys.readouterr()
    assert code == 1
    assert "drift: --correct refused:" in err
    assert "the training_venv module ran with unattended=None" in err


def break_fact_pass(copy, old, new):
    """The copy's recover.yml with the fact pass's settings changed (settings the preflight role is given outright
    win over the step role's variables)."""
    playbook = copy / "playbooks" / "recover.yml"
    text = playbook.read_text()
    assert old in text
    playbook.write_text(text.replace(old, new, 1))


def test_a_fact_pass_that_gets_the_step_attended_is_refused(unattended, tmp_path):
    """The module gets it, but the fact pass would plan the venv swap as ordinary work (not needs_window)."""
    copy = checkout_copy(tmp_path)
    break_fact_pass(copy, "preflight_steps: {}", "preflight_steps: {compile_cache: {unattended: false}}")
    want = "the fact pass got compile_cache's settings with unattended=False"
    assert unattended.probe(ansible_runner, copy) == [want]


def test_a_fact_pass_that_does_not_read_a_step_is_refused(unattended, tmp_path):
    copy = checkout_copy(tmp_path)
    break_fact_pass(
        copy,
        "preflight_steps_from_variables: all",
        "preflight_steps_from_variables: [gpu_processes, training_code, training_venv, verify]",
    )
    assert unattended.probe(ansible_runner, copy) == ["the fact pass got no settings for compile_cache"]
