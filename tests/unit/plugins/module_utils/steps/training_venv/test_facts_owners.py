"""Issue 25 (trust), review D: a venv another user could change never has its python run as root.

verify runs ``<venv>/bin/python -I -B`` as root and the build checks a new version with it; ``-I`` still runs the
venv's ``.pth`` files, and a user who can write the venv's parent can rename their own tree into its place. The
probe parts of training_venv and verify read the venv's path from ``/`` (lstat, real directories in tmp_path
chowned to uid 65534 and chmod 0777 here) and the node makes what they find a problem: the step fails before
anything changes, and verify is not pending, so its python never runs.
"""

import inspect
import os

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import venv as ct_venv
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import facts as venv_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import probe as venv_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import facts as verify_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import probe as verify_probe

from tests.unit.plugins.module_utils.steps.training_venv.test_facts import CONTEXT, SPEC
from tests.unit.plugins.module_utils.steps.verify.test_facts import context, make_venv_dir

NOBODY = 65534
STAMP = "20261203T101500Z"


def unsafe(venv):
    """What both probe parts say of ``venv``: they must say the same."""
    said = venv_probe.probe({"path": str(venv), "timeout": 30})["unsafe"]
    assert verify_probe.probe({"venv": str(venv)})["unsafe"] == said
    return said


def parent_of(tmp_path, mode=0o755, uid=0):
    parent = tmp_path / "venvs"
    parent.mkdir()
    os.chown(parent, uid, 0)
    parent.chmod(mode)
    return parent


def test_both_probe_parts_ship_the_one_venv_safety_module():
    # One source (plugins/module_utils/ct/venv.py) shipped with each part in the same pct exec, not a copy in each.
    assert ct_venv in venv_probe.SHARED  # with ct_git: the lock of lock_from_repo is read through it
    assert (ct_venv,) == verify_probe.SHARED
    assert "def venv_unsafe" not in inspect.getsource(verify_probe)
    assert "def venv_unsafe" not in inspect.getsource(venv_probe)


def test_a_venv_of_roots_under_directories_of_roots_is_safe_built_or_linked_or_not_yet_there(tmp_path):
    parent = parent_of(tmp_path)
    assert unsafe(make_venv_dir(parent / "plain")) is None
    make_venv_dir(parent / f"train.{STAMP}")
    (parent / "train").symlink_to(f"train.{STAMP}")  # the step's own link to a version beside it
    assert unsafe(parent / "train") is None
    assert unsafe(parent / "absent") is None  # root creates it
    assert unsafe(tmp_path / "no" / "such" / "dirs") is None


@pytest.mark.parametrize(
    ("mode", "uid", "why"),
    [
        (0o777, 0, "may be written by every user (mode 0777)"),
        (0o775, 0, "may be written by group 0 (mode 0775)"),
        (0o755, NOBODY, f"is owned by uid {NOBODY}, not root"),
    ],
)
def test_a_venv_under_a_directory_others_can_write_is_refused_even_before_it_exists(tmp_path, mode, uid, why):
    parent = parent_of(tmp_path, mode, uid)
    assert unsafe(make_venv_dir(parent / "train")) == f"{parent} {why}"
    assert unsafe(parent / "absent") == f"{parent} {why}"


def test_a_sticky_parent_is_accepted_only_for_an_entry_of_roots(tmp_path):
    parent = parent_of(tmp_path, 0o1777)
    assert unsafe(make_venv_dir(parent / f"train.{STAMP}")) is None
    link = parent / "train"
    link.symlink_to(f"train.{STAMP}")
    assert unsafe(link) is None
    os.lchown(link, NOBODY, NOBODY)  # their link in a sticky directory: theirs to replace
    assert unsafe(link) == f"{link} is owned by uid {NOBODY}, not root"
    os.lchown(link, 0, 0)
    os.chown(parent / f"train.{STAMP}", NOBODY, NOBODY)
    assert unsafe(link) == f"{parent / f'train.{STAMP}'} is owned by uid {NOBODY}, not root"


def test_links_other_than_the_steps_own_and_a_tree_others_can_write_are_refused(tmp_path):
    parent = parent_of(tmp_path)
    theirs = make_venv_dir(tmp_path / "theirs")
    (parent / "train").symlink_to(theirs)
    assert (
        unsafe(parent / "train")
        == f"{parent / 'train'} is a symlink to {theirs}, not to a version train.<stamp> beside it"
    )
    above = tmp_path / "above"
    above.symlink_to(parent)
    assert (
        unsafe(above / "plain") == f"{above} is a symlink (to {parent}): a venv's path must be real directories from /"
    )
    venv = make_venv_dir(parent / "plain")
    site = venv / "lib" / "python3.11" / "site-packages"
    site.chmod(0o777)  # anyone could drop a .pth that -I still runs
    assert unsafe(venv) == f"{site} may be written by every user (mode 0777)"
    site.chmod(0o755)
    os.chown(venv / "pyvenv.cfg", NOBODY, NOBODY)
    assert unsafe(venv) == f"{venv / 'pyvenv.cfg'} is owned by uid {NOBODY}, not root"
    os.chown(venv / "pyvenv.cfg", 0, 0)
    os.chown(venv, NOBODY, NOBODY)
    assert unsafe(venv) == f"{venv} is owned by uid {NOBODY}, not root"


def test_the_training_venv_step_fails_before_anything_changes(tmp_path):
    parent = parent_of(tmp_path, 0o777)
    venv = make_venv_dir(parent / "train")
    answer = venv_probe.probe({"path": str(venv), "timeout": 30})
    facts = venv_facts.evaluate_step(dict(SPEC, path=str(venv)), answer, {}, CONTEXT)
    assert facts["pending"] is False
    assert facts["problems"][-1] == (
        f"CT 200 on pve1: the venv {venv} could be changed by a user other than root: {parent} may be written by "
        "every user (mode 0777); its python runs as root, so nothing is built, swapped or run there: make every "
        "directory from / to it root's and not writable by a group or other users (chown root:root, chmod go-w), "
        "or set training_venv_path to such a place"
    )


def test_verify_never_runs_that_venvs_python(tmp_path):
    parent = parent_of(tmp_path, 0o777)
    venv = make_venv_dir(parent / "train")
    answer = verify_probe.probe({"venv": str(venv)})
    spec = dict(verify_facts.SPEC_DEFAULTS, venv=str(venv), import_torch="always")
    facts = verify_facts.evaluate_step(spec, answer, {}, context())
    assert facts["pending"] is False  # the verify module, which runs <venv>/bin/python -I -B, is not run
    assert facts["problems"][0].startswith(
        f"CT 200 on pve1: the venv '{venv}' could be changed by a user other than root: '{parent} may be written "
        "by every user (mode 0777)'; verify does not run its python as root"
    )
    (tmp_path / "ok").mkdir()
    safe = make_venv_dir(parent_of(tmp_path / "ok") / "train")
    spec = dict(spec, venv=str(safe))
    facts = verify_facts.evaluate_step(spec, verify_probe.probe({"venv": str(safe)}), {}, context())
    assert facts["pending"] is True
