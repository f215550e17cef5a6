"""The compile cache's probe part reads who uses a root on every fact pass (issue 40): a process stuck in the driver
holds its mmap lock, so a plain read of its maps never returns and the whole fact pass died at its pct exec's
timeout with nobody named. Now the read is ct_proc's (one child per pass, each file under a deadline): the process
is named, the probe goes on, every other process is still read, and a purge names it in its warning. A FIFO in a
fake /proc plays the file that blocks (tests/unit/plugins/module_utils/ct/test_proc.py)."""

import os
import subprocess
import threading
import time

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import probe as cache_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import script as cache_script
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import verdicts as cache_verdicts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache.answer import CacheError

from tests.unit.plugins.module_utils.ct.test_proc import fake
from tests.unit.plugins.module_utils.steps.compile_cache.test_facts import LABEL, STALE, answer_of, facts_of

ROOT = "/tmp/torchinductor_root"


def within(seconds, call, unblock):
    """``call()``'s answer, or a failure when it has not answered within ``seconds`` (``unblock()`` then lets the
    read it hangs on return, so that the test run goes on)."""
    answers = []
    thread = threading.Thread(target=lambda: answers.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        unblock()
        thread.join(10)
        pytest.fail(f"no answer within {seconds} s: a read of /proc hung")
    return answers[0]


def test_a_process_whose_maps_blocks_is_named_and_never_hangs_the_probe(tmp_path):
    proc = tmp_path / "proc"
    fake(proc, 41, argv=["python3", "train.py"], cwd=ROOT)
    fake(proc, 42, argv=["python3", "stuck.py"], cwd="/root")
    fake(proc, 43, argv=["tail", "-f", f"{ROOT}/log"], exe="/usr/bin/tail")
    fake(proc, 44, argv=["sleep", "60"], exe="/bin/sleep", maps=[f"{ROOT}/kernel.so"])
    (proc / "42" / "maps").unlink()
    os.mkfifo(proc / "42" / "maps")
    held = [os.open(proc / "42" / "maps", os.O_RDWR)]  # a writer that never writes: a read waits for ever

    def unblock():  # the last writer gone: a read that waits gets the end of the file
        os.close(held.pop())

    started = time.monotonic()
    try:
        users, unreadable, partial = within(
            20, lambda: cache_probe.read_users([ROOT], time.monotonic() + 30, os.getpid(), proc=str(proc)), unblock
        )
    finally:
        if held:
            unblock()
    assert time.monotonic() - started < 8
    assert users == {
        ROOT: [
            {"pid": 41, "name": "python3", "how": ["cwd"]},
            {"pid": 43, "name": "tail", "how": ["argv"]},
            {"pid": 44, "name": "sleep", "how": ["mapped"]},
        ]
    }
    (stuck,) = unreadable
    assert (stuck["pid"], stuck["name"], partial) == (42, "python3", False)
    assert stuck["error"].startswith(f"no answer within 2 s reading {proc}/42/maps (the process is likely stuck")


def test_the_facts_keep_the_named_processes_and_a_purge_warns_with_them():
    stuck = {"pid": 42, "name": "python3", "error": "no answer within 2 s reading /proc/42/maps (...)"}
    refused = {"pid": 43, "name": "sshd", "error": "could not read /proc/43: Permission denied"}
    facts = facts_of(answer_of(STALE, unreadable_processes=[stuck, refused]))
    assert facts["processes_unreadable"] == [stuck, refused]
    assert facts["pending"] is True  # a warning, as before: the purge goes on attended
    assert cache_verdicts.unreadable_line(LABEL, facts["processes_unreadable"]) == (
        f"{LABEL}: 2 processes could not be inspected (pid 42 (python3: no answer within 2 s reading /proc/42/maps "
        "(...)), pid 43 (sshd: could not read /proc/43: Permission denied)); the purge cannot vouch that none of "
        "them uses a cache root"
    )


@pytest.mark.parametrize(
    "forged",
    [3, [{"pid": "42", "name": "x", "error": "e"}], [{"pid": 42, "name": None, "error": "e"}], [{"pid": 42}]],
)
def test_a_forged_list_of_unreadable_processes_is_a_named_problem(forged):
    with pytest.raises(CacheError, match="not in the expected shape: unreadable_processes is "):
        facts_of(answer_of(STALE, unreadable_processes=forged))


def test_the_purge_script_reads_users_by_the_same_rule(tmp_path):
    root = tmp_path / "inductor"
    root.mkdir()
    found = cache_script.users_of([str(root)], os.getpid())
    assert found == {str(root): []}
    job = subprocess.Popen(["sleep", "60"], env={"PATH": os.environ["PATH"], "PYTHONPATH": f"{root}/pkg"})
    try:
        found = cache_script.users_of([str(root)], os.getpid())
    finally:
        job.kill()
        job.wait()
    assert found == {str(root): [{"pid": job.pid, "name": "sleep", "how": ["pythonpath"]}]}
