"""plugins/modules/training_venv.py unattended: a venv that needs a rebuild is never swapped under a live process.

On a CT through FakeRunner (who runs from the venv is read on the node: faked here), and the build script's own
look just before the swap. test_training_venv.py runs the same on a bare host with real venvs and a real job."""

import json
import socket

import pytest
import training_venv
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.process import ProcessInfo
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import acting as venv_acting
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import facts as venv_facts

from tests.fakes import FakeRunner, run_module
from tests.unit.library.test_training_venv import (
    BUILD_PAYLOAD,
    BUILT,
    CT_PARAMS,
    CT_PATH,
    IN_SPEC,
    PCT,
    POLLUTED,
    READ_PAYLOAD,
    WRAPPER,
    build_call,
    read_call,
)

UNATTENDED = dict(CT_PARAMS, unattended=True)
JOB = ProcessInfo(
    pid=90516,
    ns_pid=41,
    comm="python3",
    state="S",
    owner="ct:200",
    cmdline=[f"{CT_PATH}/bin/python", "train.py"],
    start_time=10,
)


@pytest.fixture
def job_on_the_node(monkeypatch, on_pve1):
    """The node-side read finds CT 200's training job running from the venv (by its argv[0])."""
    asked = []

    def scan(owner, roots, proc_root="/proc", exclude=()):
        asked.append((owner, roots))
        return [(JOB, "argv0", f"{CT_PATH}/bin/python")], []

    monkeypatch.setattr(venv_facts, "processes_running_from", scan)
    return asked


@pytest.fixture
def on_pve1(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "pve1")
    monkeypatch.setattr(venv_acting, "utc_stamp", lambda: BUILD_PAYLOAD["stamp"])


def unattended_build_call(built, reread):
    """The build's pct exec of an unattended run: its payload asks the script to look again before the swap."""
    # Unattended with keep unset: the current version and the 2 newest old ones stay.
    payloads = {"build": dict(BUILD_PAYLOAD, keep=3, window_check=True), "training_venv": READ_PAYLOAD}
    out = json.dumps(
        {"build": {"answer": built, "seconds": 41.2}, "training_venv": {"answer": reread, "seconds": 0.02}}
    )
    return [*PCT, "1860", *WRAPPER, json.dumps(payloads)], (0, out, "")


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
def test_ct_unattended_a_venv_in_use_is_not_rebuilt_and_the_run_does_not_fail(
    check_mode, job_on_the_node, monkeypatch, capsys
):
    runner = FakeRunner(read_call(POLLUTED))  # the read only: no build
    result = run_module(training_venv, UNATTENDED, runner, monkeypatch, capsys, check_mode=check_mode)
    assert job_on_the_node == [("ct:200", [CT_PATH])]
    assert (result["changed"], result["changes"], result["current"]) == (False, [], None)
    assert "failed" not in result
    assert result["needs_window"] == [
        "CT 200 on pve1: the venv at /opt/venvs/train needs a rebuild (torch 2.11.0+cu130 -> 2.11.0+cu128 (build "
        "variant cu130, expected cu128); remove sglang 0.5.4 (not in the lock)) but pid 90516 (python3, pid 41 inside: "
        "'/opt/venvs/train/bin/python train.py'; argv0 /opt/venvs/train/bin/python) runs from it: it is not swapped "
        "under a live process; rebuilding it needs a window (stop the job, or run recover.yml without "
        "recover_unattended)"
    ]
    assert [u["pid"] for u in result["in_use"]] == [90516]
    assert result["diff"]["before"] == result["diff"]["after"]
    assert result["wrong"] == [{"name": "torch", "locked": "2.11.0+cu128", "installed": "2.11.0+cu130"}]


def test_ct_attended_the_venv_is_rebuilt_and_nobody_is_asked_who_runs_from_it(job_on_the_node, monkeypatch, capsys):
    runner = FakeRunner(read_call(POLLUTED), build_call(BUILT, IN_SPEC))
    result = run_module(training_venv, CT_PARAMS, runner, monkeypatch, capsys)
    assert (result["changed"], result["current"], result["needs_window"], result["in_use"]) == (
        True,
        BUILT["current"],
        [],
        [],
    )
    assert job_on_the_node == []  # attended: no node-side read at all


def test_ct_check_mode_counts_the_processes_the_gpu_step_ends_first_as_gone(job_on_the_node, monkeypatch, capsys):
    params = dict(UNATTENDED, ending_pids=[41])
    check = run_module(training_venv, params, FakeRunner(read_call(POLLUTED)), monkeypatch, capsys, check_mode=True)
    assert (check["changed"], check["needs_window"]) == (True, [])
    # A real run looks at what runs now: the GPU step has ended it, or it is still there and needs a window.
    real = run_module(training_venv, params, FakeRunner(read_call(POLLUTED)), monkeypatch, capsys)
    assert (real["changed"], len(real["needs_window"])) == (False, 1)


@pytest.mark.usefixtures("on_pve1")
def test_ct_unattended_nobody_on_the_venv_it_is_rebuilt_and_the_script_looks_again_before_the_swap(monkeypatch, capsys):
    monkeypatch.setattr(venv_facts, "processes_running_from", lambda owner, roots, **_: ([], []))
    runner = FakeRunner(read_call(POLLUTED), unattended_build_call(BUILT, IN_SPEC))
    result = run_module(training_venv, UNATTENDED, runner, monkeypatch, capsys)
    assert (result["changed"], result["current"], result["needs_window"]) == (True, BUILT["current"], [])


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_job_the_script_finds_just_before_the_swap_leaves_the_venv_as_it_was(monkeypatch, capsys):
    monkeypatch.setattr(venv_facts, "processes_running_from", lambda owner, roots, **_: ([], []))
    refused = {
        "needs_window": {"path": f"{CT_PATH}.20261120T081500Z", "users": [{"pid": 77, "name": "python3"}]},
        "cleaned": [],
        "left_behind": None,
        "seconds": 40.1,
    }
    runner = FakeRunner(read_call(POLLUTED), unattended_build_call(refused, POLLUTED))
    result = run_module(training_venv, UNATTENDED, runner, monkeypatch, capsys)
    assert "failed" not in result  # the venv read after it is still the old one: no verify failure either
    assert (result["changed"], result["current"], result["changes"]) == (False, None, [])
    assert result["needs_window"][0].endswith(
        "but pid 77 inside the target (python3) runs from it (found when the new version was ready; that version was "
        "removed, nothing swapped): it is not swapped under a live process; rebuilding it needs a window (stop the "
        "job, or run recover.yml without recover_unattended)"
    )
