"""The run lock covers the acting steps and their async jobs (issue 40, item 4): an acting module names itself, and
the async_wrapper processes of its job, in its run's lock before it changes the target, and no other run takes the
lock over while one of them lives, whatever the ttl or the controller. Real lock files, real processes."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import lock as node_lock
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import lock_record, run_lock
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.lock import LockError, change_lock

from tests.conftest import ROOT

HERE = socket.gethostname()


def dead_pid():
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def held_by(lock_dir):
    return json.loads((lock_dir / "ct-200.lock").read_text())


def first_run(lock_dir):
    """Run 1's fact pass took the lock and ended; its controller (ansible-playbook on this machine) is gone."""
    who = {"owner": "alice@ctl", "controller": HERE, "controller_pid": dead_pid()}
    taken = change_lock("present", lock_dir=str(lock_dir), vmid=200, run_id="run-1", **who)
    facts = {"path": taken["path"], "held": True, "action": "taken", "who": who}
    return dict(facts, run_id="run-1")  # what each step role's task passes as run_lock


def second_run(lock_dir):
    return change_lock(
        "present",
        lock_dir=str(lock_dir),
        vmid=200,
        run_id="run-2",
        owner="bob@ctl",
        controller=HERE,
        controller_pid=os.getpid(),
    )


# The acting module of run 1 (a venv build): it names itself in the lock, says so, and works until its stdin closes.
MODULE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import run_lock
with run_lock.working_on(json.loads(sys.argv[2]), 200, "training_venv"):
    print("working", flush=True)
    sys.stdin.read()
print("done", flush=True)
"""


def start_module(option, *wrapper):
    return subprocess.Popen(
        [*wrapper, sys.executable, "-c", MODULE, str(ROOT / "collections"), json.dumps(option)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_no_takeover_while_the_first_runs_acting_module_still_works(tmp_path):
    option = first_run(tmp_path)
    module = start_module(option)
    try:
        assert module.stdout.readline() == "working\n"
        (worker,) = held_by(tmp_path)["workers"]
        assert worker == {
            "pid": module.pid,
            "pid_start": node_lock.process_start(module.pid),
            "what": "the training_venv module",
        }
        with pytest.raises(LockError) as error:  # its controller is gone: stale, but its build is not over
            second_run(tmp_path)
        assert error.value.kind == "locked"
        assert f"pid {module.pid} (the training_venv module) of that run still work on the target" in str(error.value)
        assert held_by(tmp_path)["run_id"] == "run-1"
    finally:
        module.stdin.close()
        assert module.stdout.readline() == "done\n"
        module.wait(10)
    assert held_by(tmp_path)["workers"] == []  # it took itself off when done
    assert second_run(tmp_path)["action"] == "taken_over"


# async_wrapper as ansible-core runs it: the watcher forks the job's runner, which runs the module and waits for it;
# both keep async_wrapper's argv. Here the watcher also waits for its stdin to close after the job ended, so a test can
# kill the module and keep the job alive.
WRAPPER = """
import os, subprocess, sys
runner = os.fork()
if runner == 0:
    os._exit(subprocess.run(sys.argv[3:], stdin=sys.stdin, check=False).returncode == 1)
_, status = os.waitpid(runner, 0)
if os.waitstatus_to_exitcode(status) == 1:
    sys.exit("the module raised")  # never left waiting on stdin: the test reads its output to the end
sys.stdin.read()
"""


def test_the_async_job_of_an_acting_module_holds_the_lock_even_when_the_module_is_gone(tmp_path):
    option = first_run(tmp_path)
    script = tmp_path / "async_wrapper.py"
    script.write_text(WRAPPER)
    job = start_module(option, sys.executable, str(script), "j955916282008", "60")
    try:
        assert job.stdout.readline() == "working\n"
        workers = held_by(tmp_path)["workers"]
        assert [w["what"] for w in workers] == [
            "the training_venv module",
            "the training_venv module's async job j955916282008",
            "the training_venv module's async job j955916282008",
        ]
        assert workers[2]["pid"] == job.pid  # the watcher, the process async_wrapper leaves running
        os.kill(workers[0]["pid"], signal.SIGKILL)  # the module dies without taking itself off; its job lives on
        with pytest.raises(LockError, match=f"pid {job.pid} \\(the training_venv module's async job"):
            second_run(tmp_path)
    finally:
        job.stdin.close()
        job.wait(10)
    assert second_run(tmp_path)["action"] == "taken_over"  # every process of run 1 is gone now


def test_a_module_whose_lock_was_taken_over_changes_nothing(tmp_path):
    option = first_run(tmp_path)
    assert second_run(tmp_path)["action"] == "taken_over"  # no worker had joined yet
    acted = []
    with pytest.raises(LockError) as error, run_lock.working_on(option, 200, "training_venv"):
        acted.append(True)
    assert acted == []
    assert error.value.kind == "locked"
    assert "the run lock" in str(error.value)
    assert "is no longer this run's (it is held by run run-2 of bob@ctl" in str(error.value)
    assert held_by(tmp_path)["run_id"] == "run-2"
    assert "workers" not in held_by(tmp_path)


def test_a_module_whose_lock_was_released_changes_nothing(tmp_path):
    option = first_run(tmp_path)
    change_lock("absent", lock_dir=str(tmp_path), vmid=200, run_id="run-1", **option["who"])
    with (
        pytest.raises(LockError, match="is no longer this run's \\(it is gone\\)"),
        run_lock.working_on(option, 200, "training_code"),
    ):
        pytest.fail("acted without the lock")


def test_the_runs_own_release_keeps_the_lock_while_its_worker_lives(tmp_path):
    """The controller's poll gave up (a node hiccup) and the steps' `always:` releases: the build still runs."""
    option = first_run(tmp_path)
    module = start_module(option)
    warnings = []
    try:
        assert module.stdout.readline() == "working\n"
        kept = change_lock(
            "absent", lock_dir=str(tmp_path), vmid=200, run_id="run-1", warn=warnings.append, **option["who"]
        )
        assert (kept["action"], kept["changed"]) == ("kept_for_worker", False)
        assert kept["holder"]["run_id"] == "run-1"
        assert f"pid {module.pid} (the training_venv module) of this run still work on it" in warnings[0]
        assert (tmp_path / "ct-200.lock").exists()
    finally:
        module.stdin.close()
        module.wait(10)
    released = change_lock("absent", lock_dir=str(tmp_path), vmid=200, run_id="run-1", **option["who"])
    assert released["action"] == "released"


def test_without_a_held_lock_the_module_records_nothing(tmp_path):
    for option in (None, {}, {"held": False, "path": str(tmp_path / "ct-200.lock")}):
        with run_lock.working_on(option, 200, "verify"):
            pass
    assert list(tmp_path.iterdir()) == []


def test_a_run_lock_that_names_another_targets_file_is_refused():
    option = {"held": True, "path": "/run/lock/pve-gpu-recover/ct-201.lock", "run_id": "r", "who": {}}
    with pytest.raises(LockError) as error:
        run_lock.run_of(option, 200)
    assert error.value.kind == "invalid"
    assert "this target's lock file (.../ct-200.lock)" in str(error.value)
    assert run_lock.run_of(dict(option, path="/run/lock/x/host.lock"), None)[0] == "/run/lock/x"


@pytest.mark.parametrize(
    "workers",
    [
        "pid 7",
        [{"pid": 7, "pid_start": 1, "what": "x"}] * (lock_record.MAX_WORKERS + 1),
        [{"pid": True, "pid_start": 1, "what": "x"}],
        [{"pid": 7, "pid_start": -1, "what": "x"}],
        [{"pid": 7, "pid_start": 1, "what": "x" * 1001}],
        [{"pid": 7, "pid_start": 1}],
    ],
)
def test_workers_that_are_not_processes_make_the_lock_unreadable(workers):
    holder = lock_record.parse_lock(json.dumps({"run_id": "r", "created": 1000, "workers": workers}).encode(), 5)
    assert holder["run_id"] == lock_record.UNREADABLE
    assert "workers" in holder["problem"]


def test_a_worker_with_a_reused_pid_holds_nothing():
    lock = {"run_id": "r", "created": 1000, "ttl": 10, "workers": [{"pid": 7, "pid_start": 1, "what": "the x module"}]}
    assert lock_record.plan_lock("present", lock, "mine", 2000, module_alive=lambda pid, start: start == 2) == (
        "taken_over",
        True,
    )
    assert lock_record.plan_lock("present", lock, "mine", 2000, module_alive=lambda pid, start: start == 1) == (
        "locked",
        False,
    )
