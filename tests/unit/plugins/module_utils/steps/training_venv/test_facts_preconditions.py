"""Preconditions (issue 21, item 3) of the training_venv step: what it needs to do its work (the venv's builder and the
lock's python) is checked by the fact pass, so a run that cannot finish fails before any step changes anything, in
--check as in the real run."""

import os
import sys

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import venv as ct_venv
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import facts as venv_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import probe as venv_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import script as venv_script
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.lock import VenvError

from tests.fakes import run_probes_program
from tests.unit.plugins.module_utils.steps.training_venv import test_facts as venv

LABEL = "CT 200 on pve1"
CT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# -- training_venv: the pure rule ------------------------------------------------------------------------------
def build(**changed):
    """What the probe answers for a CT with uv and python3.11 (venv and ensurepip in its library)."""
    found = {
        "path": CT_PATH,
        "uv": "/usr/local/bin/uv",
        "uv_missing": None,
        "python": "python3.11",
        "base_python": "/usr/bin/python3.11",
        "venv": True,
        "ensurepip": True,
        "uv_python": "/usr/bin/python3.11",
        "own": "3.11",
    }
    found.update(changed)
    return found


NO_UV = {"uv": None, "uv_missing": f"uv is not on PATH ({CT_PATH})"}


def venv_step(answer, **spec):
    return venv_facts.evaluate_step(dict(venv.SPEC, **spec), answer, {}, venv.CONTEXT)


def test_a_target_with_uv_or_with_python3_venv_can_build_the_venv():
    for found in (build(), build(**NO_UV), build(**NO_UV, uv_python=None), build(uv_wheel=None)):
        facts = venv_step(dict(venv.ABSENT, build=found))
        assert (facts["problems"], facts["pending"], facts["rebuild"]) == ([], True, True)


def test_no_uv_and_no_ensurepip_is_a_problem_before_anything_changes():
    facts = venv_step(dict(venv.ABSENT, build=build(**NO_UV, ensurepip=False)))
    assert facts["problems"] == [
        f"{LABEL}: the venv at /opt/venvs/train needs a rebuild but the target cannot build it: no uv (uv is not on "
        f"PATH ({CT_PATH})) and `python3.11 -m venv` fails there, since /usr/bin/python3.11 has no ensurepip module; "
        "install it (apt install python3.11-venv), or install uv there (training_venv_uv: its path), or set "
        "training_venv_uv_wheel to PyPI's uv wheel on the controller"
    ]
    # What a run would change is still said; nothing is pending, nothing rebuilt.
    assert facts["changes"] == ["create venv at /opt/venvs/train (python 3.11, 26 distributions from the lock)"]
    assert (facts["pending"], facts["rebuild"]) == (False, False)


def test_a_library_without_venv_either_names_both():
    facts = venv_step(dict(venv.ABSENT, build=build(**NO_UV, venv=False, ensurepip=False)))
    assert "has no venv and no ensurepip module" in facts["problems"][0]


def test_the_uv_wheel_the_role_installs_is_a_builder():
    facts = venv_step(dict(venv.ABSENT, build=build(**NO_UV, ensurepip=False)), uv_wheel="/ctl/uv-0.9.0.whl")
    assert (facts["problems"], facts["pending"]) == ([], True)


def test_no_python_of_the_locks_minor_is_a_problem_with_uv_and_without():
    with_uv = venv_step(dict(venv.ABSENT, build=build(uv_python=None, base_python=None, own="3.9")))
    assert with_uv["problems"] == [
        f"{LABEL}: the venv at /opt/venvs/train needs a rebuild with python3.11, but uv (/usr/local/bin/uv) finds "
        f"none in the target (no python3.11 on PATH {CT_PATH}, no python3 or python of 3.11, none uv installed "
        "itself; uv downloads none during recovery): install python3.11 there, or compile the lock for a python the "
        "target has (its python3 is 3.9) and set training_venv_python_version to it"
    ]
    wheel = venv_step(dict(venv.ABSENT, build=build(**NO_UV, uv_python=None, base_python=None)), uv_wheel="/w.whl")
    assert "but the uv of training_venv_uv_wheel finds none in the target" in wheel["problems"][0]
    without = venv_step(dict(venv.ABSENT, build=build(**NO_UV, uv_python=None, base_python=None, own="3.9")))
    assert without["problems"] == [
        f"{LABEL}: the venv at /opt/venvs/train needs a rebuild but the target cannot build it: no uv (uv is not on "
        f"PATH ({CT_PATH})) and no python3.11 on PATH; install python3.11 there with its venv module (apt install "
        "python3.11 python3.11-venv), or compile the lock for a python the target has (its python3 is 3.9) and set "
        "training_venv_python_version to it"
    ]


def test_a_library_that_was_not_found_is_not_held_against_the_target():
    facts = venv_step(dict(venv.ABSENT, build=build(**NO_UV, venv=None, ensurepip=None)))
    assert (facts["problems"], facts["pending"]) == ([], True)


def test_nothing_to_build_needs_no_builder():
    nothing = build(**NO_UV, base_python=None, uv_python=None)
    assert venv_step(dict(venv.IN_SPEC, build=nothing))["problems"] == []
    # Old versions beyond keep are removed without a build: no builder needed either.
    versions = [f"{venv.PATH}.2026120{day}T101500Z" for day in range(1, 4)]
    pruning = dict(venv.IN_SPEC, build=nothing, versions=versions, real_path=versions[-1])
    facts = venv_step(pruning, keep=1)
    assert (facts["problems"], facts["pending"], facts["rebuild"]) == ([], True, False)
    assert len(facts["prune"]) == 2


def test_an_unattended_rebuild_left_for_a_window_needs_no_builder():
    nothing = build(**NO_UV, base_python=None, uv_python=None)
    user = {"pid": 516, "ns_pid": 41, "name": "python3", "command": "python3 train.py", "how": "exe", "file": "x"}
    answer = dict(venv.POLLUTED, build=nothing)
    facts = venv_facts.evaluate_step(dict(venv.SPEC, unattended=True), answer, {"users": [user]}, venv.CONTEXT)
    assert (facts["problems"], facts["pending"], len(facts["needs_window"])) == ([], False, 1)


def test_an_answer_without_build_is_not_judged_and_one_of_another_shape_is_refused():
    assert venv_step(venv.ABSENT)["pending"] is True  # an older probe's answer
    for wrong in ("uv", {"uv": 1}, build(venv="yes"), build(own=None)):
        with pytest.raises(VenvError, match="answered a build that is not what a build would use"):
            venv_step(dict(venv.ABSENT, build=wrong))


def test_what_the_target_chose_is_escaped_in_the_sentence():
    found = build(**NO_UV, ensurepip=False, base_python="/usr/bin/python3.11\nCT 201: all good")
    assert "/usr/bin/python3.11\\nCT 201: all good has no" in venv_step(dict(venv.ABSENT, build=found))["problems"][0]


def test_the_payload_asks_for_the_uv_setting_and_the_locks_python():
    assert venv_facts.probe_payload(dict(venv.SPEC, uv="/root/.local/bin/uv"), 30) == {
        "path": "/opt/venvs/train",
        "timeout": 30,
        "uv": "/root/.local/bin/uv",
        "python": "3.11",
    }
    assert venv_facts.probe_payload(dict(venv.SPEC, lock="six==1.17.0\n"), 30)["python"] is None


# -- training_venv: the probe against real files ----------------------------------------------------------------
def executable(path, text="#!/bin/sh\nexit 0\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def fake_python(prefix, minor="3.11", *, ensurepip=True):
    """``<prefix>/bin/python<minor>`` with a standard library of its own in ``<prefix>/lib/python<minor>``: never run,
    only looked at (the probe reads files)."""
    library = prefix / "lib" / f"python{minor}"
    (library / "venv").mkdir(parents=True)
    (library / "os.py").write_text("")
    (library / "venv" / "__init__.py").write_text("")
    if ensurepip:
        (library / "ensurepip").mkdir()
        (library / "ensurepip" / "__init__.py").write_text("")
    return executable(prefix / "bin" / f"python{minor}")


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """No uv-installed python of this machine's root counts."""
    monkeypatch.setenv("UV_PYTHON_INSTALL_DIR", str(tmp_path / "uv-pythons"))
    return tmp_path


def read_build(path, uv="uv", python="3.11"):
    return venv_probe.probe({"path": str(path / "venv"), "timeout": 10, "uv": uv, "python": python})["build"]


def test_the_probe_finds_no_uv_and_a_python_without_ensurepip(isolated, monkeypatch):
    python = fake_python(isolated / "usr", ensurepip=False)
    monkeypatch.setenv("PATH", str(python.parent))
    found = read_build(isolated)
    assert found == {
        "path": str(python.parent),
        "uv": None,
        "uv_missing": f"uv is not on PATH ({python.parent})",
        "python": "python3.11",
        "base_python": str(python),
        "venv": True,
        "ensurepip": False,
        "uv_python": str(python),
        "own": f"{sys.version_info[0]}.{sys.version_info[1]}",
    }
    facts = venv_step(dict(venv.ABSENT, build=found))
    assert "`python3.11 -m venv` fails there, since" in facts["problems"][0]
    assert facts["pending"] is False


def test_the_probe_finds_uv_on_path_or_by_its_path(isolated, monkeypatch):
    python = fake_python(isolated / "usr", ensurepip=False)
    uv = executable(isolated / "tools" / "uv")
    monkeypatch.setenv("PATH", f"{uv.parent}:{python.parent}")
    assert (read_build(isolated)["uv"], read_build(isolated)["uv_missing"]) == (str(uv), None)
    monkeypatch.setenv("PATH", str(python.parent))
    assert read_build(isolated, uv=str(uv))["uv"] == str(uv)
    uv.chmod(0o644)
    assert read_build(isolated, uv=str(uv))["uv_missing"] == f"{uv} is not an executable file"


def test_uv_finds_a_python3_of_the_minor_or_one_it_installed(isolated, monkeypatch):
    python = fake_python(isolated / "opt" / "py311")
    alias = isolated / "bin" / "python3"
    alias.parent.mkdir()
    alias.symlink_to(python)  # python3 -> .../python3.11: its minor is in the name it resolves to
    monkeypatch.setenv("PATH", str(alias.parent))
    found = read_build(isolated)
    assert (found["uv_python"], found["base_python"]) == (str(alias), None)  # -m venv wants python3.11 itself
    assert read_build(isolated, python="3.12")["uv_python"] is None
    managed = isolated / "uv-pythons" / "cpython-3.12.4-linux-x86_64-gnu"
    managed.mkdir(parents=True)
    assert read_build(isolated, python="3.12")["uv_python"] == str(managed)
    assert read_build(isolated, python=None)["uv_python"] == str(alias)


def test_the_probes_own_interpreter_is_read_from_its_own_library(isolated, monkeypatch):
    here = isolated / "bin"
    here.mkdir()
    minor = f"{sys.version_info[0]}.{sys.version_info[1]}"
    (here / f"python{minor}").symlink_to(os.path.realpath(sys.executable))
    monkeypatch.setenv("PATH", str(here))
    found = read_build(isolated, python=minor)
    assert found["venv"] is True
    assert found["ensurepip"] is os.path.isfile(os.path.join(os.path.dirname(os.__file__), "ensurepip", "__init__.py"))


def test_the_build_script_chooses_the_builder_the_probe_found(isolated, monkeypatch):
    python = fake_python(isolated / "usr")
    monkeypatch.setenv("PATH", str(python.parent))
    payload = {"path": str(isolated / "venv"), "stamp": "20261203T101500Z", "lock": "", "expected": {}}
    found = read_build(isolated)
    assert venv_script.Build(payload).builder() == ("venv+pip", found["uv_missing"])
    assert venv_script.Build(dict(payload, python="3.11")).base_python() == found["base_python"]
    uv = executable(isolated / "tools" / "uv")
    monkeypatch.setenv("PATH", f"{uv.parent}:{python.parent}")
    assert venv_script.Build(payload).builder() == ("uv", read_build(isolated)["uv"])
    assert ct_venv in venv_script.SHARED  # one piece of code, shipped with both


def test_the_probe_reads_it_in_the_ct_as_the_fact_pass_ships_it(isolated):
    python = fake_python(isolated / "usr", ensurepip=False)
    payload = {"path": str(isolated / "venv"), "timeout": 10, "uv": "uv", "python": "3.11"}
    env = ["env", "-i", f"PATH={python.parent}", f"UV_PYTHON_INSTALL_DIR={isolated / 'none'}"]
    done = run_probes_program(sys.executable, {"training_venv": (venv_probe, payload)}, prefix=env)
    found = done["training_venv"]["answer"]["build"]
    assert (found["uv"], found["base_python"], found["ensurepip"]) == (None, str(python), False)
