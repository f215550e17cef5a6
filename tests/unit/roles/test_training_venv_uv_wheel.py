"""Issue 41: the role copies the uv wheel to the node only when a rebuild is due and the fact pass did not find the
wheel's uv in the target; without a fact pass (its facts absent) it copies as before.

ansible-playbook on localhost runs the collection's real training_venv role in check mode after stand-in facts
(tests/unit/roles/test_step_progress_cost.py's project); the copy task's own status says whether it ran.
"""

import json
import os
import subprocess
import sys
import zipfile

import pytest

from tests.unit.roles.test_step_progress_cost import make_project

COPY = (
    "pve_gpu.recover.training_venv : Put the uv wheel on the node (only when a rebuild is due and the target lacks "
    "its uv)"
)


def copy_status(tmp_path, facts):
    wheel = tmp_path / "uv-0.13.9-py3-none-manylinux_2_17_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("uv-0.13.9.data/scripts/uv", b"#!/bin/sh\n")
    play, inventory, env = make_project(tmp_path, facts, training_venv_uv_wheel=str(wheel), compile_cache_enabled=False)
    playbook = os.path.join(os.path.dirname(sys.executable), "ansible-playbook")
    done = subprocess.run(
        [playbook, "--check", "-i", str(inventory), str(play)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
        env=env,
    )
    assert (tmp_path / "count.json").exists(), done.stdout + done.stderr
    tasks = json.loads((tmp_path / "count.json").read_text())
    statuses = {t["task"]: t["status"] for t in tasks if t["action"] == "ansible.builtin.copy"}
    assert list(statuses) == [COPY], tasks
    return statuses[COPY]


@pytest.mark.parametrize(
    ("facts", "status"),
    [
        ({"training_venv": {"pending": True, "rebuild": True, "uv_installed": True}}, "skipped"),
        ({"training_venv": {"pending": True, "rebuild": True, "uv_installed": False}}, "ok"),
        ({"training_venv": {"pending": True, "rebuild": False, "uv_installed": False}}, "skipped"),  # pruning only
        ({}, "ok"),  # no fact pass: the module decides, the wheel must be there
    ],
    ids=["found", "missing", "prune-only", "no-fact-pass"],
)
def test_the_wheel_is_copied_only_when_a_rebuild_needs_its_uv(tmp_path, facts, status):
    assert copy_status(tmp_path, facts) == status
