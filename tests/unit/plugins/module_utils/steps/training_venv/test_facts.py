"""plugins/module_utils/steps/training_venv/facts.py and its probe part: the lock, the venv's versions, the drift,
read from real venvs.

The pure functions are fed the fixtures of tests/fixtures/venv. The probe part runs against real venvs built
in tmp_path with uv: tiny packages from PyPI (skipped when PyPI cannot be reached), hand-made torch wheels
installed from a local directory, and the CPU torch wheel kept in /opt/wheels (skipped when absent). No test
imports torch or runs the venv's python.
"""

import base64
import glob
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import venv as ct_venv
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import torch_build
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import probe_name
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import compare as venv_compare
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import facts as venv_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import lock as venv_lock
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import probe as venv_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.lock import VenvError

from tests.conftest import FIXTURES, ROOT, other_python, unavailable
from tests.fakes import run_probes_program

VENV_FIXTURES = FIXTURES / "venv"
LOCK = (VENV_FIXTURES / "lock_cu128.txt").read_text()
VERSION_PY_CU130 = (VENV_FIXTURES / "version_py_cu130.txt").read_text()
VERSION_PY_CU128 = VERSION_PY_CU130.replace("cu130", "cu128").replace("'13.0'", "'12.8'")
CONTEXT = {"target": {"label": "CT 200 on pve1", "node": "pve1", "vmid": 200}, "check_mode": True, "steps": {}}
SPEC = dict(venv_facts.SPEC_DEFAULTS, lock=LOCK)
PATH = SPEC["path"]
LOCKED = venv_lock.parse_lock(LOCK)["distributions"]
TORCH_WHEEL = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
UV = shutil.which("uv", path=str(ROOT / ".venv" / "bin")) or shutil.which("uv")
UV_ENV = dict(os.environ, UV_PYTHON_DOWNLOADS="never", UV_NO_CONFIG="1", UV_NO_PROGRESS="1")


def freeze(text):
    """``pip freeze`` lines -> the probe's distributions."""
    return [dict(zip(("name", "version"), line.split("=="), strict=True)) for line in text.split()]


def answer_of(distributions, version_py=VERSION_PY_CU128, **changed):
    """A probe answer of an existing, healthy python 3.11 venv holding ``distributions``."""
    return {
        "path": PATH,
        "exists": True,
        "directory": True,
        "python": "3.11",
        "pyvenv": {"home": "/usr/bin", "version_info": "3.11.2", "uv": "0.13.9"},
        "interpreter": {"path": "/usr/bin/python3.11", "exists": True},
        "lib_pythons": ["3.11"],
        "site_packages": f"{PATH}/lib/python3.11/site-packages",
        "distributions": distributions,
        "broken": [],
        "torch_version_py": venv_probe.parse_torch_version_py(version_py) if version_py else None,
        "errors": [],
        **changed,
    }


IN_SPEC = answer_of([{"name": n, "version": v, "installer": "uv", "direct_url": False} for n, v in LOCKED.items()])
POLLUTED = answer_of(freeze((VENV_FIXTURES / "freeze_polluted.txt").read_text()), VERSION_PY_CU130)
ABSENT = dict(answer_of([], None), exists=False, directory=False, python=None, pyvenv=None, interpreter=None)


# -- names, variants, freeze lines -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("Typing_Extensions", "typing-extensions"),
        ("zope.interface", "zope-interface"),
        ("Jinja2", "jinja2"),
        ("nvidia_cublas__cu12", "nvidia-cublas-cu12"),
        ("flashinfer-python", "flashinfer-python"),
    ],
)
def test_names_are_compared_in_pep_503_form(name, canonical):
    assert venv_lock.canonical_name(name) == canonical


def test_pep_503_form_without_re_is_the_regular_expressions_form():
    """PEP 503's own rule is ``re.sub(r"[-_.]+", "-", name).lower()``; the CT's parts read names without ``re``."""
    randomness = random.Random(503)  # noqa: S311 (a fixed sample of names, not a secret)
    names = ["", "-", "._-", "a--b", "A.B_C-d", "torch", "nvidia_cublas__cu12", "zope.interface.", "_x_", "É.é"]
    names += ["".join(randomness.choice("aZ9-_.é ") for _ in range(randomness.randint(0, 12))) for _ in range(2000)]
    for name in names:
        assert ct_venv.canonical_name(name) == re.sub(r"[-_.]+", "-", name).lower(), name


@pytest.mark.parametrize(
    ("name", "minor"),
    [
        ("python3.11", "3.11"),
        ("python3.9", "3.9"),
        ("python10.2", "10.2"),
        ("python3.11.bak", None),
        ("python3", None),
        ("pythonX.Y", None),
        ("python", None),
        ("ython3.11", None),
        ("python3.11\n", None),
        ("python3.\u0661\u0661", None),  # digits, but not ASCII ones
    ],
)
def test_a_python_directory_or_interpreter_names_its_minor(name, minor):
    """``^python(\\d+\\.\\d+)$``, with ASCII digits only, for lib/pythonX.Y and an interpreter's file name."""
    assert ct_venv.python_name_minor(name) == minor


def test_freeze_lines_are_sorted_with_one_line_per_record():
    versions = {"torch": "2.11.0+cu128", "six": "1.17.0", "numpy": "2.3.3, 2.3.4"}
    assert venv_compare.freeze_lines(versions) == "numpy==2.3.3\nnumpy==2.3.4\nsix==1.17.0\ntorch==2.11.0+cu128\n"
    assert venv_compare.freeze_lines({}) == ""


# -- the lock --------------------------------------------------------------------------------------------------
def test_a_uv_lock_gives_its_pins_indexes_torch_index_and_python():
    lock = venv_lock.parse_lock(LOCK)
    assert len(lock["distributions"]) == 26
    assert lock["distributions"]["torch"] == "2.11.0+cu128"
    assert lock["distributions"]["nvidia-cudnn-cu12"] == "9.10.2.21"
    # Names as uv writes them (already canonical), hash continuation lines and `# via` lines left out.
    assert "typing-extensions" in lock["distributions"]
    assert lock["indexes"] == ["https://pypi.org/simple", "https://download.pytorch.org/whl/cu128"]
    assert lock["torch_index"] == "https://download.pytorch.org/whl/cu128"
    assert lock["sources"]["numpy"] == "https://pypi.org/simple"
    assert lock["python"] == "3.11"
    assert (lock["markers"], lock["find_links"], lock["no_index"]) == ({}, [], False)


def test_index_options_in_every_spelling_and_inline_comments_markers_extras():
    lock = venv_lock.parse_lock(
        "-i https://mirror.example/simple\n"
        "--extra-index-url=https://download.pytorch.org/whl/cu128/\n"
        "--find-links /srv/wheels\n"
        "--no-index\n"
        "Torch==2.11.0+cu128  # the known-good build\n"
        "uvicorn[standard]==0.30.6 ; sys_platform == 'linux'\n"
    )
    assert lock["distributions"] == {"torch": "2.11.0+cu128", "uvicorn": "0.30.6"}
    assert lock["indexes"] == ["https://mirror.example/simple", "https://download.pytorch.org/whl/cu128/"]
    # No `# from` annotation: the index named for torch's variant.
    assert lock["torch_index"] == "https://download.pytorch.org/whl/cu128/"
    assert lock["markers"] == {"uvicorn": "sys_platform == 'linux'"}
    assert (lock["find_links"], lock["no_index"], lock["python"]) == (["/srv/wheels"], True, None)


def test_a_lock_without_an_index_for_torch_names_none():
    assert venv_lock.parse_lock("torch==2.11.0+cu128\n")["torch_index"] is None
    assert venv_lock.parse_lock("six==1.17.0\n")["torch_index"] is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("six==1.17.0\ntorch>=2.11\n", r"line 2: `torch>=2.11` is not an exact pin \(name==version\)"),
        ("torch==2.*\n", r"line 1: `torch==2\.\*` is not an exact pin"),
        ("torch @ https://download.pytorch.org/whl/torch.whl\n", r"line 1: .* is a direct reference"),
        ("-e .\n", r"line 1: `-e \.` is not an exact pin"),
        ("-r base.txt\nsix==1.17.0\n", r"line 1: `-r base\.txt` is not an exact pin"),
        (
            "torch==2.11.0+cu128 ; sys_platform == 'linux'\ntorch==2.11.0 ; sys_platform == 'darwin'\n",
            r"line 2: torch is pinned twice \(2\.11\.0\+cu128 and 2\.11\.0",
        ),
        ("# only comments\n\n", r"the lock pins no distribution"),
    ],
)
def test_a_lock_that_is_not_exact_pins_is_refused_naming_the_line(text, message):
    with pytest.raises(VenvError, match=message) as raised:
        venv_lock.parse_lock(text)
    assert raised.value.kind == "lock"
    assert "uv pip compile --generate-hashes" in str(raised.value) or "python-platform" in str(raised.value)


def test_a_continued_pin_ends_at_a_comment_line_and_its_line_number_is_its_first():
    lock = venv_lock.parse_lock("idna==3.10 \\\n# a comment\nsix==1.17.0\n")
    assert lock["distributions"] == {"idna": "3.10", "six": "1.17.0"}
    with pytest.raises(VenvError, match="line 3: `six>=1` is not"):
        venv_lock.parse_lock("idna==3.10 \\\n# a comment\nsix>=1\n")
    with pytest.raises(VenvError, match=re.escape("line 2: `torch~=2.11 --hash=sha256:aa` is not")):
        venv_lock.parse_lock("idna==3.10\ntorch~=2.11 \\\n    --hash=sha256:aa\n")


def test_a_lock_is_read_once_per_text_and_each_reader_gets_its_own_copy(monkeypatch):
    # A node's read evaluates its targets' lock several times each, the same text for all of them.
    venv_lock._parse_lock.cache_clear()
    reads = []
    real_lines = venv_lock._logical_lines
    monkeypatch.setattr(venv_lock, "_logical_lines", lambda text: reads.append(text) or real_lines(text))
    first = venv_lock.parse_lock(LOCK)
    first["distributions"]["torch"] = "changed by a reader"
    first["indexes"].append("https://changed.example/simple")
    second = venv_lock.parse_lock(LOCK)
    assert reads == [LOCK]  # read once
    assert second["distributions"]["torch"] == "2.11.0+cu128"
    assert "https://changed.example/simple" not in second["indexes"]
    assert second == venv_lock.parse_lock(LOCK) and second is not venv_lock.parse_lock(LOCK)
    for _ in range(2):  # a lock that fails is refused every time it is read, never remembered as read
        with pytest.raises(VenvError, match="line 1: `six>=1` is not"):
            venv_lock.parse_lock("six>=1\n")
    assert len(reads) == 3


# -- installed versions ----------------------------------------------------------------------------------------
def test_pypi_torch_says_its_build_only_in_version_py():
    answer = answer_of([{"name": "torch", "version": "2.11.0"}], VERSION_PY_CU130)
    assert venv_compare.installed_versions(answer) == {"torch": "2.11.0+cu130"}
    assert venv_compare.installed_versions(answer, LOCKED) == {"torch": "2.11.0+cu130"}


def test_an_index_wheel_says_its_build_in_both():
    answer = answer_of([{"name": "torch", "version": "2.11.0+cu128"}], VERSION_PY_CU128)
    assert venv_compare.installed_versions(answer) == {"torch": "2.11.0+cu128"}


def test_a_lock_that_pins_pypi_torch_plain_is_met_by_pypi_torch():
    # Else a venv rebuilt from that very lock would differ from it forever.
    answer = answer_of([{"name": "torch", "version": "2.11.0"}], VERSION_PY_CU130)
    assert venv_compare.installed_versions(answer, {"torch": "2.11.0"}) == {"torch": "2.11.0"}


def test_a_version_py_of_another_release_does_not_replace_the_metadata():
    answer = answer_of([{"name": "torch", "version": "2.10.0"}], VERSION_PY_CU130)
    assert venv_compare.installed_versions(answer) == {"torch": "2.10.0"}
    assert "METADATA says 2.10.0 but torch/version.py says 2.11.0+cu130" in venv_compare.torch_inconsistency(answer)


def test_names_are_canonical_and_a_name_with_two_records_keeps_both_versions():
    answer = answer_of(
        [
            {"name": "Jinja2", "version": "3.1.6"},
            {"name": "typing_extensions", "version": "4.16.0"},
            {"name": "numpy", "version": "2.3.4"},
            {"name": "numpy", "version": "2.3.3"},
        ],
        None,
    )
    assert venv_compare.installed_versions(answer) == {
        "jinja2": "3.1.6",
        "typing-extensions": "4.16.0",
        "numpy": "2.3.3, 2.3.4",
    }


@pytest.mark.parametrize(
    ("distributions", "version_py", "why"),
    [
        ([{"name": "torch", "version": "2.11.0"}], VERSION_PY_CU130, None),
        ([{"name": "torch", "version": "2.11.0+cu128"}], VERSION_PY_CU128, None),
        ([{"name": "six", "version": "1.17.0"}], None, None),
        ([], VERSION_PY_CU130, "torch/version.py says 2.11.0+cu130 but no torch is installed (files left behind)"),
        ([{"name": "torch", "version": "2.11.0"}], None, "torch 2.11.0 is installed without torch/version.py"),
        ([{"name": "torch", "version": "2.11.0"}], "debug = False\n", "torch/version.py has no __version__"),
        (
            [{"name": "torch", "version": "2.11.0+cu128"}],
            VERSION_PY_CU130,
            "torch's METADATA says 2.11.0+cu128 but torch/version.py says 2.11.0+cu130 (files of two builds mixed)",
        ),
    ],
)
def test_torch_files_and_metadata_must_describe_one_build(distributions, version_py, why):
    assert venv_compare.torch_inconsistency(answer_of(distributions, version_py)) == why


# -- compare ---------------------------------------------------------------------------------------------------
def test_versions_are_compared_exactly_local_tag_included():
    # PEP 440 says 2.11.0 matches 2.11.0+cu130; the build is what this step checks, so they differ.
    assert venv_compare.compare({"torch": "2.11.0"}, {"torch": "2.11.0+cu130"}) == {
        "missing": [],
        "extra": [],
        "wrong": [{"name": "torch", "locked": "2.11.0", "installed": "2.11.0+cu130"}],
    }


def test_compare_sorts_missing_extra_and_wrong_by_name():
    locked = {"torch": "2.11.0+cu128", "six": "1.17.0", "idna": "3.10", "numpy": "2.3.4"}
    installed = {"torch": "2.11.0+cu130", "sglang": "0.5.4", "numpy": "2.3.3", "flashinfer-python": "0.4.1"}
    assert venv_compare.compare(locked, installed, "ignore") == {
        "missing": [{"name": "idna", "locked": "3.10"}, {"name": "six", "locked": "1.17.0"}],
        "extra": [{"name": "flashinfer-python", "installed": "0.4.1"}, {"name": "sglang", "installed": "0.5.4"}],
        "wrong": [
            {"name": "numpy", "locked": "2.3.4", "installed": "2.3.3"},
            {"name": "torch", "locked": "2.11.0+cu128", "installed": "2.11.0+cu130"},
        ],
    }


def test_tooling_is_ignored_unless_locked_or_the_policy_is_exact():
    installed = {"six": "1.17.0", "pip": "25.2", "setuptools": "66.1.1", "wheel": "0.45.1"}
    assert venv_compare.compare({"six": "1.17.0"}, installed, "ignore")["extra"] == []
    assert [e["name"] for e in venv_compare.compare({"six": "1.17.0"}, installed, "exact")["extra"]] == [
        "pip",
        "setuptools",
        "wheel",
    ]
    # A lock that pins one (torch needs setuptools on 3.12) gets it compared like any other.
    wrong = venv_compare.compare({"six": "1.17.0", "setuptools": "80.9.0"}, installed, "ignore")["wrong"]
    assert wrong == [{"name": "setuptools", "locked": "80.9.0", "installed": "66.1.1"}]


@pytest.mark.parametrize(
    ("installed", "locked", "line"),
    [
        ("2.11.0+cu130", "2.11.0+cu128", "torch 2.11.0+cu130 -> 2.11.0+cu128 (build variant cu130, expected cu128)"),
        ("2.11.0", "2.11.0+cu128", "torch 2.11.0 -> 2.11.0+cu128 (no build variant, expected cu128)"),
        ("2.11.0+cu128", "2.11.0", "torch 2.11.0+cu128 -> 2.11.0 (build variant cu128, expected no variant)"),
        ("2.10.0+cu128", "2.11.0+cu128", "torch 2.10.0+cu128 -> 2.11.0+cu128"),
    ],
)
def test_a_wrong_version_names_both_builds_when_they_differ(installed, locked, line):
    assert venv_compare.describe_wrong({"name": "torch", "installed": installed, "locked": locked}) == line


# -- evaluate_step ---------------------------------------------------------------------------------------------
def test_a_venv_that_is_the_lock_has_no_changes_and_equal_diff_sides():
    facts = venv_facts.evaluate_step(SPEC, IN_SPEC, {}, CONTEXT)
    assert (facts["changes"], facts["problems"], facts["pending"]) == ([], [], False)
    assert (facts["missing"], facts["extra"], facts["wrong"], facts["broken"]) == ([], [], [], [])
    assert facts["diff"]["before"] == facts["diff"]["after"]
    assert "torch==2.11.0+cu128\n" in facts["diff"]["after"]
    assert facts["torch"] == {
        "version": "2.11.0+cu128",
        "variant": "cu128",
        "cuda": "12.8",
        "git_version": "70d99e998b4955e0049d13a9ba1d3e2e1ac7a3e6",
    }
    assert facts["lock"] == {
        "count": 26,
        "torch": "2.11.0+cu128",
        "indexes": ["https://pypi.org/simple", "https://download.pytorch.org/whl/cu128"],
        "torch_index": "https://download.pytorch.org/whl/cu128",
    }
    assert (facts["path"], facts["exists"], facts["python"], facts["expected_python"]) == (PATH, True, "3.11", "3.11")


def test_the_facts_have_the_documented_keys():
    facts = venv_facts.evaluate_step(SPEC, IN_SPEC, {}, CONTEXT)
    assert sorted(facts) == sorted(
        [
            "path",
            "exists",
            "python",
            "expected_python",
            "installed",
            "torch",
            "lock",
            "missing",
            "extra",
            "wrong",
            "broken",
            "changes",
            "problems",
            "diff",
            "pending",
            "needs_window",
            "in_use",
            "ending_pids",
            "rebuild",
            "uv_installed",
            "prune",
            "prune_kept",
            "keep",
        ]
    )
    json.dumps(facts)  # facts travel as ansible_facts: plain JSON


def test_a_polluted_venv_names_every_difference():
    facts = venv_facts.evaluate_step(SPEC, POLLUTED, {}, CONTEXT)
    assert facts["changes"] == [
        "numpy 2.3.3 -> 2.3.4",
        "torch 2.11.0+cu130 -> 2.11.0+cu128 (build variant cu130, expected cu128)",
        "triton 3.6.0 -> 3.5.0",
        "install nvidia-cuda-cupti-cu12 12.8.90 (missing)",
        "install nvidia-cuda-nvrtc-cu12 12.8.93 (missing)",
        "install nvidia-cuda-runtime-cu12 12.8.90 (missing)",
        "install nvidia-cufft-cu12 11.3.3.83 (missing)",
        "install nvidia-cufile-cu12 1.13.1.3 (missing)",
        "install nvidia-curand-cu12 10.3.9.90 (missing)",
        "install nvidia-cusolver-cu12 11.7.3.90 (missing)",
        "install nvidia-cusparse-cu12 12.5.8.93 (missing)",
        "install nvidia-cusparselt-cu12 0.7.1 (missing)",
        "install nvidia-nccl-cu12 2.27.5 (missing)",
        "install nvidia-nvjitlink-cu12 12.8.93 (missing)",
        "install nvidia-nvshmem-cu12 3.3.20 (missing)",
        "install nvidia-nvtx-cu12 12.8.90 (missing)",
        "remove cuda-bindings 13.0.3 (not in the lock)",
        "remove cuda-pathfinder 1.3.2 (not in the lock)",
        "remove flashinfer-python 0.4.1 (not in the lock)",
        "remove nvidia-cublas 13.0.0.19 (not in the lock)",
        "remove nvidia-cuda-runtime 13.0.48 (not in the lock)",
        "remove nvidia-cudnn-cu13 9.13.0.50 (not in the lock)",
        "remove nvidia-nccl-cu13 2.27.7 (not in the lock)",
        "remove sglang 0.5.4 (not in the lock)",
        "remove tilelang 0.1.6 (not in the lock)",
    ]
    assert (facts["pending"], facts["problems"]) == (True, [])
    assert facts["torch"]["variant"] == "cu130"
    # The diff: the venv's exact versions (torch's build from version.py), pip left out (tooling: ignore).
    before = facts["diff"]["before"].splitlines()
    assert "torch==2.11.0+cu130" in before
    assert "jinja2==3.1.6" in before
    assert not [line for line in before if line.startswith("pip==")]
    assert before == sorted(before)
    assert facts["diff"]["after"] == venv_compare.freeze_lines(LOCKED)


def test_the_tooling_policy_exact_counts_pip_of_a_polluted_venv():
    facts = venv_facts.evaluate_step(dict(SPEC, tooling="exact"), POLLUTED, {}, CONTEXT)
    assert "remove pip 25.2 (not in the lock)" in facts["changes"]
    assert "pip==25.2" in facts["diff"]["before"].splitlines()


def test_a_missing_venv_is_created_from_the_whole_lock():
    facts = venv_facts.evaluate_step(SPEC, ABSENT, {}, CONTEXT)
    assert facts["changes"] == [f"create venv at {PATH} (python 3.11, 26 distributions from the lock)"]
    assert (facts["pending"], facts["exists"], facts["installed"], facts["torch"]) == (True, False, {}, None)
    assert len(facts["missing"]) == 26
    assert facts["diff"] == {"before": "", "after": venv_compare.freeze_lines(LOCKED)}


def test_a_directory_that_is_not_a_venv_is_replaced():
    facts = venv_facts.evaluate_step(dict(SPEC, python_version=None), dict(ABSENT, directory=True), {}, CONTEXT)
    assert facts["changes"] == [
        f"replace {PATH}, a directory without pyvenv.cfg (moved aside), by a venv: python 3.11, 26 distributions "
        "from the lock"
    ]


def test_a_venv_of_another_python_minor_is_rebuilt():
    answer = dict(IN_SPEC, python="3.12")
    facts = venv_facts.evaluate_step(SPEC, answer, {}, CONTEXT)
    assert facts["changes"] == [f"rebuild venv at {PATH}: python 3.12, expected 3.11"]
    assert (facts["pending"], facts["expected_python"]) == (True, "3.11")


def test_python_comes_from_the_spec_before_the_lock_and_is_unchecked_without_either():
    lock_without_header = "six==1.17.0\n"
    answer = answer_of([{"name": "six", "version": "1.17.0"}], None, python="3.12")
    assert venv_facts.evaluate_step(dict(SPEC, lock=lock_without_header), answer, {}, CONTEXT)["changes"] == []
    facts = venv_facts.evaluate_step(dict(SPEC, lock=lock_without_header, python_version="3.11"), answer, {}, CONTEXT)
    assert facts["changes"] == [f"rebuild venv at {PATH}: python 3.12, expected 3.11"]


def test_a_venv_whose_interpreter_is_gone_is_rebuilt():
    answer = dict(IN_SPEC, interpreter={"path": "/root/.pyenv/versions/3.11.7/bin/python3.11", "exists": False})
    facts = venv_facts.evaluate_step(SPEC, answer, {}, CONTEXT)
    assert facts["changes"] == [
        f"rebuild venv at {PATH}: its interpreter /root/.pyenv/versions/3.11.7/bin/python3.11 is gone"
    ]


def test_broken_records_duplicates_and_mixed_torch_files_are_drift():
    distributions = [*IN_SPEC["distributions"], {"name": "numpy", "version": "2.3.3"}]
    answer = dict(
        IN_SPEC, distributions=distributions, broken=[{"record": "six-1.17.0.dist-info", "reason": "no METADATA"}]
    )
    answer["torch_version_py"] = dict(answer["torch_version_py"], version="2.10.0+cu128")
    facts = venv_facts.evaluate_step(SPEC, answer, {}, CONTEXT)
    assert facts["changes"] == [
        f"rebuild venv at {PATH}: six-1.17.0.dist-info is broken (no METADATA)",
        f"rebuild venv at {PATH}: numpy is installed 2 times (2.3.4, 2.3.3)",
        f"rebuild venv at {PATH}: torch's METADATA says 2.11.0+cu128 but torch/version.py says 2.10.0+cu128 (files "
        "of two builds mixed)",
        "numpy 2.3.3, 2.3.4 -> 2.3.4",
    ]
    assert facts["pending"] is True


def test_what_the_probe_could_not_read_is_a_problem_and_nothing_is_pending():
    answer = dict(POLLUTED, errors=["stopped after 60 s having read 10 of 300 records in /opt/venvs/train/..."])
    facts = venv_facts.evaluate_step(SPEC, answer, {}, CONTEXT)
    assert facts["problems"] == [
        "CT 200 on pve1: the training venv probe could not read everything: stopped after 60 s having read 10 of "
        "300 records in /opt/venvs/train/..."
    ]
    assert facts["changes"]
    assert facts["pending"] is False


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (None, "answered no object"),
        ({k: v for k, v in IN_SPEC.items() if k != "distributions"}, "answered no 'distributions' (list)"),
        (dict(IN_SPEC, exists="yes"), "answered no 'exists' (bool)"),
        (dict(IN_SPEC, distributions=[{"name": "six"}]), "a distribution without name/version"),
        (dict(IN_SPEC, torch_version_py="2.11.0"), "torch_version_py that is not an object"),
        (dict(IN_SPEC, broken=["six"]), "a broken record that is not an object"),
    ],
)
def test_an_answer_that_is_not_the_probes_is_a_clear_error(answer, message):
    with pytest.raises(VenvError, match=re.escape(message)) as raised:
        venv_facts.evaluate_step(SPEC, answer, {}, CONTEXT)
    assert raised.value.kind == "probe"


# -- the spec and the fact-pass interface ----------------------------------------------------------------------
def test_the_spec_validates_with_ansible_and_fills_defaults():
    result = ArgumentSpecValidator(venv_facts.SPEC).validate({"lock": LOCK})
    assert result.error_messages == []
    assert result.validated_parameters == {
        "path": "/opt/venvs/train",
        "lock": LOCK,
        "lock_from_repo": None,
        "python_version": None,
        "tooling": "ignore",
        "unattended": False,
        "keep": None,
        "unattended_keep": 3,
        "uv": "uv",
        "uv_wheel": None,
    }
    # Exactly one of lock and lock_from_repo: check_spec says which (the spec alone cannot).
    assert ArgumentSpecValidator(venv_facts.SPEC).validate({}).error_messages == []
    assert venv_facts.check_spec(dict(venv_facts.SPEC_DEFAULTS)).startswith("no lock: give training_venv_lock_file")
    assert (
        "tooling" in ArgumentSpecValidator(venv_facts.SPEC).validate({"lock": LOCK, "tooling": "x"}).error_messages[0]
    )


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({}, ""),
        ({"python_version": "3.11"}, ""),
        (
            {"python_version": "3.12"},
            "python_version is 3.12 but the lock was compiled for 3.11 (--python-version in its header)",
        ),
        ({"python_version": "python3.11"}, "python_version is 'python3.11'; expected a minor version like '3.11'"),
        ({"lock": "torch>=2\n"}, "the lock, line 1: `torch>=2` is not an exact pin"),
    ],
)
def test_check_spec_names_settings_that_cannot_work(changed, message):
    assert venv_facts.check_spec(dict(SPEC, **changed)).startswith(message)
    assert bool(venv_facts.check_spec(dict(SPEC, **changed))) == bool(message)


def test_the_step_plugs_into_the_registry():
    assert venv_facts.NAME == "training_venv"
    assert probe_name(venv_facts.PROBE) == venv_facts.NAME
    assert venv_facts.probe_payload(SPEC, 30) == {
        "path": "/opt/venvs/train",
        "timeout": 30,
        "uv": "uv",
        "python": "3.11",
    }
    assert venv_facts.read_node(SPEC, None, IN_SPEC, CONTEXT) == {}


# -- the probe part's parsers ----------------------------------------------------------------------------------
def test_version_py_is_parsed_without_exec():
    assert venv_probe.parse_torch_version_py(VERSION_PY_CU130) == {
        "version": "2.11.0+cu130",
        "cuda": "13.0",
        "git_version": "70d99e998b4955e0049d13a9ba1d3e2e1ac7a3e6",
        "hip": None,
        "rocm": None,
        "xpu": None,
        "debug": False,
    }
    older = "__version__ = \"2.5.1+cu124\"\ndebug = False\ncuda = '12.4'\ngit_version = 'a8d6afb'\nhip = None\n"
    assert venv_probe.parse_torch_version_py(older) == {
        "version": "2.5.1+cu124",
        "cuda": "12.4",
        "git_version": "a8d6afb",
        "hip": None,
        "rocm": None,
        "xpu": None,
        "debug": False,
    }
    assert venv_probe.parse_torch_version_py("import os\nos.system('reboot')\n")["version"] is None


@pytest.mark.parametrize("source", ["True", "None", "2.11", "get_version()", "'2.11.0' + '+cu128'"])
def test_a_version_that_is_no_string_literal_is_no_version_and_fails_nothing_on_the_node(source):
    """A version.py the target holds may say anything: what is compared as a version is a string or None, so the
    venv step finds a torch without a version (and rebuilds), never a traceback in the module."""
    text = f"__version__ = {source}\ncuda = '12.8'\n"
    assert venv_probe.parse_torch_version_py(text)["version"] is None
    answer = answer_of([{"name": "torch", "version": "2.11.0"}], text)
    assert venv_compare.torch_inconsistency(answer) == "torch/version.py has no __version__"
    assert venv_compare.installed_versions(answer) == {"torch": "2.11.0"}


# -- the probe part against real venvs -------------------------------------------------------------------------
def uv(*args):
    if UV is None:
        unavailable("uv is not installed (make setup installs it into .venv)")
    return subprocess.run([UV, *map(str, args)], capture_output=True, text=True, env=UV_ENV, check=False)


def make_venv(path, python=sys.executable):
    done = uv("venv", "--quiet", "--python", python, path)
    assert done.returncode == 0, done.stderr
    return path


def site_packages(venv):
    (found,) = glob.glob(str(venv / "lib" / "python*" / "site-packages"))
    return Path(found)


def probe(venv, timeout=60):
    return venv_probe.probe({"path": str(venv), "timeout": timeout})


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def build_wheel(directory, name, version, files):
    """A pure-python wheel ``name-version-py3-none-any.whl`` holding ``files`` ({path: text}) in ``directory``."""
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


def fake_torch_venv(tmp_path, metadata_version, version_py):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    # Importing this torch fails: the probe must never import it.
    files = {"torch/__init__.py": "raise ImportError('the probe imported torch')\n", "torch/version.py": version_py}
    build_wheel(wheels, "torch", metadata_version, files)
    venv = make_venv(tmp_path / "venv")
    done = uv(
        "pip",
        "install",
        "--quiet",
        "--python",
        venv,
        "--no-index",
        "--find-links",
        wheels,
        f"torch=={metadata_version}",
    )
    assert done.returncode == 0, done.stderr
    return venv


def test_no_venv_and_a_directory_that_is_not_one(tmp_path):
    answer = probe(tmp_path / "absent")
    assert set(answer.pop("build")) == set(venv_compare.BUILD_TYPES)  # what a build would use (tests below)
    assert answer == {
        "path": str(tmp_path / "absent"),
        "exists": False,
        "directory": False,
        "python": None,
        "pyvenv": None,
        "interpreter": None,
        "lib_pythons": [],
        "site_packages": None,
        "distributions": [],
        "broken": [],
        "hooks": [],
        "unowned": [],
        "torch_version_py": None,
        "versions": [],
        "errors": [],
        "unsafe": None,
    }
    assert (probe(tmp_path)["exists"], probe(tmp_path)["directory"]) == (False, True)


def test_a_uv_venv_with_packages_from_pypi(tmp_path):
    venv = make_venv(tmp_path / "venv")
    done = uv("pip", "install", "--quiet", "--python", venv, "six==1.17.0", "idna==3.10")
    if done.returncode != 0:
        unavailable(f"PyPI cannot be reached: {done.stderr.strip().splitlines()[-1:]}")
    answer = probe(venv)
    assert answer["exists"] is True
    assert answer["python"] == "{}.{}".format(*sys.version_info[:2])
    assert answer["pyvenv"]["uv"]
    assert answer["interpreter"]["exists"] is True
    assert sorted((d["name"], d["version"], d["installer"], d["direct_url"]) for d in answer["distributions"]) == [
        ("idna", "3.10", "uv", False),
        ("six", "1.17.0", "uv", False),
    ]
    assert (answer["torch_version_py"], answer["broken"], answer["errors"]) == (None, [], [])
    facts = venv_facts.evaluate_step(
        dict(SPEC, lock="idna==3.10\nsix==1.17.0\n", python_version=answer["python"]), answer, {}, CONTEXT
    )
    assert (facts["changes"], facts["pending"]) == ([], False)


def test_a_venv_made_by_python_venv_names_its_python_with_version(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    answer = probe(venv)
    assert "version" in answer["pyvenv"]
    assert "uv" not in answer["pyvenv"]
    assert answer["python"] == "{}.{}".format(*sys.version_info[:2])
    assert answer["distributions"] == []


def test_the_python_minor_comes_from_lib_when_pyvenv_cfg_names_none(tmp_path):
    venv = make_venv(tmp_path / "venv")
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    assert probe(venv)["python"] == "{}.{}".format(*sys.version_info[:2])


@pytest.mark.parametrize(
    ("config", "libs", "minor", "found"),
    [
        ("home = /usr/bin\nversion = 3.11.2\n", ["python3.10", "python3.11"], "3.11", True),  # Python's venv
        ("version_info = 3.12.1.final.0\n", ["python3.12"], "3.12", True),  # uv, virtualenv
        ("version = 3.10.4\nversion = 3.11.2\n", ["python3.10", "python3.11"], "3.11", True),  # a later line wins
        ("home = /usr/bin\n", ["python3.11"], "3.11", True),  # none named: the only one
        ("home = /usr/bin\n", ["python3.10", "python3.11"], None, False),  # which one? neither
        ("version = 3.11.2\n", ["python3.10"], "3.11", False),  # never another minor's: its python would not import it
        ("home = /usr/bin\n", ["python3.11", "python3.11.bak", "python3", "pythonX.Y"], "3.11", True),  # one minor
        ("version = 3.1l\n", ["python3.11"], "3.1", False),  # what the line says, not a guess
        ("version = 3.11\n", [], "3.11", False),
        ("version = 3.11\n", ["python3.11/no-site-packages"], "3.11", False),  # lib/python3.11 without one
    ],
)
def test_one_reading_of_which_site_packages_a_venvs_python_imports_from(tmp_path, config, libs, minor, found):
    """verify's, compile_cache's and the venv step's probes, and the build script, all read it so."""
    venv = tmp_path / "venv"
    venv.mkdir()
    for name in libs:
        (venv / "lib" / name / ("" if "/" in name else "site-packages")).mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(config)
    named = ct_venv.config_minor(ct_venv.read_config(config))
    site, minors, looked_for = ct_venv.site_packages(str(venv), named)
    assert minors == sorted({n[6:10] for n in libs if n[6:10] in ("3.10", "3.11", "3.12") and n[10:11] in ("", "/")})
    assert looked_for == minor
    assert site == (str(venv / "lib" / f"python{minor}" / "site-packages") if found else None)


def test_a_dangling_interpreter_and_a_missing_site_packages_are_reported(tmp_path):
    venv = make_venv(tmp_path / "venv")
    (venv / "bin" / "python").unlink()
    (venv / "bin" / "python").symlink_to(tmp_path / "gone" / "python3.11")
    shutil.rmtree(venv / "lib")
    answer = probe(venv)
    assert answer["interpreter"] == {"path": str(tmp_path / "gone" / "python3.11"), "exists": False}
    minor = "{}.{}".format(*sys.version_info[:2])
    assert answer["broken"] == [{"record": f"lib/python{minor}/site-packages", "reason": "missing"}]
    assert answer["errors"] == []


def test_broken_records_egg_info_and_hundreds_of_distributions(tmp_path):
    venv = make_venv(tmp_path / "venv")
    packages = site_packages(venv)
    long_description = "\n" + "All work and no play.\n" * 200  # the body is never read
    for number in range(500):
        record = packages / f"pkg{number}-1.{number}.dist-info"
        record.mkdir()
        (record / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: pkg{number}\nVersion: 1.{number}\n{long_description}"
        )
    (packages / "broken-1.0.dist-info").mkdir()
    (packages / "nameless-1.0.dist-info").mkdir()
    (packages / "nameless-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\n\nName: nameless\n")
    (packages / "legacy-0.1.egg-info").mkdir()
    (packages / "legacy-0.1.egg-info" / "PKG-INFO").write_text("Metadata-Version: 1.0\nName: legacy\nVersion: 0.1\n")
    (packages / "oldfile-0.2-py3.11.egg-info").write_text("Metadata-Version: 1.1\nName: oldfile\nVersion: 0.2\n")
    (packages / "noinfo-0.3.egg-info").mkdir()
    answer = probe(venv)
    names = {d["name"]: d["version"] for d in answer["distributions"]}
    assert len(names) == 502
    assert (names["pkg499"], names["legacy"], names["oldfile"]) == ("1.499", "0.1", "0.2")
    assert answer["broken"] == [
        {"record": "broken-1.0.dist-info", "reason": "no METADATA"},
        {"record": "nameless-1.0.dist-info", "reason": "its metadata has no Name or no Version"},
        {"record": "noinfo-0.3.egg-info", "reason": "no PKG-INFO"},
    ]
    assert answer["errors"] == []
    stopped = probe(venv, timeout=0)
    assert stopped["errors"] == [f"stopped after 0 s having read 0 of 505 records in {packages}"]


@pytest.mark.parametrize(
    ("metadata_version", "version_py", "exact", "variant"),
    [
        ("2.11.0+cu128", VERSION_PY_CU128, "2.11.0+cu128", "cu128"),  # the cu128 index's wheel
        ("2.11.0", VERSION_PY_CU130, "2.11.0+cu130", "cu130"),  # PyPI's wheel
    ],
)
def test_a_torch_wheel_installed_by_uv_is_read_from_its_files(tmp_path, metadata_version, version_py, exact, variant):
    venv = fake_torch_venv(tmp_path, metadata_version, version_py)
    answer = probe(venv)
    assert [(d["name"], d["version"], d["installer"]) for d in answer["distributions"]] == [
        ("torch", metadata_version, "uv")
    ]
    assert answer["torch_version_py"]["version"] == exact
    installed = venv_compare.installed_versions(answer)
    assert installed == {"torch": exact}
    assert torch_build.variant(installed["torch"]) == variant
    python = answer["python"]
    facts = venv_facts.evaluate_step(
        dict(SPEC, lock="torch==2.11.0+cu128\n", python_version=python), answer, {}, CONTEXT
    )
    expected = (
        [] if variant == "cu128" else ["torch 2.11.0+cu130 -> 2.11.0+cu128 (build variant cu130, expected cu128)"]
    )
    assert facts["changes"] == expected


@pytest.mark.parametrize("minor", ["3.9", "3.10"])
def test_the_probe_runs_as_the_fact_pass_ships_it_on_old_pythons(tmp_path, minor):
    python = other_python(minor)
    if python is None:
        unavailable(f"no python{minor} here")
    venv = fake_torch_venv(tmp_path, "2.11.0", VERSION_PY_CU130)
    payload = venv_facts.probe_payload(dict(SPEC, path=str(venv)), 30)
    answer = run_probes_program(python, {venv_facts.NAME: (venv_probe, payload)})[venv_facts.NAME]["answer"]
    assert answer.pop("build")["own"] == minor  # what a build would use is told by the CT's python itself
    here = json.loads(json.dumps(probe(venv)))
    here.pop("build")
    assert answer == here
    assert answer["torch_version_py"]["version"] == "2.11.0+cu130"


@pytest.fixture(scope="module")
def cpu_torch_venv(tmp_path_factory):
    """A python 3.11 uv venv holding the real CPU torch wheel of /opt/wheels, without its dependencies."""
    if not TORCH_WHEEL.exists():
        unavailable(f"{TORCH_WHEEL} is absent")
    python = other_python("3.11")
    if python is None:
        unavailable("no python3.11 here (the wheel is cp311)")
    venv = make_venv(tmp_path_factory.mktemp("torch") / "venv", python)
    done = uv("pip", "install", "--quiet", "--python", venv, "--no-deps", TORCH_WHEEL)
    assert done.returncode == 0, done.stderr
    return venv


def test_the_real_cpu_torch_wheel_is_read_as_its_build(cpu_torch_venv):
    answer = probe(cpu_torch_venv)
    assert answer["python"] == "3.11"
    torch = [d for d in answer["distributions"] if d["name"] == "torch"]
    # Installed from a path: uv records a direct_url.json.
    assert torch == [{"name": "torch", "version": "2.13.0+cpu", "installer": "uv", "direct_url": True}]
    assert answer["torch_version_py"]["version"] == "2.13.0+cpu"
    assert answer["torch_version_py"]["cuda"] is None
    assert len(answer["torch_version_py"]["git_version"]) == 40
    facts = venv_facts.evaluate_step(dict(SPEC, lock="torch==2.13.0+cpu\n", python_version="3.11"), answer, {}, CONTEXT)
    assert (facts["changes"], facts["torch"]["variant"]) == ([], "cpu")
    facts = venv_facts.evaluate_step(SPEC, answer, {}, CONTEXT)
    assert "torch 2.13.0+cpu -> 2.11.0+cu128 (build variant cpu, expected cu128)" in facts["changes"]


# -- "in spec" means the venv imports only what the lock says (issue 25 item 9) ----------------------------------
def install_wheels(tmp_path, venv, *wheels):
    """Install hand-made wheels (``(name, version, files)``) into ``venv`` with uv, from a local directory."""
    directory = tmp_path / "wheels"
    directory.mkdir(exist_ok=True)
    for name, version, files in wheels:
        build_wheel(directory, name, version, files)
    pins = [f"{name}=={version}" for name, version, _ in wheels]
    done = uv("pip", "install", "--quiet", "--python", venv, "--no-index", "--find-links", directory, *pins)
    assert done.returncode == 0, done.stderr
    return venv


def facts_of(venv, lock):
    answer = probe(venv)
    return venv_facts.evaluate_step(dict(SPEC, lock=lock, python_version=answer["python"]), answer, {}, CONTEXT)


CLEAN = ("six", "1.17.0", {"six.py": "x = 1\n"})
# A dist that ships a .pth legitimately (like setuptools' distutils-precedence.pth or an editable install's).
WITH_PTH = ("helper", "1.0", {"helper/__init__.py": "", "helper-hook.pth": "import helper\n"})


def test_a_venv_of_locked_wheels_and_the_pth_their_records_list_is_in_spec(tmp_path):
    venv = install_wheels(tmp_path, make_venv(tmp_path / "venv"), CLEAN, WITH_PTH)
    answer = probe(venv)
    assert answer["hooks"] == [{"entry": "helper-hook.pth", "owners": ["helper"], "text": None}]
    assert answer["unowned"] == []
    facts = facts_of(venv, "helper==1.0\nsix==1.17.0\n")
    assert (facts["changes"], facts["pending"]) == ([], False)


def test_a_pth_whose_owner_is_not_in_the_lock_is_drift_naming_the_owner(tmp_path):
    venv = install_wheels(tmp_path, make_venv(tmp_path / "venv"), CLEAN, WITH_PTH)
    facts = facts_of(venv, "six==1.17.0\n")
    assert facts["changes"] == [
        f"rebuild venv at {PATH}: helper-hook.pth runs code at start-up and only helper (not in the lock) lists it",
        "remove helper 1.0 (not in the lock)",
    ]


def test_include_system_site_packages_is_drift(tmp_path):
    venv = install_wheels(tmp_path, make_venv(tmp_path / "venv"), CLEAN)
    config = venv / "pyvenv.cfg"
    config.write_text(config.read_text().replace("include-system-site-packages = false", "") + "")
    assert facts_of(venv, "six==1.17.0\n")["changes"] == []
    config.write_text(config.read_text() + "include-system-site-packages = True\n")
    assert facts_of(venv, "six==1.17.0\n")["changes"] == [
        f"rebuild venv at {PATH}: pyvenv.cfg sets include-system-site-packages = true (the system's packages are "
        "importable beside the lock's)"
    ]


@pytest.mark.parametrize(
    ("planted", "line"),
    [
        (
            {"evil.pth": "import os; os.system('id')\n"},
            "evil.pth runs code at start-up and no distribution's RECORD lists it",
        ),
        (
            {"sitecustomize.py": "import os\n"},
            "sitecustomize.py is imported at start-up and no distribution's RECORD lists it",
        ),
        (
            {"usercustomize/__init__.py": ""},
            "usercustomize is imported at start-up and no distribution's RECORD lists it",
        ),
        ({"hack/__init__.py": "import os\n"}, "hack is importable and no distribution's RECORD owns it"),
        ({"stray.py": ""}, "stray.py is importable and no distribution's RECORD owns it"),
        (
            {"fast.cpython-311-x86_64-linux-gnu.so": ""},
            "fast.cpython-311-x86_64-linux-gnu.so is importable and no distribution's RECORD owns it",
        ),
        ({"namespace/sub/mod.py": ""}, "namespace is importable and no distribution's RECORD owns it"),
    ],
)
def test_what_runs_or_imports_and_no_record_owns_is_drift(tmp_path, planted, line):
    venv = install_wheels(tmp_path, make_venv(tmp_path / "venv"), CLEAN)
    for relative, text in planted.items():
        target = site_packages(venv) / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    facts = facts_of(venv, "six==1.17.0\n")
    assert facts["changes"] == [f"rebuild venv at {PATH}: {line}"]
    assert facts["pending"] is True


def test_files_no_python_imports_and_bytecode_caches_are_not_drift(tmp_path):
    venv = install_wheels(tmp_path, make_venv(tmp_path / "venv"), CLEAN)
    (site_packages(venv) / "README.txt").write_text("This directory exists so that 3rd party packages...\n")
    (site_packages(venv) / "__pycache__").mkdir(exist_ok=True)
    (site_packages(venv) / "__pycache__" / "six.cpython-311.pyc").write_bytes(b"")
    assert facts_of(venv, "six==1.17.0\n")["changes"] == []


def test_setuptools_seeded_by_python_venv_may_keep_its_pth_while_tooling_is_ignored(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    answer = probe(venv)
    assert answer["unowned"] == []
    facts = venv_facts.evaluate_step(
        dict(SPEC, lock="six==1.17.0\n", python_version=answer["python"]), answer, {}, CONTEXT
    )
    assert facts["changes"] == ["install six 1.17.0 (missing)"]


@pytest.mark.parametrize(
    ("creator", "pth", "drift"),
    [
        ("virtualenv = 20.29.1", "import _virtualenv", []),
        ("uv = 0.4.30", "import _virtualenv\n", []),
        ("", "import _virtualenv", ["_virtualenv.pth runs code", "_virtualenv.py is importable"]),
        ("virtualenv = 20.29.1", "import _virtualenv; import os", ["_virtualenv.pth runs code"]),
    ],
)
def test_what_virtualenv_writes_itself_is_in_spec_only_as_it_writes_it(tmp_path, creator, pth, drift):
    venv = install_wheels(tmp_path, make_venv(tmp_path / "venv"), CLEAN)
    config = venv / "pyvenv.cfg"
    config.write_text(re.sub(r"(?m)^uv = .*\n", "", config.read_text()) + (f"{creator}\n" if creator else ""))
    (site_packages(venv) / "_virtualenv.pth").write_text(pth)
    (site_packages(venv) / "_virtualenv.py").write_text("# virtualenv's distutils patch\n")
    changes = facts_of(venv, "six==1.17.0\n")["changes"]
    assert [c.split(": ", 1)[1].split(" at start-up")[0].split(" and ")[0] for c in changes] == drift


def test_a_record_lists_quoted_and_absolute_paths_and_paths_outside_site_packages():
    lines = [
        "torch/__init__.py,sha256=ab,12\n",
        '"odd,name/__init__.py",sha256=cd,3\n',
        "../../../bin/torchrun,,\n",
        "/opt/venvs/train/lib/python3.11/site-packages/abs.py,,\n",
        "/usr/lib/elsewhere.py,,\n",
        "six.py,,\n",
        "\n",
    ]
    tops = venv_probe.record_tops("".join(lines), "/opt/venvs/train/lib/python3.11/site-packages")
    assert tops == {"torch", "odd,name", "abs.py", "six.py"}


def test_names_the_venv_chose_are_escaped_in_changes_and_the_diff(tmp_path):
    venv = install_wheels(tmp_path, make_venv(tmp_path / "venv"), CLEAN)
    (site_packages(venv) / "evil\x1b[2J.pth").write_text("import os\n")
    record = site_packages(venv) / "bad\nline-1.0.dist-info"
    record.mkdir()
    (record / "METADATA").write_text("Metadata-Version: 2.1\nName: bad\u202eline\nVersion: 1.0\x1b[31m\n")
    facts = facts_of(venv, "six==1.17.0\n")
    assert facts["changes"] == [
        f"rebuild venv at {PATH}: evil\\x1b[2J.pth runs code at start-up and no distribution's RECORD lists it",
        "remove bad\\u202eline 1.0\\x1b[31m (not in the lock)",
    ]
    assert "bad\\u202eline==1.0\\x1b[31m\n" in facts["diff"]["before"]
    assert all("\x1b" not in change and "\n" not in change for change in facts["changes"])


# -- retention: what the fact pass predicts (issue 25 item 13) ---------------------------------------------------
VERSIONS = [f"{PATH}.2026120{day}T101500Z" for day in range(1, 6)]


@pytest.mark.parametrize(
    ("keep", "unattended", "expected"),
    [(None, False, None), (None, True, 3), (5, True, 5), (2, False, 2)],
)
def test_keep_is_all_when_attended_and_three_when_unattended_unless_set(keep, unattended, expected):
    assert venv_facts.effective_keep(dict(SPEC, keep=keep, unattended=unattended)) == expected


def test_plan_prune_counts_the_current_one_and_removes_the_oldest():
    assert venv_facts.plan_prune(VERSIONS, VERSIONS[-1], 3) == VERSIONS[:2]
    assert venv_facts.plan_prune(VERSIONS, f"{PATH}.<new>", 3) == VERSIONS[:3]  # a rebuild's version counts
    assert venv_facts.plan_prune(VERSIONS, VERSIONS[1], 1) == [VERSIONS[0], *VERSIONS[2:]]
    assert venv_facts.plan_prune(VERSIONS, VERSIONS[-1], None) == []
    assert venv_facts.plan_prune(VERSIONS[:2], VERSIONS[1], 3) == []


def test_an_in_spec_venv_with_old_versions_beyond_keep_is_pending_unattended_only():
    answer = dict(IN_SPEC, versions=VERSIONS, real_path=VERSIONS[-1])
    attended = venv_facts.evaluate_step(SPEC, answer, {}, CONTEXT)
    assert (attended["changes"], attended["pending"], attended["prune"]) == ([], False, [])
    facts = venv_facts.evaluate_step(dict(SPEC, unattended=True), answer, {}, CONTEXT)
    assert facts["changes"] == [
        f"remove old venv version {VERSIONS[0]} (keep 3: the current one and the 2 newest old ones stay)",
        f"remove old venv version {VERSIONS[1]} (keep 3: the current one and the 2 newest old ones stay)",
    ]
    assert (facts["pending"], facts["rebuild"], facts["keep"]) == (True, False, 3)
    assert facts["diff"]["before"] == facts["diff"]["after"]


def test_a_version_a_process_uses_is_kept_unless_the_gpu_step_ends_that_process():
    answer = dict(IN_SPEC, versions=VERSIONS, real_path=VERSIONS[-1])
    job = {"pid": 516, "ns_pid": 41, "name": "bash", "command": "bash", "how": "cwd", "file": VERSIONS[0]}
    node = {"version_users": {VERSIONS[0]: [job]}}
    facts = venv_facts.evaluate_step(dict(SPEC, unattended=True), answer, node, CONTEXT)
    assert facts["prune"] == [VERSIONS[1]]
    assert facts["prune_kept"] == [{"path": VERSIONS[0], "pids": [516], "reason": "in use"}]
    ending = venv_facts.evaluate_step(dict(SPEC, unattended=True), answer, dict(node, ending=[41]), CONTEXT)
    assert ending["prune"] == VERSIONS[:2]


def test_a_converged_venv_within_keep_costs_no_node_read(monkeypatch):
    monkeypatch.setattr(venv_facts, "processes_running_from", lambda *a, **k: pytest.fail("read the node"))
    answer = dict(IN_SPEC, versions=VERSIONS[-3:], real_path=VERSIONS[-1])
    assert venv_facts.read_node(dict(SPEC, unattended=True), None, answer, CONTEXT) == {}


def test_the_probe_lists_finished_versions_only(tmp_path):
    venv = tmp_path / "train"
    for name in ("train.20261201T101500Z", "train.20261202T101500Z", "train.20261203T101500Z", "train.backup"):
        (tmp_path / name).mkdir()
    (tmp_path / "train.20261203T101500Z" / ".pve-gpu-recover-building").write_text("unfinished\n")
    (tmp_path / "train.20261204T101500Z").symlink_to(tmp_path / "train.backup")
    (tmp_path / "train.20261201T101500Z.lock.txt").write_text("")
    venv.symlink_to("train.20261202T101500Z")
    assert probe(venv)["versions"] == [
        str(tmp_path / "train.20261201T101500Z"),
        str(tmp_path / "train.20261202T101500Z"),
    ]


def test_a_metadata_header_is_read_bounded_whatever_the_target_wrote(tmp_path):
    real = tmp_path / "METADATA"
    real.write_text("Metadata-Version: 2.4\nName: Six\nVersion: 1.17.0\n\n" + "long description\n" * 100000)
    assert ct_venv.metadata_header(real) == {"name": "Six", "version": "1.17.0"}
    endless = tmp_path / "ENDLESS"
    endless.write_text("X" * 20_000_000)  # one line of 20 MB, no newline: never read whole
    assert ct_venv.metadata_header(endless) == {}
    late = tmp_path / "LATE"
    late.write_text("Classifier: x\n" * (ct_venv.HEADER_LINES + 5) + "Name: late\nVersion: 1\n")
    assert ct_venv.metadata_header(late) == {}  # past the bound: unknown, as an unreadable header is
    assert ct_venv.metadata_header(tmp_path / "missing") is None


# -- torch/version.py read line by line (no ``re`` in a CT's fact pass) ----------------------------------------
# The regular expressions the probes used before 2.4.1: the line reader must find the same assignments.
OLD_ASSIGNMENT = re.compile(r"^(\w+)\s*(?::[^=\n]*)?=\s*(.+?)\s*$", re.MULTILINE)
OLD_STRING = re.compile(r"""^(?:'([^'\\]*)'|"([^"\\]*)")$""")


def test_assignments_finds_on_each_line_what_the_old_regular_expression_found():
    """100,000 random lines of the pieces a version.py is made of (and some it is not): every line with a value
    gives the same (name, value) as before; a line whose value is blank gives none (it was a whitespace value)."""
    import random  # noqa: PLC0415

    chooser = random.Random(2026)  # noqa: S311 (reproducible test data, not a secret)
    pieces = ["__version__", "cuda", "x1_", "é", " ", "\t", "=", "==", ":", "Optional[str]", "'2.1'", '"12.8"']
    pieces += ["None", "#", "'a\\'b'", "''", '""', "\x0b", "\x1c", "\xa0", "\r", "٣"]
    for _ in range(100000):
        line = "".join(chooser.choice(pieces) for _ in range(chooser.randint(1, 7)))
        old = [(name, value) for name, value in OLD_ASSIGNMENT.findall(line) if value.strip()]
        assert ct_venv.assignments(line) == old, repr(line)
        for _, value in old:
            match = OLD_STRING.match(value)
            literal = (match.group(1) if match.group(1) is not None else match.group(2)) if match else None
            assert ct_venv.string_literal(value) == literal, repr(value)


def test_every_probe_reads_a_real_torch_version_py_the_same_way():
    from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import (  # noqa: PLC0415
        probe as cache_probe,
    )
    from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import (  # noqa: PLC0415
        probe as verify_probe,
    )

    assert verify_probe.parse_torch_version_py(VERSION_PY_CU130) == {
        "version": "2.11.0+cu130",
        "cuda": "13.0",
        "git_version": venv_probe.parse_torch_version_py(VERSION_PY_CU130)["git_version"],
    }
    cache = cache_probe.parse_torch_version_py(VERSION_PY_CU130)
    venv = venv_probe.parse_torch_version_py(VERSION_PY_CU130)
    assert cache == {key: venv[key] for key in ("version", "cuda", "git_version", "hip")}
    assert cache["hip"] is None
    assert verify_probe.parse_torch_version_py("__version__ = get_version()\ncuda = ''\n") == {
        "version": None,
        "cuda": None,
        "git_version": None,
    }


@pytest.mark.parametrize(
    ("name", "version"),
    [
        ("train.20261207T064401Z", True),
        ("train.20261207T064401Z\n", False),
        ("train.2026120T064401Z", False),
        ("train.20261207t064401Z", False),
        ("train.20261207T064401Z-previous", False),
        ("trainx.20261207T064401Z", False),
        ("other.20261207T064401Z", False),
        ("train.2026120٣T064401Z", True),  # \d was any decimal digit; so is isdecimal()
    ],
)
def test_a_version_name_is_the_base_a_dot_and_a_utc_stamp(name, version):
    assert ct_venv.is_version_name(name, "train") is version


# -- small files the target wrote, read bounded (pyvenv.cfg, torch/version.py, top_level.txt) ------------------
def test_a_small_file_is_read_as_open_read_it_with_universal_newlines(tmp_path):
    path = tmp_path / "pyvenv.cfg"
    path.write_bytes(b"home = /usr/bin\r\nversion = 3.11.2\rinclude-system-site-packages = false\n\xff\n")
    with open(path, encoding="utf-8", errors="replace") as handle:
        assert ct_venv.read_small_text(path) == handle.read()
    assert ct_venv.read_small_text(tmp_path / "missing") is None
    assert ct_venv.read_small_text(tmp_path) is None  # a directory


def test_a_large_file_is_read_up_to_the_limit_only(tmp_path):
    path = tmp_path / "version.py"
    path.write_text("__version__ = '2.11.0+cu128'\n" + "#" * 10_000_000)
    text = ct_venv.read_small_text(path)
    assert len(text) == ct_venv.SMALL_FILE_LIMIT
    assert ct_venv.read_version_py(text, {"__version__": "version"}) == {"version": "2.11.0+cu128"}


def test_a_fifo_in_place_of_a_file_is_not_read_and_never_blocks(tmp_path):
    """A CT user can leave a FIFO where torch/version.py belongs: opening it for reading would wait for a writer."""
    fifo = tmp_path / "version.py"
    os.mkfifo(fifo)
    done = subprocess.run(
        [sys.executable, "-c", f"import venv as ct_venv; print(ct_venv.read_small_text({str(fifo)!r}))"],
        cwd=Path(ct_venv.__file__).parent,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert done.stdout == "None\n"
