"""Issue 41: the uv of the role's wheel, already in the target, is told by the fact pass (the venv step's probe part,
in the one ``pct exec`` it already runs), so a warm rebuild neither copies the wheel to the node nor pipes its 38 MB
binary into the target again.

The version is the wheel's file name's (PyPI's ``uv-<version>-py3-none-<platform>.whl``): nothing is opened to
know it. The probe reads ``UV_HOME/uv-<version>/uv`` and the directories above it from ``/`` with lstat alone
(real files in tmp_path, chowned to uid 65534 here): root runs that file, so it counts as installed only when no
other user could have put it there or changed it.
"""

import inspect
import os
import sys

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import venv as ct_venv
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import facts as venv_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import probe as venv_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.lock import VenvError

from tests.fakes import run_probes_program
from tests.unit.plugins.module_utils.steps.training_venv.test_facts import ABSENT, CONTEXT, IN_SPEC, SPEC

NOBODY = 65534
WHEEL = "uv-0.13.9-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"
INSTALLED = {"installed": True, "unsafe": None}
MISSING = {"installed": False, "unsafe": None}


def uv_file(home, mode=0o755, uid=0, text="#!/bin/sh\necho uv 0.13.9\n"):
    """``home/uv-0.13.9/uv``, a real file of ``uid``'s with ``mode``, its directories root's 0755."""
    path = home / "uv-0.13.9" / "uv"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    os.chown(path, uid, 0)
    path.chmod(mode)
    return path


def wheel_uv(path):
    """What the venv step's probe part answers of the wheel's uv at ``path`` (the venv itself is absent)."""
    answer = venv_probe.probe({"path": "/nonexistent/venv", "timeout": 30, "wheel_uv": str(path)})
    return answer["wheel_uv"]


# -- the version, from the file name alone ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("wheel", "path"),
    [
        (f"/ctl/files/{WHEEL}", "/usr/local/lib/pve-gpu-recover/uv-0.13.9/uv"),
        (
            "uv-0.9.5-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
            "/usr/local/lib/pve-gpu-recover/uv-0.9.5/uv",
        ),
        ("/w/uv-0.10.0rc1-py3-none-musllinux_1_1_aarch64.whl", "/usr/local/lib/pve-gpu-recover/uv-0.10.0rc1/uv"),
        (
            "/w/uv-0.13.9-1-py3-none-manylinux_2_28_x86_64.whl",
            "/usr/local/lib/pve-gpu-recover/uv-0.13.9/uv",
        ),  # build tag
        ("/w/uv.whl", None),
        ("/w/uv-latest.whl", None),
        ("/w/uv-0.13.9.whl", None),
        ("/w/ruff-0.13.9-py3-none-manylinux_2_17_x86_64.whl", None),
        ("/w/uv-0.13.9-cp311-cp311-manylinux_2_17_x86_64.whl", None),
        (None, None),
    ],
)
def test_the_wheels_uv_path_comes_from_pypis_file_name(wheel, path):
    assert venv_facts.wheel_uv_path(wheel) == path


def test_a_wheel_not_named_as_pypi_names_it_is_refused_before_anything_is_read():
    assert venv_facts.check_spec(dict(SPEC, uv_wheel=f"/ctl/{WHEEL}")) == ""
    assert venv_facts.check_spec(dict(SPEC, uv_wheel="/ctl/files/uv.whl")) == (
        "uv_wheel is /ctl/files/uv.whl, whose name does not say its uv's version; give PyPI's uv wheel under its "
        "own file name, uv-<version>-py3-none-<platform>.whl (training_venv_uv_wheel)"
    )


def test_the_probe_is_asked_about_the_wheels_uv_only_when_a_wheel_is_given():
    assert "wheel_uv" not in venv_facts.probe_payload(SPEC)
    payload = venv_facts.probe_payload(dict(SPEC, uv_wheel=f"/ctl/files/{WHEEL}"))
    assert payload["wheel_uv"] == "/usr/local/lib/pve-gpu-recover/uv-0.13.9/uv"
    assert "wheel_uv" not in venv_probe.probe({"path": "/nonexistent/venv", "timeout": 30})


# -- the probe, on real files ------------------------------------------------------------------------------------
def test_a_root_executable_under_directories_of_roots_is_installed(tmp_path):
    assert wheel_uv(uv_file(tmp_path / "home")) == INSTALLED
    assert wheel_uv(uv_file(tmp_path / "other", mode=0o700)) == INSTALLED  # root's own execute bit: root runs it


def test_a_missing_uv_or_missing_directories_are_not_installed_and_safe(tmp_path):
    assert wheel_uv(tmp_path / "home" / "uv-0.13.9" / "uv") == MISSING
    (tmp_path / "home" / "uv-0.13.9").mkdir(parents=True)
    assert wheel_uv(tmp_path / "home" / "uv-0.13.9" / "uv") == MISSING


@pytest.mark.parametrize(
    ("mode", "uid"),
    [
        (0o644, 0),  # not executable
        (0o775, 0),  # a group may write it
        (0o757, 0),  # every user may write it
        (0o755, NOBODY),  # another owner's file: they could change what root runs
    ],
)
def test_a_file_others_could_change_or_root_cannot_run_is_not_installed(tmp_path, mode, uid):
    # Its directories are root's: root replaces it with its own (install_uv), and nobody can swap that one.
    assert wheel_uv(uv_file(tmp_path / "home", mode=mode, uid=uid)) == MISSING


def test_a_link_is_never_followed_and_a_link_above_is_unsafe(tmp_path):
    real = uv_file(tmp_path / "real")
    home = tmp_path / "home"
    (home / "uv-0.13.9").mkdir(parents=True)
    (home / "uv-0.13.9" / "uv").symlink_to(real)  # even to root's executable: not reached through a link
    assert wheel_uv(home / "uv-0.13.9" / "uv") == MISSING
    linked = tmp_path / "linked"
    linked.symlink_to(real.parent.parent)
    assert wheel_uv(linked / "uv-0.13.9" / "uv") == {
        "installed": False,
        "unsafe": f"{linked} is a symlink (to {real.parent.parent}): a path root runs from must be real directories "
        "from /",
    }


def test_a_directory_others_could_change_is_unsafe_present_or_not(tmp_path):
    path = uv_file(tmp_path / "home")
    os.chown(path.parent, NOBODY, NOBODY)  # their directory: they could put their own uv in root's place
    assert wheel_uv(path) == {"installed": False, "unsafe": f"{path.parent} is owned by uid {NOBODY}, not root"}
    os.chown(path.parent, 0, 0)
    (tmp_path / "home").chmod(0o777)
    assert wheel_uv(path) == {
        "installed": False,
        "unsafe": f"{tmp_path / 'home'} may be written by every user (mode 0777)",
    }
    path.unlink()
    assert wheel_uv(path)["unsafe"] == f"{tmp_path / 'home'} may be written by every user (mode 0777)"


def test_something_else_than_a_file_is_not_installed(tmp_path):
    path = tmp_path / "home" / "uv-0.13.9" / "uv"
    path.mkdir(parents=True)
    assert wheel_uv(path) == MISSING
    path.rmdir()
    os.mkfifo(path, 0o755)  # never opened: lstat alone
    assert wheel_uv(path) == MISSING


def test_the_check_is_the_venvs_own_rule_shipped_once_and_runs_as_shipped(tmp_path):
    assert "def trusted_executable" in inspect.getsource(ct_venv)
    assert "os.lstat" not in inspect.getsource(venv_probe)  # no second copy of the rule in the part
    path = uv_file(tmp_path / "home")
    payload = {"path": str(tmp_path / "venv"), "timeout": 30, "wheel_uv": str(path)}
    answer = run_probes_program(sys.executable, {"training_venv": (venv_probe, payload)})["training_venv"]["answer"]
    assert answer["wheel_uv"] == INSTALLED


# -- the facts ---------------------------------------------------------------------------------------------------
WHEEL_SPEC = dict(SPEC, uv_wheel=f"/ctl/files/{WHEEL}")


def test_a_due_rebuild_says_whether_the_wheels_uv_is_there():
    found = venv_facts.evaluate_step(WHEEL_SPEC, dict(ABSENT, wheel_uv=INSTALLED), {}, CONTEXT)
    assert (found["rebuild"], found["uv_installed"], found["problems"]) == (True, True, [])
    missing = venv_facts.evaluate_step(WHEEL_SPEC, dict(ABSENT, wheel_uv=MISSING), {}, CONTEXT)
    assert (missing["rebuild"], missing["uv_installed"], missing["pending"]) == (True, False, True)


def test_no_rebuild_or_no_wheel_installs_nothing_whatever_the_probe_found():
    converged = venv_facts.evaluate_step(WHEEL_SPEC, dict(IN_SPEC, wheel_uv=INSTALLED), {}, CONTEXT)
    assert (converged["rebuild"], converged["uv_installed"], converged["pending"]) == (False, False, False)
    no_wheel = venv_facts.evaluate_step(SPEC, ABSENT, {}, CONTEXT)
    assert (no_wheel["rebuild"], no_wheel["uv_installed"]) == (True, False)


def test_a_wheels_uv_place_others_could_change_stops_a_due_rebuild_before_anything_changes():
    unsafe = {
        "installed": False,
        "unsafe": f"/usr/local/lib/pve-gpu-recover/uv-0.13.9 is owned by uid {NOBODY}, not root",
    }
    facts = venv_facts.evaluate_step(WHEEL_SPEC, dict(ABSENT, wheel_uv=unsafe), {}, CONTEXT)
    assert (facts["rebuild"], facts["pending"], facts["uv_installed"]) == (False, False, False)
    assert facts["problems"] == [
        "CT 200 on pve1: the uv of training_venv_uv_wheel would be put and run as root at "
        "/usr/local/lib/pve-gpu-recover/uv-0.13.9/uv, but a user other than root could change it: "
        f"/usr/local/lib/pve-gpu-recover/uv-0.13.9 is owned by uid {NOBODY}, not root; so nothing is built: make "
        "every directory from / to it root's and not writable by a group or other users (chown root:root, chmod "
        "go-w), or remove what another user put there"
    ]
    # In spec, that uv is never run: no problem of the venv step's.
    assert venv_facts.evaluate_step(WHEEL_SPEC, dict(IN_SPEC, wheel_uv=unsafe), {}, CONTEXT)["problems"] == []


@pytest.mark.parametrize(
    "found",
    [
        "installed",
        {"installed": "yes", "unsafe": None},
        {"installed": False, "unsafe": 7},
        {"unsafe": None},
    ],
)
def test_an_answer_about_the_wheels_uv_of_the_wrong_shape_is_a_clear_error(found):
    with pytest.raises(VenvError, match="the training_venv probe answered a 'wheel_uv' of the wrong shape") as raised:
        venv_facts.evaluate_step(WHEEL_SPEC, dict(ABSENT, wheel_uv=found), {}, CONTEXT)
    assert raised.value.kind == "probe"
