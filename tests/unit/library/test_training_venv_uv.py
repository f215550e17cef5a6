"""Issue 41: a rebuild with the role's uv wheel reads the wheel and pipes its uv into the target only when the
module's own read did not find that uv there.

The module replayed on a CT through FakeRunner (every ``pct exec`` argv and stdin asserted, their count pinned),
and on a bare host with a real wheel and real files; the version is the wheel's file name's.
"""

import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
import training_venv
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import Target, TargetError
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import acting as venv_acting
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import facts as venv_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import probe as venv_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.lock import VenvError

from tests.fakes import FakeRunner, run_module
from tests.unit.library.test_training_venv import (
    BUILD_PAYLOAD,
    BUILT,
    CT_PARAMS,
    IN_SPEC,
    PCT,
    POLLUTED,
    READ_PAYLOAD,
    WRAPPER,
    on_pve1,  # noqa: F401 (a fixture)
    uv_wheel,
)

UV_PATH = "/usr/local/lib/pve-gpu-recover/uv-0.13.9/uv"
WHEEL_NAME = "uv-0.13.9-py3-none-manylinux_2_17_x86_64.whl"
READ = dict(READ_PAYLOAD, wheel_uv=UV_PATH)
INSTALL_SCRIPT = (
    'set -e; mkdir -p "${1%/*}"; t=$(mktemp "$1.XXXXXX"); cat > "$t"; chmod 755 "$t"; '
    'if [ -L "$1" ]; then rm -f "$1"; elif [ -d "$1" ]; then rm -f "$t"; echo "$1 is a directory" >&2; exit 1; fi; '
    'mv -f "$t" "$1"'
)
BINARY = b"\x7fELF" + b"u" * (1 << 20)  # a uv of 1 MiB stands for PyPI's 38 MB


def read_call(answer):
    out = json.dumps({"training_venv": {"answer": answer, "seconds": 0.02}})
    return [*PCT, "60", *WRAPPER, json.dumps({"training_venv": READ})], (0, out, "")


def build_call(built, reread):
    payloads = {"build": dict(BUILD_PAYLOAD, uv=UV_PATH), "training_venv": READ}
    out = json.dumps(
        {"build": {"answer": built, "seconds": 41.2}, "training_venv": {"answer": reread, "seconds": 0.02}}
    )
    return [*PCT, "1860", *WRAPPER, json.dumps(payloads)], (0, out, "")


def install_call():
    argv = [*PCT, "60", "env", "LC_ALL=C", "LANG=C", "sh", "-c", INSTALL_SCRIPT, "sh", UV_PATH]
    return argv, (0, "", "")


def params(wheel):
    return dict(CT_PARAMS, uv_wheel=str(wheel))


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_rebuild_with_the_wheels_uv_in_place_reads_no_wheel_and_pipes_nothing(tmp_path, monkeypatch, capsys):
    # The wheel on the node is not even there: the module never opens it.
    wheel = tmp_path / WHEEL_NAME
    installed = {"installed": True, "unsafe": None}
    runner = FakeRunner(read_call(dict(POLLUTED, wheel_uv=installed)), build_call(BUILT, IN_SPEC))
    result = run_module(training_venv, params(wheel), runner, monkeypatch, capsys)
    assert (result["changed"], result.get("msg")) == (True, None)
    # Two pct exec (read, build and re-read), each with the JSON of its parts on stdin: no binary.
    assert len(runner.stdin) == 2
    assert all(isinstance(stdin, str) and len(stdin) < 200_000 for stdin in runner.stdin), [
        type(s) for s in runner.stdin
    ]
    assert not wheel.exists()


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_rebuild_without_the_wheels_uv_installs_it_first_in_one_more_pct_exec(tmp_path, monkeypatch, capsys):
    wheel = uv_wheel(tmp_path, binary=BINARY)
    runner = FakeRunner(
        read_call(dict(POLLUTED, wheel_uv={"installed": False, "unsafe": None})),
        install_call(),
        build_call(BUILT, IN_SPEC),
    )
    result = run_module(training_venv, params(wheel), runner, monkeypatch, capsys)
    assert (result["changed"], result.get("msg")) == (True, None)
    assert runner.stdin[1] == BINARY


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
@pytest.mark.usefixtures("on_pve1")
def test_ct_a_wheels_uv_place_another_user_could_change_stops_before_anything(
    tmp_path, check_mode, monkeypatch, capsys
):
    unsafe = {"installed": False, "unsafe": "/usr/local/lib/pve-gpu-recover is owned by uid 1000, not root"}
    runner = FakeRunner(read_call(dict(POLLUTED, wheel_uv=unsafe)))  # the read alone: no install, no build
    wheel = uv_wheel(tmp_path)
    result = run_module(training_venv, params(wheel), runner, monkeypatch, capsys, check_mode=check_mode)
    assert (result["failed"], result["error"]) == (True, "problems")
    assert "the uv of training_venv_uv_wheel would be put and run as root" in result["msg"]
    assert "/usr/local/lib/pve-gpu-recover is owned by uid 1000, not root" in result["msg"]


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_wheel_named_for_another_uv_than_it_holds_installs_nothing(tmp_path, monkeypatch, capsys):
    renamed = tmp_path / WHEEL_NAME
    uv_wheel(tmp_path, version="0.14.0").rename(renamed)
    runner = FakeRunner(read_call(dict(POLLUTED, wheel_uv={"installed": False, "unsafe": None})))
    result = run_module(training_venv, params(renamed), runner, monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "uv_wheel")
    assert result["msg"] == (
        f"CT 200 on pve1: the uv wheel {renamed} is named for uv 0.13.9 but holds uv-0.14.0.data/scripts/uv: give "
        "PyPI's uv wheel under its own file name"
    )


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_wheel_not_named_as_pypi_names_it_fails_before_any_call(tmp_path, monkeypatch, capsys):
    result = run_module(training_venv, params(tmp_path / "uv.whl"), FakeRunner(), monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "invalid")
    assert result["msg"].startswith(f"uv_wheel is {tmp_path / 'uv.whl'}, whose name does not say its uv's version")


def test_bare_host_the_wheels_uv_is_installed_once_then_found_and_replaced_when_untrusted(tmp_path, monkeypatch):
    """Real files: the probe's rule decides, the install puts root's own file in place of a link or a file
    another user owns (never writing through the link), and the installed uv runs."""
    wheel = uv_wheel(tmp_path, binary=b"#!/bin/sh\necho uv 0.13.9\n")
    home = tmp_path / "lib"
    monkeypatch.setattr(venv_facts, "UV_HOME", str(home))
    path = venv_facts.wheel_uv_path(str(wheel))
    assert path == f"{home}/uv-0.13.9/uv"

    spec = dict(venv_facts.SPEC_DEFAULTS, lock=CT_PARAMS["lock"], path=str(tmp_path / "venv"), uv_wheel=str(wheel))
    context = {"target": {"label": "host1"}, "check_mode": False, "steps": {}}

    def found():
        answer = venv_probe.probe(venv_facts.probe_payload(spec))
        return venv_facts.evaluate_step(spec, answer, {}, context)["uv_installed"]

    target = Target(node="host1")
    assert found() is False
    assert venv_acting.install_uv(target, str(wheel)) == path
    assert found() is True
    assert subprocess.run([path], capture_output=True, text=True, check=True).stdout == "uv 0.13.9\n"
    # Another user's file there: not trusted, replaced by root's.
    os.chown(path, 65534, 65534)
    assert found() is False
    venv_acting.install_uv(target, str(wheel))
    assert (os.lstat(path).st_uid, found()) == (0, True)
    # A link there: replaced, the file it named left as it was.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("not uv\n")
    os.unlink(path)
    os.symlink(elsewhere, path)
    assert found() is False
    venv_acting.install_uv(target, str(wheel))
    assert (Path(path).is_symlink(), elsewhere.read_text(), found()) == (False, "not uv\n", True)
    # A directory there (root's: only root can make one there): named, nothing put inside it.
    os.unlink(path)
    os.mkdir(path)
    with pytest.raises(TargetError, match=r"failed with exit code 1: .*/uv-0\.13\.9/uv is a directory"):
        venv_acting.install_uv(target, str(wheel))
    assert (os.listdir(path), sorted(os.listdir(os.path.dirname(path)))) == ([], ["uv"])


def test_the_installs_zip_read_is_the_only_one_and_names_a_mismatch(tmp_path):
    renamed = tmp_path / WHEEL_NAME
    with zipfile.ZipFile(renamed, "w") as archive:
        archive.writestr("uv-0.14.0.data/scripts/uv", b"uv")
    with pytest.raises(VenvError, match=r"is named for uv 0\.13\.9 but holds uv-0\.14\.0\.data/scripts/uv"):
        venv_acting.install_uv(Target(node="host1"), str(renamed))
