"""Guards that no other test would notice missing (issue 8): each test here fails when its guard is removed.

* signal_process signals a pid only while it still names the process that was planned (same start time);
* a lock holds until exactly created + ttl and is stale one second later;
* exactly min_free_gib free is enough for a new venv, one byte less is not.
"""

import dataclasses
import signal
import subprocess
import time

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_lock
from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_process as pp
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes import ending as gpu_ending
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.preflight import facts as preflight_facts


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


def test_a_pid_that_is_gone_is_not_signalled_and_raises_nothing(sleeper):
    planned = pp.read_process(sleeper.pid)
    sleeper.kill()
    sleeper.wait(timeout=5)
    gpu_ending.signal_process(planned, signal.SIGKILL)  # no ProcessLookupError, no other process hit


# -- the lock's ttl boundary ---------------------------------------------------------------------------------------
OTHER = {"run_id": "other", "owner": "bob@ctl", "created": 1000, "ttl": 60}


def test_a_lock_holds_until_exactly_created_plus_ttl():
    assert pve_lock.stale_reason(OTHER, 1060, 7200) is None
    assert pve_lock.plan_lock("present", OTHER, "mine", 1060) == ("locked", False)


def test_a_lock_one_second_after_created_plus_ttl_is_taken_over():
    assert pve_lock.stale_reason(OTHER, 1061, 7200) == "it expired 1 s ago (ttl 60 s)"
    assert pve_lock.plan_lock("present", OTHER, "mine", 1061) == ("taken_over", True)


def test_a_lock_without_ttl_uses_the_finding_runs_ttl_to_the_second():
    lock = {"run_id": "other", "owner": "bob@ctl", "created": 1000}
    assert pve_lock.plan_lock("present", lock, "mine", 1000 + 7200, 7200) == ("locked", False)
    assert pve_lock.plan_lock("present", lock, "mine", 1000 + 7201, 7200) == ("taken_over", True)


# -- the disk-space boundary ---------------------------------------------------------------------------------------
def disk_check(free_bytes, min_free_gib=20):
    facts = {
        "devices": [{"path": path, "char": True} for path in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm")],
        "nvidia_smi_failure": None,
        "nvml_library_versions": ["580.159.04"],
        "target_driver_version": "580.159.04",
        "gpu_uuids": [],
        "space": {"free_bytes": free_bytes, "existing": "/opt"},
    }
    checks = preflight_facts.evaluate(
        "CT 200 on pve1",
        "pve1",
        facts,
        container=True,
        node_driver_version="580.159.04",
        min_free_gib=min_free_gib,
        expected_gpu_count=1,
        space_path="/opt/venvs",
    )
    return next(c for c in checks if c["name"] == "disk")


def test_exactly_min_free_gib_is_enough():
    check = disk_check(20 * preflight_facts.GIB)
    assert check["ok"] is True
    assert check["detail"].endswith("enough for a new venv")


def test_one_byte_less_than_min_free_gib_is_not():
    check = disk_check(20 * preflight_facts.GIB - 1)
    assert check["ok"] is False
    assert check["detail"].endswith("a new venv needs 20 GiB: free space there or lower preflight_min_free_gib")


def test_a_fractional_minimum_has_the_same_boundary():
    assert disk_check(int(2.5 * preflight_facts.GIB), min_free_gib=2.5)["ok"] is True
    assert disk_check(int(2.5 * preflight_facts.GIB) - 1, min_free_gib=2.5)["ok"] is False
