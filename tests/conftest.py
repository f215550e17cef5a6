"""Make the collection importable as ansible_collections.pve_gpu.recover (collections/ holds a link to this
checkout) and its modules (library/) importable by name."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"

sys.path.insert(0, str(ROOT / "collections"))
sys.path.insert(0, str(ROOT / "library"))


def unavailable(reason):
    """A real-tool test whose tool is missing here: skipped on a developer's machine, a failure under CI (CI=true),
    where `make test` installs every tool the tests need, so a missing one is a defect, not a reason to pass."""
    import os  # noqa: PLC0415 (only when a test lacks its tool)

    import pytest  # noqa: PLC0415

    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: make test must install what this test needs)")
    pytest.skip(reason)


def other_python(minor):
    """An interpreter of Python ``minor`` that runs here (Debian's ``/usr/bin/pythonX.Y``, one on PATH, pyenv's:
    pyenv's shims exist for versions that are not selected), or None. pyenv's are looked for in the user's own home,
    not in $HOME (which tests point at a temporary one)."""
    import glob  # noqa: PLC0415 (only the tests of old Pythons need these)
    import os  # noqa: PLC0415
    import pwd  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    pyenv = sorted(glob.glob(str(home / f".pyenv/versions/{minor}.*/bin/python{minor}")))
    for candidate in filter(None, (f"/usr/bin/python{minor}", shutil.which(f"python{minor}"), *pyenv)):
        if (
            Path(candidate).exists()
            and subprocess.run([candidate, "-c", "pass"], capture_output=True, check=False).returncode == 0
        ):
            return candidate
    return None
