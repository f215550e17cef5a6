"""The run lock means one run (issue 25 item 7): a run is its run id, owner and controller together, and a lock
is never taken over while the node-side module that wrote it still runs. Real lock files, real processes."""

import json
import os
import socket
import subprocess
import sys

import pytest
import target_lock
from ansible.module_utils.testing import patch_module_args
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import lock as node_lock
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import lock_record
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.lock import LockError, change_lock

from tests.conftest import ROOT

CI = {"owner": "ci@runner1", "controller": "runner1"}


def take(lock_dir, run_id="ticket-7", **kwargs):
    return change_lock("present", lock_dir=str(lock_dir), vmid=200, run_id=run_id, **kwargs)


def release(lock_dir, run_id="ticket-7", **kwargs):
    return change_lock("absent", lock_dir=str(lock_dir), vmid=200, run_id=run_id, **kwargs)


def held_by(lock_dir):
    return json.loads((lock_dir / "ct-200.lock").read_text())


def dead_pid():
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def test_a_second_run_with_the_same_run_id_is_refused(tmp_path):
    assert take(tmp_path, **CI, controller_pid=4101)["action"] == "taken"
    with pytest.raises(LockError) as error:
        take(tmp_path, **CI, controller_pid=4202)  # a retried CI job: same ticket id, another ansible-playbook
    assert error.value.kind == "locked"  # the drift runner's `busy`
    assert "under this run's own run id (a run id given twice: each run needs its own)" in str(error.value)
    assert held_by(tmp_path)["controller_pid"] == 4101


def test_the_first_runs_release_never_removes_the_second_runs_lock(tmp_path):
    # The first run's lock expired (its ttl passed) and the second run, same run id, took it over.
    (tmp_path / "ct-200.lock").write_text(
        json.dumps({"run_id": "ticket-7", "created": 1000, "ttl": 60, "controller_pid": 4101, **CI})
    )
    assert take(tmp_path, **CI, controller_pid=4202)["action"] == "taken_over"
    late = release(tmp_path, **CI, controller_pid=4101)  # the first run, finishing late
    assert (late["action"], late["changed"]) == ("held_by_other", False)
    assert held_by(tmp_path)["controller_pid"] == 4202
    assert release(tmp_path, **CI, controller_pid=4202)["action"] == "released"
    assert not (tmp_path / "ct-200.lock").exists()


def test_another_owner_under_the_same_run_id_is_another_run(tmp_path):
    take(tmp_path, owner="alice@ctl")
    with pytest.raises(LockError, match="locked by run ticket-7 of alice@ctl"):
        take(tmp_path, owner="bob@ctl")
    assert release(tmp_path, owner="bob@ctl")["action"] == "held_by_other"
    assert held_by(tmp_path)["owner"] == "alice@ctl"


# A node-side module of a run whose controller is gone (Ctrl-C: its ansible-playbook pid no longer exists on
# this machine): it takes the lock, says so, and works on until its stdin closes.
MODULE = """
import sys
sys.path.insert(0, sys.argv[1])
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.lock import change_lock
change_lock("present", lock_dir=sys.argv[2], vmid=200, run_id="run-1", owner="alice@ctl",
            controller=sys.argv[3], controller_pid=int(sys.argv[4]))
print("taken", flush=True)
sys.stdin.read()
"""


def test_no_takeover_while_the_previous_runs_node_side_module_still_runs(tmp_path):
    here = socket.gethostname()
    module = subprocess.Popen(
        [sys.executable, "-c", MODULE, str(ROOT / "collections"), str(tmp_path), here, str(dead_pid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert module.stdout.readline() == "taken\n"
        record = held_by(tmp_path)
        assert (record["pid"], record["pid_start"]) == (module.pid, node_lock.process_start(module.pid))
        with pytest.raises(LockError) as error:
            take(tmp_path, "run-2", owner="bob@ctl", controller=here, controller_pid=os.getpid())
        assert error.value.kind == "locked"
        assert f"its node-side module, pid {module.pid} on this node, still runs" in str(error.value)
        assert held_by(tmp_path)["run_id"] == "run-1"
    finally:
        module.stdin.close()
        module.wait(10)
    taken = take(tmp_path, "run-2", owner="bob@ctl", controller=here)
    assert taken["action"] == "taken_over"  # its controller and its module are both gone now
    assert held_by(tmp_path)["run_id"] == "run-2"


def test_a_reused_pid_is_not_the_module_that_wrote_the_lock():
    lock = {"pid": 4242, "pid_start": 100}
    assert lock_record.module_runs(lock, lambda pid, start: start == 100)
    assert not lock_record.module_runs(lock, lambda pid, start: start == 999)  # pid 4242 is another process now
    assert not lock_record.module_runs({"pid": 4242}, lambda pid, start: True)  # a lock from before: no start time


def run_target_lock(args, capsys):
    with patch_module_args(args), pytest.raises(SystemExit):
        target_lock.main()
    return json.loads(capsys.readouterr().out)


def test_target_lock_releases_only_the_very_run_that_took_it(tmp_path, capsys):
    base = {"vmid": 200, "run_id": "ticket-7", "owner": "ci@runner1", "lock_dir": str(tmp_path)}
    taken = run_target_lock(dict(base, controller="runner1", controller_pid=4101), capsys)
    assert taken["action"] == "taken"
    other = run_target_lock(dict(base, controller="runner1", controller_pid=4202, state="absent"), capsys)
    assert other["action"] == "held_by_other"
    assert held_by(tmp_path)["controller_pid"] == 4101
    mine = run_target_lock(dict(base, controller="runner1", controller_pid=4101, state="absent"), capsys)
    assert mine["action"] == "released"


def test_the_start_time_is_the_one_the_node_side_process_reads_use():
    from ansible_collections.pve_gpu.recover.plugins.module_utils.node import process as node_process  # noqa: PLC0415 (only this test needs it)

    assert node_lock.process_start(os.getpid()) == node_process.read_stat(os.getpid())[2]
    assert node_lock.process_start(dead_pid()) is None
