"""plugins/modules/training_venv.py and its build script (plugins/module_utils/steps/training_venv/script.py).

Three layers: the pure parts (plans, failure kinds, the payload, the reader the check uses); the module replayed
on a CT target through FakeRunner, every ``pct exec`` argv and stdin asserted; and the module on a bare host,
where the script runs in-process and builds real venvs in tmp_path with uv (and with ``python3 -m venv`` + pip)
from two local PEP 503 indexes served on 127.0.0.1: "pypi" (PyPI's torch 2.11.0, a cu130 build, and small
packages) and "cu128" (torch 2.11.0+cu128). The wheels are made here, the locks carry their real sha256.
No test reaches PyPI, imports torch or sleeps.
"""

import base64
import errno
import hashlib
import http.server
import inspect
import json
import os
import signal
import socket
import stat
import subprocess
import threading
import urllib.parse
import zipfile
from pathlib import Path

import pytest
import training_venv
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import act as ct_act
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import fs as ct_fs
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git as ct_git
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git_paths as ct_git_paths
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import proc as ct_proc
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import progress as ct_progress
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import venv as ct_venv
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import progress as node_progress
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.act_runner import wrong_option
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import Target, probes_argv, probes_input
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import acting as venv_acting
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import check as venv_check
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import commands as venv_commands
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import compare as venv_compare
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import facts as venv_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import layout as venv_layout
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import probe as venv_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import script
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.lock import VenvError

from tests.conftest import ROOT, other_python, unavailable
from tests.fakes import FakeRunner, not_shippable, run_module, run_probes_program

UV = str(ROOT / ".venv" / "bin" / "uv")
SYSTEM_PYTHON = "/usr/bin/python3.11"
VERSION_PY = "__version__ = '{version}'\ndebug = False\ncuda: Optional[str] = '{cuda}'\ngit_version = 'abc123'\n"
STAMPS = [f"20261203T10{minute:02d}00Z" for minute in range(60)]


# -- the pure parts --------------------------------------------------------------------------------------------
def test_version_names_match_exactly_and_nothing_else():
    pattern = venv_layout.version_pattern("/opt/venvs/train")
    assert pattern.match("train.20261203T101500Z")
    for other in (
        "train",
        "train.20261203T101500Z-previous",
        "train.20261203T101500Z.lock.txt",
        "train.20261203T101500Z.freeze.txt",
        "train.20261203T101500Z.link",
        "train.backup",
        "trainX20261203T101500Z",
        "other.20261203T101500Z",
    ):
        assert not pattern.match(other), other
    assert venv_layout.version_dir("/opt/venvs/train", "20261203T101500Z") == "/opt/venvs/train.20261203T101500Z"
    assert venv_layout.previous_dir("/v/t", "20261203T101500Z") == "/v/t.20261203T101500Z-previous"


def test_a_leftover_is_one_of_our_names_a_real_directory_marked_and_not_current():
    entries = [
        ("train.20261203T101500Z", True, True),  # interrupted: removed
        ("train.20261203T091500Z", True, False),  # finished: retention's business
        ("train.20261203T081500Z", True, True),  # marked but current: never
        ("train.20261203T071500Z", False, True),  # not a real directory (a symlink)
        ("train.backup", True, True),  # not our name
        ("train.20261203T061500Z-previous", True, True),
    ]
    assert venv_layout.plan_leftovers("/v/train", entries, "/v/train.20261203T081500Z") == ["/v/train.20261203T101500Z"]


def test_retention_keeps_the_newest_the_current_counted_and_skips_what_is_used():
    versions = ["/v/t.20261203T010000Z", "/v/t.20261203T030000Z", "/v/t.20261203T020000Z", "/v/t.20261203T040000Z"]
    current = "/v/t.20261203T040000Z"
    assert venv_layout.plan_retention(versions, current, None, {}) == ([], [])
    assert venv_layout.plan_retention(versions, current, 2, {}) == (
        ["/v/t.20261203T010000Z", "/v/t.20261203T020000Z"],
        [],
    )
    assert venv_layout.plan_retention(versions, current, 1, {"/v/t.20261203T010000Z": [77, 41]}) == (
        ["/v/t.20261203T020000Z", "/v/t.20261203T030000Z"],
        [{"path": "/v/t.20261203T010000Z", "pids": [41, 77], "reason": "in use by pid 41, 77"}],
    )
    assert venv_layout.plan_retention(versions, current, 9, {}) == ([], [])


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        (
            "error: Failed to download `idna==3.10`\n  Caused by: connection closed before message completed",
            "index_unreachable",
        ),
        ("  Caused by: tcp connect error: Connection refused (os error 111)", "index_unreachable"),
        (
            "WARNING: Retrying ... NewConnectionError('<...>: Failed to establish a new connection')",
            "index_unreachable",
        ),
        ("error: Failed to install: torch\n  Caused by: No space left on device (os error 28)", "no_space"),
        ("OSError: [Errno 28] No space left on device", "no_space"),
        ("ERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE.", "hash_mismatch"),
        ("error: Hash mismatch for `six==1.17.0`", "hash_mismatch"),
        ("ERROR: No matching distribution found for torch==2.11.0+cu128", "not_on_index"),
        (
            "  x No solution found when resolving dependencies:\n  Because torch==2.11.0+cu128 was not found",
            "not_on_index",
        ),
        (
            "error: No interpreter found for Python 3.12 in managed installations or search path",
            "python",
        ),
        ("Segmentation fault", "install_failed"),
        ("", "install_failed"),
    ],
)
def test_a_failed_install_is_named_by_what_it_printed(text, kind):
    assert venv_commands.classify_failure(text)[0] == kind


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            "Resolved 3 packages in 7ms\nerror: Failed to download `idna==3.10`\n  cause: Failed to fetch: http://x\n"
            "  cause: connection closed before message completed\n",
            "Failed to download `idna==3.10`: connection closed before message completed",
        ),
        (
            "ERROR: No matching distribution found for torch==2.11.0+cu128\n",
            "No matching distribution found for torch==2.11.0+cu128",
        ),
        ("Collecting six\nKilled\n", "Killed"),
        ("", "no output"),
    ],
)
def test_a_failed_command_is_summed_up_by_its_error_line_and_last_cause(text, line):
    assert venv_commands.failure_line(text) == line


def test_differences_compare_exact_strings_and_ignore_only_the_named_tooling():
    expected = {"torch": "2.11.0+cu128", "six": "1.17.0"}
    installed = {"torch": "2.11.0+cu130", "pip": "23.0.1", "sglang": "0.5.4"}
    assert venv_check.differences(expected, installed, ["pip"]) == [
        "torch 2.11.0+cu130, expected 2.11.0+cu128",
        "six 1.17.0 is missing",
        "sglang 0.5.4 is not in the lock",
    ]
    assert venv_check.differences(expected, dict(expected), []) == []


@pytest.mark.parametrize(
    ("records", "build", "pins"),
    [
        ([("torch", "2.11.0")], "2.11.0+cu130", {"torch": "2.11.0+cu128"}),  # PyPI's torch: its build
        ([("torch", "2.11.0")], "2.11.0+cu130", {"torch": "2.11.0"}),  # a plain pin names PyPI's wheel
        ([("torch", "2.11.0+cu128")], "2.11.0+cu128", {}),
        ([("torch", "2.10.0")], "2.11.0+cu130", {}),  # another release: METADATA stands
        ([("Jinja2", "3.1.6"), ("typing_extensions", "4.16.0"), ("numpy", "2.3.4"), ("numpy", "2.3.3")], None, {}),
    ],
)
def test_the_scripts_reader_reads_versions_as_the_fact_pass_does(records, build, pins):
    answer = {"distributions": [{"name": n, "version": v} for n, v in records], "torch_version_py": {"version": build}}
    assert ct_venv.installed_versions(records, build, pins) == venv_compare.installed_versions(answer, pins)
    assert venv_check.freeze_text(ct_venv.installed_versions(records, build, pins)) == venv_compare.freeze_lines(
        venv_compare.installed_versions(answer, pins)
    )


def test_the_script_imports_only_the_standard_library_and_what_it_ships():
    # Its source travels to the target's python with its SHARED modules: nothing else of ours, nothing installed.
    assert not_shippable(script) == set()


def test_the_payload_carries_what_the_lock_means():
    spec = {"path": "/opt/venvs/train", "lock": SMALL_LOCK, "python_version": None, "tooling": "ignore", "keep": 2}
    params = {"uv": "/root/.local/bin/uv", "build_timeout": 900, "build_from_source": ["Flash_Attn"]}
    assert venv_acting.build_payload(dict(spec), dict(params, cache_max_gib=1.5), "20261203T101500Z") == {
        "path": "/opt/venvs/train",
        "lock": SMALL_LOCK,
        "python": "3.11",  # from the lock's uv header
        "stamp": "20261203T101500Z",
        "uv": "/root/.local/bin/uv",
        "keep": 2,
        "timeout": 900,
        "expected": {"six": "1.17.0", "torch": "2.11.0+cu128"},
        "ignore": ["pip", "setuptools", "wheel"],
        "drop_tooling": [],
        "prune_only": False,
        "build_from_source": ["flash-attn"],  # canonical, as the script compares them
        "cache_max_bytes": 1610612736,
    }
    exact = venv_acting.build_payload(dict(spec, tooling="exact", python_version="3.11"), params, "20261203T101500Z")
    assert (exact["ignore"], exact["drop_tooling"]) == ([], ["pip", "setuptools", "wheel"])


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({}, ""),
        ({"keep": 0}, "keep is 0; the current venv counts, so keep is at least 1"),
        ({"unattended_keep": 0}, "unattended_keep is 0; the current venv counts, so unattended_keep is at least 1"),
        ({"build_timeout": 0}, "build_timeout is 0; give the build at least 1 second"),
        ({"lock": "torch>=2\n"}, "the lock, line 1: `torch>=2` is not an exact pin"),
        ({"python_version": "3.12"}, "python_version is 3.12 but the lock was compiled for 3.11"),
    ],
)
def test_options_that_cannot_work_are_named(changed, message):
    params = {"path": "/opt/venvs/train", "lock": SMALL_LOCK, "python_version": None, "tooling": "ignore"}
    params.update({"keep": None, "unattended_keep": 3, "unattended": False, "build_timeout": 1800, **changed})
    wrong = wrong_option(training_venv.TrainingVenv(training_venv.ARGUMENT_SPEC), params)
    assert wrong.startswith(message)
    assert bool(wrong) == bool(message)


# -- the module on a CT, replayed ------------------------------------------------------------------------------
SMALL_LOCK = (
    "# This file was autogenerated by uv via the following command:\n"
    "#    uv pip compile requirements.in --generate-hashes --python-version 3.11\n"
    "--index-url https://pypi.org/simple\n"
    "--extra-index-url https://download.pytorch.org/whl/cu128\n\n"
    f"six==1.17.0 \\\n    --hash=sha256:{'a' * 64}\n"
    f"torch==2.11.0+cu128 \\\n    --hash=sha256:{'b' * 64}\n"
)
CT_PATH = "/opt/venvs/train"
CT_PARAMS = {"vmid": 200, "lock": SMALL_LOCK}
PCT = ["pct", "exec", "200", "--keep-env", "0", "--", "timeout", "-k", "5"]
WRAPPER = ["env", "LC_ALL=C", "LANG=C", "python3", "-I", "-"]
READ_PAYLOAD = {"path": CT_PATH, "timeout": 60, "uv": "uv", "python": "3.11"}
STAMP = "20261203T101500Z"
BUILD_PAYLOAD = {
    "path": CT_PATH,
    "lock": SMALL_LOCK,
    "python": "3.11",
    "stamp": STAMP,
    "uv": "uv",
    "keep": None,
    "timeout": 1800,
    "expected": {"six": "1.17.0", "torch": "2.11.0+cu128"},
    "ignore": ["pip", "setuptools", "wheel"],
    "drop_tooling": [],
    "prune_only": False,
    "build_from_source": [],
    "cache_max_bytes": 20 * 2**30,
}


def venv_answer(distributions, torch_build, exists=True):
    """The reader's answer for a python 3.11 venv at CT_PATH holding ``distributions`` ({name: version})."""
    return {
        "path": CT_PATH,
        "exists": exists,
        "directory": exists,
        "python": "3.11" if exists else None,
        "pyvenv": {"home": "/usr/bin", "version_info": "3.11.2"} if exists else None,
        "interpreter": {"path": "/usr/bin/python3.11", "exists": True} if exists else None,
        "lib_pythons": ["3.11"] if exists else [],
        "site_packages": f"{CT_PATH}/lib/python3.11/site-packages" if exists else None,
        "distributions": [
            {"name": n, "version": v, "installer": "uv", "direct_url": False} for n, v in distributions.items()
        ],
        "broken": [],
        "torch_version_py": venv_probe.parse_torch_version_py(VERSION_PY.format(version=torch_build, cuda="12.8"))
        if torch_build
        else None,
        "errors": [],
    }


IN_SPEC = venv_answer({"six": "1.17.0", "torch": "2.11.0+cu128"}, "2.11.0+cu128")
POLLUTED = venv_answer({"six": "1.17.0", "torch": "2.11.0", "sglang": "0.5.4"}, "2.11.0+cu130")
BUILT = {
    "path": CT_PATH,
    "current": f"{CT_PATH}.{STAMP}",
    "previous": {
        "path": f"{CT_PATH}.{STAMP}-previous",
        "freeze": f"{CT_PATH}.{STAMP}-previous.freeze.txt",
        "moved": True,
        "note": "moved from /opt/venvs/train: ...",
    },
    "builder": {"name": "uv", "path": "/usr/local/bin/uv", "version": "0.13.9"},
    "python": "3.11",
    "lock_file": f"{CT_PATH}.{STAMP}.lock.txt",
    "cache": {"path": f"{CT_PATH}.cache", "own_bytes": 0, "dropped": False},
    "cleaned": [],
    "removed": [],
    "retention_skipped": [],
    "seconds": 41.2,
}
INDEX_DOWN = {
    "error": "index_unreachable",
    "message": "installing the lock with `uv pip sync` failed (exit 2): connection closed before message completed",
    "cmd": ["/usr/local/bin/uv", "pip", "sync", "--python", f"{CT_PATH}.{STAMP}/bin/python", "--require-hashes"],
    "rc": 2,
    "stderr_tail": "error: Failed to download `torch==2.11.0+cu128`\n  Caused by: connection closed",
    "cleaned": [],
    "left_behind": None,
}


def read_call(answer):
    payloads = {"training_venv": READ_PAYLOAD}
    out = json.dumps({"training_venv": {"answer": answer, "seconds": 0.02}})
    return [*PCT, "60", *WRAPPER, json.dumps(payloads)], (0, out, "")


def build_call(built, reread):
    # build_timeout (1800) + 60 s for the script's own cleanup; the reader part rides along in the same pct exec.
    payloads = {"build": BUILD_PAYLOAD, "training_venv": READ_PAYLOAD}
    out = json.dumps(
        {"build": {"answer": built, "seconds": 41.2}, "training_venv": {"answer": reread, "seconds": 0.02}}
    )
    return [*PCT, "1860", *WRAPPER, json.dumps(payloads)], (0, out, "")


@pytest.fixture
def on_pve1(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "pve1")
    monkeypatch.setattr(venv_acting, "utc_stamp", lambda: STAMP)


@pytest.mark.usefixtures("on_pve1")
def test_ct_an_in_spec_venv_costs_one_pct_exec_and_changes_nothing(monkeypatch, capsys):
    for check_mode in (False, True):
        runner = FakeRunner(read_call(IN_SPEC))
        result = run_module(training_venv, CT_PARAMS, runner, monkeypatch, capsys, check_mode=check_mode)
        assert (result["changed"], result["current"], result["builder"], result["changes"]) == (False, None, None, [])
        assert result["diff"]["before"] == result["diff"]["after"] == "six==1.17.0\ntorch==2.11.0+cu128\n"


@pytest.mark.usefixtures("on_pve1")
def test_ct_check_mode_reports_the_rebuild_and_the_real_run_does_it_in_one_more_pct_exec(monkeypatch, capsys):
    check = run_module(training_venv, CT_PARAMS, FakeRunner(read_call(POLLUTED)), monkeypatch, capsys, check_mode=True)
    runner = FakeRunner(read_call(POLLUTED), build_call(BUILT, IN_SPEC))
    real = run_module(training_venv, CT_PARAMS, runner, monkeypatch, capsys)
    assert check["changed"] is real["changed"] is True
    assert (
        check["diff"]
        == real["diff"]
        == {
            "before": "sglang==0.5.4\nsix==1.17.0\ntorch==2.11.0+cu130\n",
            "after": "six==1.17.0\ntorch==2.11.0+cu128\n",
        }
    )
    assert (
        check["changes"]
        == real["changes"]
        == [
            "torch 2.11.0+cu130 -> 2.11.0+cu128 (build variant cu130, expected cu128)",
            "remove sglang 0.5.4 (not in the lock)",
        ]
    )
    # Check mode reports what is; the real run what is now.
    assert (check["wrong"], check["extra"], check["current"]) == (
        [{"name": "torch", "locked": "2.11.0+cu128", "installed": "2.11.0+cu130"}],
        [{"name": "sglang", "installed": "0.5.4"}],
        None,
    )
    assert (real["wrong"], real["extra"], real["missing"]) == ([], [], [])
    assert real["installed"] == {"six": "1.17.0", "torch": "2.11.0+cu128"}
    assert (real["current"], real["previous"], real["builder"]) == (
        BUILT["current"],
        BUILT["previous"],
        BUILT["builder"],
    )
    # What travels on stdin: the shared modules once each, then the build script's and the reader's sources, run in
    # that order in one process.
    given = json.loads(runner.stdin[1])
    shared = (ct_act, ct_progress, ct_venv, ct_fs, ct_git_paths, ct_run, ct_git)  # ct_git ships ct_fs, ct_git_paths
    shared += (venv_check, venv_commands, ct_proc, venv_layout)  # the build script ships its own (layout: ct_proc)
    assert given["shared"] == {m.__name__: inspect.getsource(m) for m in shared}
    sources = {"build": inspect.getsource(script), "training_venv": inspect.getsource(venv_probe)}
    assert given["sources"] == sources


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_failed_build_fails_with_its_kind_command_and_stderr(monkeypatch, capsys):
    runner = FakeRunner(read_call(POLLUTED), build_call(INDEX_DOWN, POLLUTED))
    result = run_module(training_venv, CT_PARAMS, runner, monkeypatch, capsys)
    assert result["failed"] is True
    assert result["error"] == "index_unreachable"
    assert result["msg"] == (
        "CT 200 on pve1: building the venv failed (index_unreachable): installing the lock with `uv pip sync` failed "
        "(exit 2): connection closed before message completed; /opt/venvs/train was left as it was"
    )
    assert (result["cmd"], result["rc"]) == (INDEX_DOWN["cmd"], 2)
    assert result["stderr_tail"] == INDEX_DOWN["stderr_tail"]
    assert (result["cleaned"], result["left_behind"]) == ([], None)


@pytest.mark.usefixtures("on_pve1")
def test_ct_old_versions_beyond_keep_are_removed_without_a_build_in_one_more_pct_exec(monkeypatch, capsys):
    versions = [f"{CT_PATH}.2026120{day}T101500Z" for day in range(1, 5)]
    answer = dict(IN_SPEC, versions=versions, real_path=versions[-1])
    params = dict(CT_PARAMS, keep=2)
    lines = [f"remove old venv version {v} (keep 2: the current one and the newest old one stay)" for v in versions[:2]]
    check = run_module(training_venv, params, FakeRunner(read_call(answer)), monkeypatch, capsys, check_mode=True)
    assert (check["changed"], check["changes"]) == (True, lines)
    payloads = {"build": dict(BUILD_PAYLOAD, keep=2, prune_only=True), "training_venv": READ_PAYLOAD}
    pruned = {"pruned": True, "removed": versions[:2], "retention_skipped": [], "seconds": 0.4}
    after = dict(answer, versions=versions[2:])
    out = json.dumps({"build": {"answer": pruned, "seconds": 0.4}, "training_venv": {"answer": after, "seconds": 0.02}})
    runner = FakeRunner(read_call(answer), ([*PCT, "1860", *WRAPPER, json.dumps(payloads)], (0, out, "")))
    real = run_module(training_venv, params, runner, monkeypatch, capsys)
    runner.assert_done()
    assert (real["changed"], real["changes"], real["diff"]) == (True, lines, check["diff"])
    assert (real["removed"], real["current"], real["builder"]) == (versions[:2], None, None)


@pytest.mark.usefixtures("on_pve1")
def test_ct_what_the_build_printed_is_escaped_in_the_message(monkeypatch, capsys):
    forged = dict(INDEX_DOWN, message="uv said \x1b[2J\nok: all fine\u202e")
    runner = FakeRunner(read_call(POLLUTED), build_call(forged, POLLUTED))
    result = run_module(training_venv, CT_PARAMS, runner, monkeypatch, capsys)
    assert result["msg"] == (
        "CT 200 on pve1: building the venv failed (index_unreachable): uv said \\x1b[2J\\nok: all fine\\u202e; "
        "/opt/venvs/train was left as it was"
    )


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_venv_still_out_of_spec_after_the_swap_fails_naming_both_versions(monkeypatch, capsys):
    runner = FakeRunner(read_call(POLLUTED), build_call(BUILT, POLLUTED))
    result = run_module(training_venv, CT_PARAMS, runner, monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "verify")
    assert result["msg"].startswith(
        "CT 200 on pve1: the venv at /opt/venvs/train is still not the lock after the build: torch 2.11.0+cu130 -> "
    )
    assert (result["current"], result["previous"]) == (BUILT["current"], BUILT["previous"])
    assert result["extra"] == [{"name": "sglang", "installed": "0.5.4"}]


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_build_answer_of_the_wrong_shape_is_refused(monkeypatch, capsys):
    runner = FakeRunner(read_call(POLLUTED), build_call({"current": 7}, IN_SPEC))
    result = run_module(training_venv, CT_PARAMS, runner, monkeypatch, capsys)
    assert (result["error"], result["msg"]) == (
        "probe",
        "CT 200 on pve1: the build script answered no 'current' in the expected shape",
    )
    for cache in ({"path": "/x", "own_bytes": "many", "dropped": False}, {"path": "/x", "own_bytes": 1, "dropped": 1}):
        runner = FakeRunner(read_call(POLLUTED), build_call(dict(BUILT, cache=cache), IN_SPEC))
        result = run_module(training_venv, CT_PARAMS, runner, monkeypatch, capsys)
        assert result["msg"] == "CT 200 on pve1: the build script answered a 'cache' of the wrong shape"


@pytest.mark.usefixtures("on_pve1")
def test_ct_what_the_reader_could_not_read_stops_before_any_build(monkeypatch, capsys):
    unreadable = dict(POLLUTED, errors=["cannot list /opt/venvs/train/lib/python3.11/site-packages: Permission denied"])
    result = run_module(training_venv, CT_PARAMS, FakeRunner(read_call(unreadable)), monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "problems")
    assert "Permission denied" in result["msg"]


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
@pytest.mark.usefixtures("on_pve1")
def test_ct_a_venv_the_target_cannot_build_fails_before_the_build(check_mode, monkeypatch, capsys):
    # Called alone, the module reads what a build would use as the fact pass does, and stops the same way.
    path = "/usr/sbin:/usr/bin"
    build = {"path": path, "uv": None, "uv_missing": f"uv is not on PATH ({path})", "python": "python3.11"}
    build.update(base_python="/usr/bin/python3.11", venv=True, ensurepip=False, uv_python=None, own="3.11")
    runner = FakeRunner(read_call(dict(POLLUTED, build=build)))  # the read, no build
    result = run_module(training_venv, CT_PARAMS, runner, monkeypatch, capsys, check_mode=check_mode)
    assert (result["failed"], result["error"]) == (True, "problems")
    assert result["msg"].startswith(
        "CT 200 on pve1: the venv at /opt/venvs/train needs a rebuild but the target cannot build it: no uv (uv is "
        "not on PATH (/usr/sbin:/usr/bin)) and `python3.11 -m venv` fails there"
    )
    # With the role's uv wheel the same target can: the build would run (check mode: planned only).
    if check_mode:
        wheel = dict(CT_PARAMS, uv_wheel="/var/cache/pve-gpu-recover/uv-0.9.0-py3-none-manylinux_2_28_x86_64.whl")
        answer = dict(POLLUTED, build=dict(build, uv_python="/usr/bin/python3.11"))
        argv, out = read_call(answer)
        payload = dict(READ_PAYLOAD, wheel_uv="/usr/local/lib/pve-gpu-recover/uv-0.9.0/uv")  # is that uv there
        runner = FakeRunner(([*argv[:-1], json.dumps({"training_venv": payload})], out))
        assert run_module(training_venv, wheel, runner, monkeypatch, capsys, check_mode=True)["changed"] is True


@pytest.mark.usefixtures("on_pve1")
def test_ct_options_that_cannot_work_fail_before_any_call(monkeypatch, capsys):
    result = run_module(training_venv, dict(CT_PARAMS, keep=0), FakeRunner(), monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "invalid")
    assert result["msg"].startswith("keep is 0;")
    # Before 2.0.0 `python` was the venv's version: one given there is never run as the CT's interpreter.
    result = run_module(training_venv, dict(CT_PARAMS, python="3.11"), FakeRunner(), monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "invalid")
    assert "python is '3.11', a version" in result["msg"]
    assert "python_version since 2.0.0" in result["msg"]


# -- real venvs on a bare host ---------------------------------------------------------------------------------
def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def make_wheel(directory, name, version, files):
    """A pure-python wheel ``name-version-py3-none-any.whl`` holding ``files`` ({path: text}) and its dist-info."""
    info = f"{name}-{version}.dist-info"
    contents = {path: text.encode() for path, text in files.items()}
    contents[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nA stand-in.\n".encode()
    contents[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: pve-gpu-recover tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = "".join(record_line(path, data) for path, data in contents.items()) + f"{info}/RECORD,,\n"
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in contents.items():
            archive.writestr(path, data)
        archive.writestr(f"{info}/RECORD", record)
    return wheel


class IndexServer(http.server.ThreadingHTTPServer):
    """PEP 503 simple indexes under ``/<index>/simple/`` and their files under ``/<index>/files/``.

    ``drop``: wheel names whose download gets no answer at all (the connection is closed); ``hang``: wheel name ->
    (requested, release) events: the request waits until released, like an index that went silent.
    """

    daemon_threads = True
    drop: set
    hang: dict


class IndexHandler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):
        name = os.path.basename(urllib.parse.unquote(urllib.parse.urlsplit(self.path).path))
        if name in self.server.drop:
            self.close_connection = True
            return
        if name in self.server.hang:
            requested, release = self.server.hang[name]
            requested.set()
            release.wait(60)
            self.close_connection = True
            return
        super().do_GET()

    def end_headers(self):
        if "/files/" in self.path:  # as PyPI serves a file: cacheable for ever (pip keeps it in its cache)
            self.send_header("Cache-Control", "max-age=365000000, immutable, public")
        super().end_headers()

    def log_message(self, *args):
        pass


class Indexes:
    """The two local indexes, their wheels' sha256 and the locks made of them."""

    def __init__(self, root):
        self.root = root
        self.hashes = {}
        self.server = IndexServer(("127.0.0.1", 0), lambda *a: IndexHandler(*a, directory=str(root)))
        self.server.drop, self.server.hang = set(), {}
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, index, name, version, files=None):
        files = dict(files or {f"{name.replace('-', '_')}.py": f"VERSION = {version!r}\n"})
        wheels = self.root / index / "files"
        wheels.mkdir(parents=True, exist_ok=True)
        wheel = make_wheel(wheels, name, version, files)
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        self.hashes[(name, version)] = digest
        page = self.root / index / "simple" / name
        page.mkdir(parents=True, exist_ok=True)
        link = f'<a href="../../files/{urllib.parse.quote(wheel.name)}#sha256={digest}">{wheel.name}</a>'
        (page / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{link}\n</body></html>\n")

    def url(self, index):
        return f"http://127.0.0.1:{self.server.server_address[1]}/{index}/simple"

    def lock(self, pins):
        """A lock as `uv pip compile --generate-hashes` writes it, the torch index as an extra index."""
        lines = [f"--index-url {self.url('pypi')}", f"--extra-index-url {self.url('cu128')}", ""]
        for name, version in sorted(pins.items()):
            lines += [f"{name}=={version} \\", f"    --hash=sha256:{self.hashes[(name, version)]}"]
        return "\n".join(lines) + "\n"


GOOD = {"idna": "3.10", "six": "1.17.0", "torch": "2.11.0+cu128"}
SMALLER = {"six": "1.17.0", "torch": "2.11.0+cu128"}
GOOD_FREEZE = "idna==3.10\nsix==1.17.0\ntorch==2.11.0+cu128\n"


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    index = Indexes(tmp_path_factory.mktemp("index"))
    # PyPI's torch says 2.11.0 in METADATA and is a cu130 build; the cu128 index's says its build in both.
    torch_files = {"torch/__init__.py": "raise ImportError('nothing here may import torch')\n"}
    index.add(
        "pypi",
        "torch",
        "2.11.0",
        dict(torch_files, **{"torch/version.py": VERSION_PY.format(version="2.11.0+cu130", cuda="13.0")}),
    )
    index.add(
        "cu128",
        "torch",
        "2.11.0+cu128",
        dict(torch_files, **{"torch/version.py": VERSION_PY.format(version="2.11.0+cu128", cuda="12.8")}),
    )
    for name, version in (("six", "1.17.0"), ("idna", "3.10"), ("sglang", "0.5.4")):
        index.add("pypi", name, version)
    index.thread.start()
    yield index
    index.server.shutdown()
    index.server.server_close()


@pytest.fixture
def host(indexes, tmp_path, monkeypatch):
    """A bare host: PATH of a plain system, fresh uv/pip caches, no retries (a dropped wheel fails at once)."""
    if not (Path(UV).exists() and Path(SYSTEM_PYTHON).exists()):
        unavailable(f"needs {UV} and {SYSTEM_PYTHON}")
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu1")
    stamps = iter(STAMPS)
    monkeypatch.setattr(venv_acting, "utc_stamp", lambda: next(stamps))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    indexes.server.drop.clear()
    indexes.server.hang.clear()
    (tmp_path / "venvs").mkdir()
    return Host(indexes, tmp_path / "venvs" / "train", monkeypatch)


class Host:
    def __init__(self, indexes, path, monkeypatch):
        self.indexes = indexes
        self.path = path
        self.monkeypatch = monkeypatch

    def run(self, capsys, pins=GOOD, *, check_mode=False, **params):
        args = {"path": str(self.path), "lock": self.indexes.lock(pins), "python_version": "3.11", "uv": UV, **params}
        return run_module(training_venv, args, FakeRunner(), self.monkeypatch, capsys, check_mode=check_mode)

    def version(self, stamp):
        return Path(f"{self.path}.{stamp}")

    def uv(self, *args):
        done = subprocess.run([UV, *map(str, args)], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
        return done

    def pollute(self, venv):
        """What experiments do: PyPI's torch (a cu130 build) over the cu128 one, and a package the lock lacks."""
        self.uv(
            "pip",
            "install",
            "--quiet",
            "--python",
            Path(venv) / "bin" / "python",
            "--index-url",
            self.indexes.url("pypi"),
            "--reinstall",
            "--no-deps",
            "torch==2.11.0",
            "sglang==0.5.4",
            "six==1.17.0",
            "idna==3.10",
        )


def works(venv, *modules):
    """The venv's python runs and imports ``modules`` from it."""
    code = f"import sys{''.join(f', {m}' for m in modules)}; print(sys.prefix)"
    done = subprocess.run([f"{venv}/bin/python", "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def snapshot(root):
    """Every path under ``root``: kind, link target, size, mtime. What check mode and a converged run must keep."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            full = os.path.join(directory, name)
            info = os.lstat(full)
            link = os.readlink(full) if stat.S_ISLNK(info.st_mode) else None
            found[os.path.relpath(full, root)] = (stat.S_IFMT(info.st_mode), link, info.st_size, info.st_mtime_ns)
    return found


def probe(path):
    return venv_probe.probe({"path": str(path), "timeout": 30})


def test_a_missing_venv_is_built_as_a_version_behind_a_symlink(host, capsys):
    result = host.run(capsys)
    new = host.version(STAMPS[0])
    assert result["changed"] is True
    assert result["changes"] == [f"create venv at {host.path} (python 3.11, 3 distributions from the lock)"]
    assert result["diff"] == {"before": "", "after": GOOD_FREEZE}
    assert (result["current"], result["previous"], result["cleaned"], result["removed"]) == (str(new), None, [], [])
    assert result["builder"] == {"name": "uv", "path": UV, "version": "0.13.9"}
    assert (result["installed"], result["missing"], result["extra"], result["wrong"]) == (GOOD, [], [], [])
    assert os.readlink(host.path) == new.name  # relative: the layout survives a bind mount elsewhere
    assert not (new / venv_layout.MARKER).exists()
    assert Path(result["lock_file"]).read_text() == host.indexes.lock(GOOD)
    assert works(host.path, "six", "idna") == str(host.path)


def test_a_polluted_venv_made_before_this_tool_is_rebuilt_and_moved_aside_with_its_freeze(host, capsys):
    host.uv("venv", "--quiet", "--python", "3.11", host.path)
    host.pollute(host.path)
    result = host.run(capsys)
    moved = Path(f"{host.path}.{STAMPS[0]}-previous")
    assert result["changed"] is True
    assert result["diff"]["before"] == "idna==3.10\nsglang==0.5.4\nsix==1.17.0\ntorch==2.11.0+cu130\n"
    assert "remove sglang 0.5.4 (not in the lock)" in result["changes"]
    assert result["previous"] == {
        "path": str(moved),
        "freeze": f"{moved}.freeze.txt",
        "moved": True,
        "note": f"moved from {host.path}: a venv embeds its path, so it works again only once renamed back "
        f"(rm {host.path} && mv {moved} {host.path})",
    }
    # The freeze is what the fact pass read (torch's build from version.py), every record, before the swap.
    assert Path(result["previous"]["freeze"]).read_text() == result["diff"]["before"]
    assert (moved / "pyvenv.cfg").exists()
    assert host.path.is_symlink() and (result["installed"], result["extra"], result["wrong"]) == (GOOD, [], [])
    assert works(host.path, "six", "idna")


def test_a_polluted_version_is_rebuilt_and_the_old_one_stays_where_it_is_and_works(host, capsys):
    host.run(capsys, SMALLER)
    old = host.version(STAMPS[0])
    host.pollute(host.path)  # through the symlink: into the current version
    before = snapshot(host.path.parent)
    check = host.run(capsys, check_mode=True)
    assert snapshot(host.path.parent) == before  # check mode changed nothing
    real = host.run(capsys)
    assert check["changed"] is real["changed"] is True
    assert check["diff"] == real["diff"]
    assert (
        check["changes"]
        == real["changes"]
        == [
            "torch 2.11.0+cu130 -> 2.11.0+cu128 (build variant cu130, expected cu128)",
            "remove sglang 0.5.4 (not in the lock)",
        ]
    )
    assert real["previous"]["path"] == str(old) and real["previous"]["moved"] is False
    assert real["current"] == str(host.version(STAMPS[1]))  # the check-mode run took no stamp's directory
    assert Path(f"{old}.freeze.txt").read_text() == "idna==3.10\nsglang==0.5.4\nsix==1.17.0\ntorch==2.11.0+cu130\n"
    # The old version was not moved: a job started from it still finds everything where it was.
    assert works(old, "sglang") == str(old)
    assert works(host.path, "idna") == str(host.path)
    # The script's reader (the check before the swap) and the fact pass's reader agree on a real polluted venv.
    read = venv_check.read_venv(str(old))
    assert ct_venv.installed_versions(read["records"], read["torch_build"], GOOD) == venv_compare.installed_versions(
        probe(old), GOOD
    )


def test_an_in_spec_venv_is_left_alone_and_nothing_is_built(host, capsys):
    host.run(capsys)
    before = snapshot(host.path.parent)
    for check_mode in (True, False):
        result = host.run(capsys, check_mode=check_mode)
        assert (result["changed"], result["changes"], result["current"], result["builder"]) == (False, [], None, None)
        assert result["diff"]["before"] == result["diff"]["after"] == GOOD_FREEZE
    assert snapshot(host.path.parent) == before


def test_an_index_that_drops_a_download_leaves_the_old_venv_and_the_next_run_succeeds(host, capsys):
    host.run(capsys, SMALLER)
    old = host.version(STAMPS[0])
    host.indexes.server.drop.add("idna-3.10-py3-none-any.whl")
    failed = host.run(capsys)
    assert failed["failed"] is True
    assert failed["error"] == "index_unreachable", failed["msg"]
    assert failed["msg"] == (
        "host gpu1: building the venv failed (index_unreachable): installing the lock with `uv pip sync` failed "
        "(exit 2): Failed to download `idna==3.10`: connection closed before message completed; the target cannot "
        "download from the lock's indexes; check its network, or give its proxy as training_venv_environment "
        f"(HTTPS_PROXY, NO_PROXY), and run again; {host.path} was left as it was"
    )
    assert failed["cmd"][1:3] == ["pip", "sync"] and failed["stderr_tail"]
    assert failed["left_behind"] is None
    # The old venv is untouched and works; nothing of the failed build is left.
    assert os.readlink(host.path) == old.name
    assert works(host.path, "six") == str(host.path)
    assert sorted(p.name for p in host.path.parent.iterdir()) == [
        "train",
        f"train.{STAMPS[0]}",
        f"train.{STAMPS[0]}.lock.txt",
        "train.cache",  # what the failed build downloaded stays for the next one
    ]
    host.indexes.server.drop.clear()
    again = host.run(capsys)
    assert (again["changed"], again["current"], again["installed"]) == (True, str(host.version(STAMPS[2])), GOOD)


def test_an_interrupted_build_is_removed_by_the_next_run(host, capsys):
    host.run(capsys, SMALLER)
    # A build killed mid-download, as `timeout -k` kills the pct exec's process group: run the script the way
    # Target.run_probes ships it, let it hang on one wheel, then SIGKILL its group.
    requested, release = threading.Event(), threading.Event()
    host.indexes.server.hang["idna-3.10-py3-none-any.whl"] = (requested, release)
    spec = {"path": str(host.path), "lock": host.indexes.lock(GOOD), "python_version": "3.11", "tooling": "ignore"}
    payload = venv_acting.build_payload(spec, {"uv": UV, "keep": None, "build_timeout": 120}, STAMPS[1])
    program = probes_input({"build": (script, payload)})
    build = subprocess.Popen(
        probes_argv(SYSTEM_PYTHON),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    build.stdin.write(program.encode())
    build.stdin.close()
    try:
        assert requested.wait(60), "the build never asked for the wheel"
        os.killpg(build.pid, signal.SIGKILL)
        build.wait(30)
    finally:
        release.set()
    leftover = host.version(STAMPS[1])
    assert (leftover / venv_layout.MARKER).exists()
    assert os.readlink(host.path) == host.version(STAMPS[0]).name  # the old venv is still the current one
    host.indexes.server.hang.clear()
    result = host.run(capsys)  # takes STAMPS[1] from the host's clock too: a leftover of the same second
    assert result["cleaned"] == [str(leftover)]
    assert (result["changed"], result["current"], result["installed"]) == (True, str(leftover), GOOD)
    assert not (leftover / venv_layout.MARKER).exists()


def test_a_build_past_build_timeout_is_killed_and_removed(host, capsys):
    host.run(capsys, SMALLER)
    requested, release = threading.Event(), threading.Event()
    host.indexes.server.hang["idna-3.10-py3-none-any.whl"] = (requested, release)
    try:
        result = host.run(capsys, build_timeout=2)  # the one wait: the build's own deadline
    finally:
        release.set()
    assert requested.is_set()
    assert (result["failed"], result["error"], result["left_behind"]) == (True, "timeout", None)
    assert (
        "installing the lock with `uv pip sync` did not finish within the build's 2 s (build_timeout)" in result["msg"]
    )
    assert os.readlink(host.path) == host.version(STAMPS[0]).name
    assert not host.version(STAMPS[1]).exists() and not Path(f"{host.version(STAMPS[1])}.lock.txt").exists()
    assert works(host.path, "six")


def test_a_full_disk_removes_what_was_built_and_says_so(host, capsys, monkeypatch):
    host.run(capsys, SMALLER)

    def disk_full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(venv_layout, "write_atomic", disk_full)
    result = host.run(capsys)
    lock_file = f"{host.version(STAMPS[1])}.lock.txt"
    assert (result["failed"], result["error"]) == (True, "no_space")
    assert f"No space left on device ({lock_file})" in result["msg"]
    assert not host.version(STAMPS[1]).exists()
    assert os.readlink(host.path) == host.version(STAMPS[0]).name


def test_no_uv_and_no_venv_module_is_one_clear_error(host, capsys, tmp_path):
    broken = tmp_path / "bin"
    broken.mkdir()
    # What Debian's python3 without python3-venv says.
    (broken / "python3.11").write_text(
        "#!/bin/sh\necho 'The virtual environment was not created successfully because ensurepip is not\n"
        "available.  On Debian/Ubuntu systems, you need to install the python3-venv\npackage' >&2\nexit 1\n"
    )
    (broken / "python3.11").chmod(0o755)
    host.monkeypatch.setenv("PATH", f"{broken}:/usr/bin:/bin")
    result = host.run(capsys, uv="/nonexistent/uv")
    assert (result["failed"], result["error"]) == (True, "no_builder")
    assert "no uv (/nonexistent/uv is not an executable file)" in result["msg"]
    assert f"`{broken}/python3.11 -m venv` fails because ensurepip/venv is missing" in result["msg"]
    assert "`apt install python3-venv`" in result["msg"] and "give the role a uv" in result["msg"]
    assert "ensurepip is not" in result["stderr_tail"]
    assert list(host.path.parent.iterdir()) == []  # nothing built is left


@pytest.mark.parametrize("tooling", ["ignore", "exact"])
def test_without_uv_the_venv_is_built_with_venv_and_pip(host, capsys, tooling):
    check = subprocess.run([SYSTEM_PYTHON, "-c", "import ensurepip, venv"], capture_output=True, check=False)
    if check.returncode != 0:
        unavailable(f"{SYSTEM_PYTHON} has no venv/ensurepip")
    result = host.run(capsys, uv="/nonexistent/uv", tooling=tooling)
    assert result["changed"] is True, result.get("msg")
    assert result["builder"]["name"] == "venv+pip"
    assert result["builder"]["path"] == SYSTEM_PYTHON
    assert result["builder"]["fallback"] == "/nonexistent/uv is not an executable file"
    assert (result["missing"], result["extra"], result["wrong"]) == ([], [], [])
    tooling_installed = {name for name in result["installed"] if name in ("pip", "setuptools")}
    # `-m venv` seeds pip (and setuptools on 3.11): kept under "ignore", removed under "exact".
    assert tooling_installed == ({"pip", "setuptools"} if tooling == "ignore" else set())
    assert {k: v for k, v in result["installed"].items() if k not in ("pip", "setuptools")} == GOOD
    assert works(host.path, "six", "idna")


def test_retention_keeps_the_newest_and_never_a_version_a_process_uses(host, capsys):
    host.run(capsys, GOOD)
    host.run(capsys, SMALLER)
    first, second = host.version(STAMPS[0]), host.version(STAMPS[1])
    # A job still running from the first version (started by its own path, as its console scripts do).
    job = subprocess.Popen(
        [f"{first}/bin/python", "-c", "import sys, six; print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert job.stdout.readline() == "ready\n"
        result = host.run(capsys, GOOD, keep=1)
    finally:
        job.stdin.close()
        job.wait(30)
    third = host.version(STAMPS[2])
    assert result["current"] == str(third)
    assert result["removed"] == [str(second)]
    assert result["retention_skipped"] == [
        {"path": str(first), "pids": [job.pid], "reason": f"in use by pid {job.pid}"}
    ]
    # A removed version goes with its lock; its freeze (what it held when it was replaced) stays.
    assert not second.exists() and not Path(f"{second}.lock.txt").exists()
    assert Path(f"{second}.freeze.txt").read_text() == "six==1.17.0\ntorch==2.11.0+cu128\n"
    # The job has ended: the next build removes the first version and the one it replaces.
    result = host.run(capsys, SMALLER, keep=1)
    assert (result["removed"], result["retention_skipped"]) == ([str(first), str(third)], [])
    assert sorted(p.name for p in host.path.parent.iterdir() if not p.name.endswith(".txt")) == [
        "train",
        f"train.{STAMPS[3]}",
        "train.cache",  # the build's package cache: retention never removes it
    ]


def test_no_file_is_written_through_a_link_planted_beside_the_venv(host, capsys, tmp_path):
    """The venv's parent may be writable by a user of the target: links planted at every name the build once
    wrote with a fixed temporary name (``<file>.tmp<pid>``) point at a victim, which stays untouched."""
    host.run(capsys, SMALLER)
    host.pollute(host.path)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    old, new = host.version(STAMPS[0]), host.version(STAMPS[1])
    for name in (f"{new}.lock.txt", f"{old}.freeze.txt"):
        os.symlink(victim, f"{name}.tmp{os.getpid()}")
    result = host.run(capsys)
    assert result["changed"] is True and result["current"] == str(new), result.get("msg")
    assert victim.read_text() == "precious\n"
    assert Path(f"{new}.lock.txt").read_text() == host.indexes.lock(GOOD)
    assert not Path(f"{new}.lock.txt").is_symlink()
    assert Path(f"{old}.freeze.txt").read_text() == "idna==3.10\nsglang==0.5.4\nsix==1.17.0\ntorch==2.11.0+cu130\n"


def test_a_link_planted_at_the_lock_or_freeze_name_is_replaced_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    planted = tmp_path / "train.20261203T101500Z.lock.txt"
    planted.symlink_to(victim)
    venv_layout.write_atomic(str(planted), "six==1.17.0\n")
    assert victim.read_text() == "precious\n"
    assert (planted.is_symlink(), planted.read_text()) == (False, "six==1.17.0\n")
    assert stat.S_IMODE(planted.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.20261203T101500Z.lock.txt", "victim"]
    marker = tmp_path / "marker"
    marker.symlink_to(victim)
    with pytest.raises(FileExistsError):
        venv_layout.create_new(str(marker), "unfinished\n")
    assert victim.read_text() == "precious\n"


def test_the_script_runs_as_shipped_on_python_3_9(host, capsys):
    python = other_python("3.9")
    if python is None:
        unavailable("no python3.9 here")
    spec = {"path": str(host.path), "lock": host.indexes.lock(GOOD), "python_version": "3.11", "tooling": "ignore"}
    payload = venv_acting.build_payload(spec, {"uv": UV, "keep": None, "build_timeout": 120}, STAMPS[0])
    answer = run_probes_program(python, {"build": (script, payload)})["build"]["answer"]
    assert answer["current"] == str(host.version(STAMPS[0])), answer
    assert host.run(capsys)["changed"] is False


def uv_wheel(directory, version="0.13.9", binary=b"\x7fELF uv"):
    path = Path(directory) / f"uv-{version}-py3-none-manylinux_2_17_x86_64.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"uv-{version}.data/scripts/uv", binary)
        wheel.writestr(f"uv-{version}.dist-info/METADATA", f"Name: uv\nVersion: {version}\n\n")
    return path


def test_the_uv_of_pypis_wheel_is_found_with_its_version(tmp_path):
    assert venv_acting.uv_from_wheel(uv_wheel(tmp_path)) == ("0.13.9", b"\x7fELF uv")


def test_a_file_that_is_no_uv_wheel_is_a_clear_error(tmp_path):
    other = tmp_path / "six-1.17.0-py3-none-any.whl"
    with zipfile.ZipFile(other, "w") as wheel:
        wheel.writestr("six.py", "")
    with pytest.raises(VenvError, match=r"holds no uv-<version>\.data/scripts/uv"):
        venv_acting.uv_from_wheel(other)
    with pytest.raises(VenvError, match="cannot read the uv wheel"):
        venv_acting.uv_from_wheel(tmp_path / "missing.whl")


def test_uv_goes_into_the_ct_at_a_versioned_path_over_one_pct_exec(tmp_path):
    script = (
        'set -e; mkdir -p "${1%/*}"; t=$(mktemp "$1.XXXXXX"); cat > "$t"; chmod 755 "$t"; '
        'if [ -L "$1" ]; then rm -f "$1"; elif [ -d "$1" ]; then rm -f "$t"; echo "$1 is a directory" >&2; exit 1; fi; '
        'mv -f "$t" "$1"'
    )
    path = "/usr/local/lib/pve-gpu-recover/uv-0.13.9/uv"
    runner = FakeRunner(
        (
            [
                "pct",
                "exec",
                "200",
                "--keep-env",
                "0",
                "--",
                "timeout",
                "-k",
                "5",
                "60",
                "env",
                "LC_ALL=C",
                "LANG=C",
                "sh",
                "-c",
                script,
                "sh",
                path,
            ],
            (0, "", ""),
        )
    )
    assert venv_acting.install_uv(Target(200, node="pve1", runner=runner), uv_wheel(tmp_path)) == path
    assert runner.stdin == [b"\x7fELF uv"]
    runner.assert_done()


def test_uv_installed_from_a_wheel_on_a_bare_host_runs(tmp_path):
    wheel = uv_wheel(tmp_path, binary=b"#!/bin/sh\necho uv 0.13.9\n")
    home = tmp_path / "lib"
    target = Target(node="host1")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(venv_facts, "UV_HOME", str(home))
        path = venv_acting.install_uv(target, wheel)
        again = venv_acting.install_uv(target, wheel)  # replaced by the same: the read decides whether it runs
    assert path == again == f"{home}/uv-0.13.9/uv"
    assert subprocess.run([path], capture_output=True, text=True, check=True).stdout == "uv 0.13.9\n"


# -- unattended on a bare host: a real job running from the venv (the node-side read is this machine's /proc) --
def test_bare_host_unattended_a_real_job_running_from_the_venv_keeps_it(host, capsys):
    host.run(capsys, GOOD)
    current = host.version(STAMPS[0])
    # Started by the venv's own path, as a job's console scripts do: its exe is the base python3.11.
    job = subprocess.Popen(
        [f"{host.path}/bin/python", "-c", "import sys, six; print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert job.stdout.readline() == "ready\n"
        result = host.run(capsys, SMALLER, unattended=True)
        attended_check = host.run(capsys, SMALLER, check_mode=True)
    finally:
        job.stdin.close()
        job.wait(30)
    assert (result["changed"], result["current"]) == (False, None)
    assert [(u["pid"], u["how"]) for u in result["in_use"] if u["pid"] == job.pid] == [(job.pid, "argv0")]
    assert f"pid {job.pid} (python" in result["needs_window"][0]
    assert Path(host.path).resolve() == current  # nothing swapped
    assert attended_check["changed"] is True  # attended it would be rebuilt
    # The job has ended: an unattended run rebuilds it now.
    after = host.run(capsys, SMALLER, unattended=True)
    assert (after["changed"], after["current"], after["needs_window"]) == (True, str(host.version(STAMPS[1])), [])


def test_bare_host_the_script_removes_the_new_version_when_a_job_started_during_the_build(host, capsys, monkeypatch):
    host.run(capsys, GOOD)
    current = host.version(STAMPS[0])
    monkeypatch.setattr(venv_facts, "processes_running_from", lambda owner, roots, **_: ([], []))
    # What the script finds just before the swap: a job that started from the current venv during the build.
    users = lambda directories, proc="/proc": {d: [4242] for d in directories}  # noqa: E731
    monkeypatch.setattr(venv_layout, "processes_using", users)
    result = host.run(capsys, SMALLER, unattended=True)
    assert (result["changed"], result["current"]) == (False, None)
    assert "pid 4242 inside the target" in result["needs_window"][0]
    assert Path(host.path).resolve() == current
    assert not host.version(STAMPS[1]).exists()  # the version it built is gone, and so is its lock
    assert not Path(f"{host.version(STAMPS[1])}.lock.txt").exists()


# -- unattended runs cannot fill the disk (issue 25 item 13) ---------------------------------------------------
def test_an_unattended_run_keeps_the_current_and_two_old_versions_and_check_mode_names_the_rest(host, capsys):
    for pins in (GOOD, SMALLER, GOOD, SMALLER):  # attended, keep unset: every version stays
        assert host.run(capsys, pins)["removed"] == []
    versions = [host.version(stamp) for stamp in STAMPS[:4]]
    assert all(version.is_dir() for version in versions)
    # In spec: an attended run has nothing to do, an unattended one removes what is beyond the default keep of 3.
    assert host.run(capsys, SMALLER)["changed"] is False
    before = snapshot(host.path.parent)
    check = host.run(capsys, SMALLER, check_mode=True, unattended=True)
    assert snapshot(host.path.parent) == before
    real = host.run(capsys, SMALLER, unattended=True)
    line = f"remove old venv version {versions[0]} (keep 3: the current one and the 2 newest old ones stay)"
    assert check["changed"] is real["changed"] is True
    assert check["changes"] == real["changes"] == [line]
    assert (real["current"], real["builder"], real["removed"]) == (None, None, [str(versions[0])])
    assert not versions[0].exists() and all(version.is_dir() for version in versions[1:])
    assert works(host.path, "six") == str(host.path)
    # Converged again: nothing more to remove.
    assert host.run(capsys, SMALLER, check_mode=True, unattended=True)["changed"] is False


def test_a_rebuild_counts_the_version_it_makes_and_never_removes_one_a_shell_sits_in(host, capsys):
    for pins in (GOOD, SMALLER, GOOD):
        host.run(capsys, pins)
    oldest = host.version(STAMPS[0])
    # A shell cd'd into the oldest version: removing it would pull the directory from under it.
    shell = subprocess.Popen(["sleep", "60"], cwd=oldest)
    try:
        check = host.run(capsys, SMALLER, check_mode=True, unattended=True)
        real = host.run(capsys, SMALLER, unattended=True)
    finally:
        shell.kill()
        shell.wait()
    # The new version and the 2 newest old ones stay; the oldest is beyond keep but in use, so it stays too.
    assert check["changes"] == real["changes"] == ["remove idna 3.10 (not in the lock)"]
    assert real["current"] == str(host.version(STAMPS[3]))
    assert (real["removed"], real["retention_skipped"]) == (
        [],
        [{"path": str(oldest), "pids": [shell.pid], "reason": f"in use by pid {shell.pid}"}],
    )
    assert oldest.is_dir()


@pytest.mark.parametrize("fails_at", ["rename aside", "link over"])
def test_a_failed_swap_over_a_real_venv_directory_puts_it_back_where_it_was(tmp_path, monkeypatch, fails_at):
    # The first rebuild of a venv made before this tool: <path> is a real directory, renamed aside before the link
    # can take its name. A failure at either rename must leave <path> the old, working venv, and no link behind.
    old = tmp_path / "train"
    (old / "bin").mkdir(parents=True)
    (old / "bin" / "python").write_text("#!/bin/sh\n")
    new = tmp_path / "train.20261203T101500Z"
    new.mkdir()
    build = script.Build(
        {"path": str(old), "stamp": "20261203T101500Z", "lock": "six==1.17.0\n", "expected": {"six": "1.17.0"}}
    )
    real_rename, real_replace = os.rename, os.replace

    def broken(name, real):
        def call(src, dst):
            if name == fails_at:
                raise OSError(errno.EIO, "Input/output error")
            return real(src, dst)

        return call

    monkeypatch.setattr(
        script.os,
        "rename",
        lambda s, d: broken("rename aside", real_rename)(s, d) if str(d).endswith("-previous") else real_rename(s, d),
    )
    monkeypatch.setattr(script.os, "replace", broken("link over", real_replace))
    with pytest.raises(OSError):
        build.swap("dir", str(old))
    assert old.is_dir() and not old.is_symlink(), "the old venv is not back at its path"
    assert (old / "bin" / "python").read_text() == "#!/bin/sh\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train", "train.20261203T101500Z"]


def test_a_build_run_as_an_async_job_tells_its_phases_in_the_jobs_status_file(host, capsys, tmp_path, monkeypatch):
    """Issue 23 item 4: the module, run as an async job, writes each phase of a real build (uv from a local index)
    into the job's status file while it works; the result it answers is the same as ever."""
    job = tmp_path / "async" / "j1.2"
    job.parent.mkdir()
    job.write_text(json.dumps({"started": True, "finished": False, "ansible_job_id": "j1.2"}))
    monkeypatch.setattr(node_progress, "async_job_file", lambda: str(job))
    monkeypatch.setattr(node_progress, "WRITE_INTERVAL", 0.0)
    seen = []
    write = node_progress.Reporter.write
    monkeypatch.setattr(node_progress.Reporter, "write", lambda self: (seen.append(dict(self.progress)), write(self)))
    result = host.run(capsys)
    assert result["changed"] is True and result["current"] == str(host.version(STAMPS[0]))
    assert "pve_gpu_recover_progress" not in result
    phases = list(dict.fromkeys(s["phase"] for s in seen))
    assert phases == [
        "starting the build",
        "`uv venv` with 3.11",
        "installing the lock with `uv pip sync`",
        "`uv --version`",
        "running the new venv's python",
    ]
    assert {(s["step"], s["target"]) for s in seen} == {("training_venv", "host gpu1")}
    status = json.loads(job.read_text())
    assert (status["started"], status["finished"], status["ansible_job_id"]) == (True, False, "j1.2")
    assert status["pve_gpu_recover_progress"]["phase"] == "running the new venv's python"
