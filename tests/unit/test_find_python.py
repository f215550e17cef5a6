"""scripts/find-python: the controller's Python for each end of the supported ansible-core range (README,
Requirements). The low end (3.11+) is the system's python3 so that a fresh Debian 12 needs nothing else; each end
reads its own variable for a Python of the user's choice; a missing one is named with the variable to set."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

FIND = ROOT / "scripts" / "find-python"


def find(*args, **env):
    base = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/nonexistent", "PYENV_ROOT": "/nonexistent"}
    return subprocess.run(
        [str(FIND), *args], env={**base, **env}, capture_output=True, text=True, timeout=60, check=False
    )


def version_of(python):
    done = subprocess.run(
        [python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True, text=True, check=True
    )
    return tuple(int(part) for part in done.stdout.split())


@pytest.mark.skipif(
    not Path("/usr/bin/python3").exists() or version_of("/usr/bin/python3") < (3, 11),
    reason="no system python3 3.11+ here",
)
def test_the_low_end_is_the_systems_python3_alone():
    done = find()
    assert (done.returncode, done.stderr) == (0, "")
    assert version_of(done.stdout.strip()) >= (3, 11)
    assert os.path.realpath(done.stdout.strip()) == os.path.realpath("/usr/bin/python3")


def test_each_end_takes_the_users_python_from_its_own_variable_and_only_if_new_enough():
    mine = sys.executable
    done = find("11", PYTHON=mine)
    assert (done.returncode, done.stdout.strip()) == (0, mine)
    # PYTHON is the low end's: the high end never takes it, and a PYTHON_LATEST too old for it is passed over.
    high = find("12", PYTHON=mine, PYTHON_LATEST=mine)
    if sys.version_info >= (3, 12):
        assert high.stdout.strip() == mine
    else:
        assert high.stdout.strip() != mine


def test_no_python_new_enough_is_named_with_the_variable_to_set():
    done = find("19")
    assert (done.returncode, done.stdout) == (1, "")
    assert "find-python: no working Python 3.19 or newer with venv found" in done.stderr
    assert "or set PYTHON_LATEST=/path/to/python3.19" in done.stderr
    assert find("9").returncode == 2  # below the low end: a usage error
