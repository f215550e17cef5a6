"""Make the project's module_utils importable as ansible.module_utils.* and library/ modules importable by name."""

import sys
from pathlib import Path

import ansible.module_utils

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"

ansible.module_utils.__path__.append(str(ROOT / "module_utils"))
sys.path.insert(0, str(ROOT / "library"))


def unavailable(reason):
    """A real-tool test whose tool is missing here: skipped on a developer's machine, a failure under CI (CI=true),
    where `make test` installs every tool the tests need, so a missing one is a defect, not a reason to pass."""
    import os  # noqa: PLC0415 (only when a test lacks its tool)

    import pytest  # noqa: PLC0415

    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: make test must install what this test needs)")
    pytest.skip(reason)
