"""Guards that no other test would notice missing (issue 8): signal_process signals a pid only while it still names
the process that was planned (same start time); each test fails when the guard is removed."""

import dataclasses
import signal
import subprocess
import time

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import process as pp
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import ending as gpu_ending


# -- signal_process: the pid-reuse check -------------------------------------------------------------------------
@pytest.fixture
def sleeper():
    child = subprocess.Popen(["sleep", "30"])
    yield child
    if child.poll() is None:
        child.kill()
    child.wait(timeout=5)


def test_a_pid_now_naming_another_process_is_never_signalled(sleeper):
    planned = pp.read_process(sleeper.pid)
    # What the step planned was another process that had this pid: it started at another time.
    reused = dataclasses.replace(planned, start_time=planned.start_time - 1)
    gpu_ending.signal_process(reused, signal.SIGKILL)
    time.sleep(0.2)
    assert sleeper.poll() is None, "a process that only shares the pid was killed"
    assert pp.still_there(planned)


def test_the_planned_process_itself_is_signalled(sleeper):
    gpu_ending.signal_process(pp.read_process(sleeper.pid), signal.SIGTERM)
    assert sleeper.wait(timeout=5) == -signal.SIGTERM


def test_a_pid_that_is_gone_is_not_signalled_and_raises_nothing(sleeper, monkeypatch):
    planned = pp.read_process(sleeper.pid)
    sleeper.kill()
    sleeper.wait(timeout=5)
    sent = []
    monkeypatch.setattr(gpu_ending.os, "kill", lambda pid, signum: sent.append((pid, signum)))
    gpu_ending.signal_process(planned, signal.SIGKILL)  # no ProcessLookupError
    assert sent == []  # nothing is sent to a pid that no longer names the planned process
