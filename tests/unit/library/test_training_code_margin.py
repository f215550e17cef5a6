"""A backup keeps a real margin on its file system (issue 40, item 8): the fact pass measures the backup directory's
own file system (its nearest existing directory) and estimates the backup from what would be saved; a reset that
would leave less than training_code_backup_min_free_mib is a problem of the fact pass, in --check too, before
anything changes; the reset script checks again before it writes. A real tmpfs of a few MiB as the backup's file
system (root only); the probe part and the reset script run in-process.
"""

import os
import subprocess

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import facts as code_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import script

from tests.unit.library.test_training_code import lab, snapshot  # noqa: F401 (the fixture)
from tests.unit.plugins.module_utils.steps.training_code.test_facts import CONTEXT, LABEL, OTHER, SPEC, answer

MIB = 1 << 20


@pytest.fixture
def small_fs(lab):  # noqa: F811
    """An 8 MiB tmpfs mounted where the Lab's backups go (its directory does not exist yet: the nearest one is)."""
    if os.geteuid() != 0:
        pytest.skip("mounts a tmpfs: needs root")
    mount = lab.root / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], check=False)
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    lab.backups = mount / "backups" / "training_code"
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_reset_that_would_leave_less_than_the_margin_is_a_problem_in_check_mode_and_a_real_run(lab, small_fs, capsys):  # noqa: F811
    lab.dirty()
    before = snapshot(lab.repo)
    for check_mode in (True, False):
        result = lab.run(capsys, check_mode=check_mode)
        assert (result.get("failed"), result.get("error")) == (True, "problems"), result
        assert f"whose file system ({small_fs}) has 8 MiB free" in result["msg"], result["msg"]
        assert "training_code_backup_min_free_mib (1024 MiB)" in result["msg"], result["msg"]
        assert snapshot(lab.repo) == before and not lab.backups.exists()
    # With a margin the file system has room for, the reset saves and resets.
    result = lab.run(capsys, backup_min_free_mib=4)
    assert (result["changed"], result["head"]) == (True, lab.pinned), result.get("msg")


def test_the_reset_script_checks_the_margin_again_before_it_writes(lab, small_fs):  # noqa: F811
    lab.dirty()
    before = snapshot(lab.repo)
    payload = {
        "path": str(lab.repo),
        "commit": lab.pinned,
        "backup_dir": str(lab.backups),
        "stamp": "20261203T101500Z",
        "timeout": 60,
        "min_free": 6 * MIB,
    }
    (small_fs / "filler").write_bytes(b"\0" * (3 * MIB))  # filled since the fact pass
    done = script.probe(payload)
    assert (done["error"], done["touched"]) == ("no_space", False), done
    assert "would leave less than 6 MiB" in done["message"], done["message"]
    assert snapshot(lab.repo) == before and not (lab.backups.exists() and any(lab.backups.iterdir()))


def test_the_fact_pass_judges_the_measured_space_against_the_margin():
    dirty = {"head": OTHER, "status": " M model.py\0"}
    space = {"dir": "/var", "free": 1500 * MIB, "estimate": 600 * MIB}
    facts = code_facts.evaluate_step(SPEC, answer(**dirty, backup_space=space), {}, CONTEXT)
    assert facts["problems"] == [
        f"{LABEL}: saving the local changes of /srv/train needs about 600 MiB in "
        "/var/backups/pve-gpu-recover/training_code, whose file system (/var) has 1500 MiB free: the reset would "
        "leave less than training_code_backup_min_free_mib (1024 MiB); free space there, or set "
        "training_code_backup_dir to a file system with room; nothing was changed"
    ]
    assert not facts["pending"]
    roomy = dict(space, free=2000 * MIB)
    assert code_facts.evaluate_step(SPEC, answer(**dirty, backup_space=roomy), {}, CONTEXT)["pending"]
    assert code_facts.evaluate_step(
        dict(SPEC, backup_min_free_mib=0), answer(**dirty, backup_space=space), {}, CONTEXT
    )["pending"]
