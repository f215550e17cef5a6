"""The tests' tree mirrors the code's (issue 42): a test of library/<module>.py is tests/unit/library/test_<module>.py
(or test_<module>_<aspect>.py), a test of plugins/<dir>/<module>.py is tests/unit/plugins/<dir>/test_<module>[...].py,
at any depth (plugins/module_utils/ct/, node/, steps/<step>/), and of drift/<module>.py tests/unit/drift/... So a
reader finds a module's tests where its code is, and a test that names no code is found here."""

import pytest

from tests.conftest import ROOT

UNIT = ROOT / "tests" / "unit"
MIRRORED = ("library", "plugins")


def code_of(test):
    """The code file a test file mirrors, or None: the longest module name its name starts with, in the mirrored
    directory (``test_facts_in_use.py`` -> ``facts.py``)."""
    relative = test.relative_to(UNIT)
    code_dir = ROOT / relative.parent
    name = test.stem.removeprefix("test_")
    candidates = [p for p in code_dir.glob("*.py") if name == p.stem or name.startswith(p.stem + "_")]
    return max(candidates, key=lambda p: len(p.stem)) if candidates else None


TESTS = sorted(p for top in MIRRORED for p in (UNIT / top).rglob("test_*.py"))


@pytest.mark.parametrize("test", TESTS, ids=[str(p.relative_to(UNIT)) for p in TESTS])
def test_each_test_file_sits_where_its_code_is_and_is_named_for_it(test):
    assert code_of(test) is not None, f"{test.relative_to(ROOT)} mirrors no code file"


def test_every_test_directory_is_a_package():
    """Test files share names across directories (test_facts.py of each step): each directory is a package."""
    missing = [str(d.relative_to(ROOT)) for d in sorted({p.parent for p in TESTS}) if not (d / "__init__.py").is_file()]
    assert missing == []


def test_no_module_utils_module_lies_outside_the_three_groups():
    """Code is grouped by where it runs: node side, shipped into the target, the steps."""
    utils = ROOT / "plugins" / "module_utils"
    assert sorted(p.name for p in utils.iterdir() if p.name != "__pycache__") == ["ct", "node", "steps"]
