"""The venv build's last look before its swap, and its retention, read who uses a venv version in the target by the
one rule (ct_proc.scan, issue 42): its maps were read without a deadline, so a job stuck in the driver hung the
build's pct exec until its timeout (issue 40). A FIFO in a fake /proc plays that job's maps."""

import os
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import layout as venv_layout

from tests.unit.plugins.module_utils.ct.test_proc import fake
from tests.unit.plugins.module_utils.steps.compile_cache.test_probe_users import within

OLD = "/opt/venvs/train.20261203T091500Z"
LINK = "/opt/venvs/train"


def test_a_job_stuck_on_its_maps_counts_for_every_version_and_never_hangs_the_look(tmp_path):
    proc = tmp_path / "proc"
    fake(proc, 41, argv=[f"{LINK}/bin/python", "train.py"], cwd="/srv/train")  # started through the link
    fake(proc, 42, argv=["python3", "serve.py"], cwd="/srv", maps=[f"{OLD}/lib/python3.11/site-packages/x.so"])
    fake(proc, 43, argv=["bash"], exe="/bin/bash", cwd=OLD)  # a shell cd'd into it
    fake(proc, 44, argv=["python3", "stuck.py"])
    fake(proc, 45, argv=["python3", "other.py"], environ=b"PYTHONPATH=/opt/venvs/train.OTHER/lib\0")
    (proc / "44" / "maps").unlink()
    os.mkfifo(proc / "44" / "maps")
    held = [os.open(proc / "44" / "maps", os.O_RDWR)]  # a writer that never writes: a read waits for ever

    def unblock():
        os.close(held.pop())

    started = time.monotonic()
    try:
        swap = within(20, lambda: venv_layout.processes_using([OLD, LINK], proc=str(proc)), unblock)
        removal = within(20, lambda: venv_layout.processes_using([OLD], proc=str(proc), cwd=True), unblock)
    finally:
        if held:
            unblock()
    assert time.monotonic() - started < 16
    # The swap: the job started by the link's path and the one mapping a file of the version; the shell in it does
    # not stop a swap (the directory stays); the stuck one counts for both names: nobody can vouch for it.
    assert swap == {OLD: [42, 44], LINK: [41, 44]}
    # A removal: the shell in it counts too.
    assert removal == {OLD: [42, 43, 44]}
