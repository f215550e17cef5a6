"""The code reset's last look in the target (users.last_look) reads by the one rule (ct_proc.scan, issue 42): one
reader for the whole look, not a ``head`` for each of three files of every process (a CT of hundreds of processes
paid a child each), and a process stuck in the driver costs one deadline, named, not one per file."""

import os
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import users

from tests.unit.plugins.module_utils.ct.test_proc import fake

REPO = "/srv/train"


def test_the_last_look_starts_one_reader_and_names_a_process_stuck_on_its_files(tmp_path, monkeypatch):
    proc = tmp_path / "proc"
    for pid in range(100, 140):
        fake(proc, pid, argv=["sleep", "60"], exe="/bin/sleep")
    fake(proc, 140, argv=["python3", "train.py"], cwd=f"{REPO}/runs")
    fake(proc, 141, argv=["python3", "worker.py"], environ=b"PYTHONPATH=/srv/train/src\0")
    fake(proc, 142, argv=["python3", "stuck.py"])
    for name in ("cmdline", "environ", "maps"):  # all three take the lock its stuck thread holds
        (proc / "142" / name).unlink()
        os.mkfifo(proc / "142" / name)
    held = [os.open(proc / "142" / name, os.O_RDWR) for name in ("cmdline", "environ", "maps")]
    calls, run = [], ct_run.run
    monkeypatch.setattr(ct_run, "run", lambda argv, *a, **k: calls.append(argv[0]) or run(argv, *a, **k))
    started = time.monotonic()
    try:
        found = users.last_look([REPO], time.monotonic() + 60, proc=str(proc))
    finally:
        for fd in held:
            os.close(fd)
    assert len(calls) == 1, calls  # 3 per process before
    assert time.monotonic() - started < 2 + ct_run.REAP_GRACE + 2  # one deadline for the stuck one, not three
    stuck = found.pop()
    assert found == [
        {"pid": 140, "name": "python3", "how": "cwd", "file": f"{REPO}/runs"},
        {"pid": 141, "name": "python3", "how": "pythonpath", "file": f"{REPO}/src"},
    ]
    assert (stuck["pid"], stuck["name"], stuck["how"]) == (142, "python3", None)
    assert stuck["error"].startswith(f"no answer within 2 s reading {proc}/142/cmdline (the process is likely stuck")


def test_processes_the_reset_deadline_leaves_unread_are_named_never_passed_over(tmp_path):
    proc = tmp_path / "proc"
    fake(proc, 150, argv=["sleep", "60"], exe="/bin/sleep")
    found = users.last_look([REPO], time.monotonic() - 1, proc=str(proc))
    assert found == [
        {"pid": 150, "name": "sleep", "how": None, "error": "not read before the reset's deadline: it may use it"}
    ]
