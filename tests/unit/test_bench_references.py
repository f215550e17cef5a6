# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The benchmarks run by hand, never in make test: what they use of the collection must still exist.

A split that moves a function (training_venv's installed_versions went from facts to compare) broke
bench/venv_check.py unseen until a hardware run; this finds such a reference in seconds, without running a bench.
"""

from __future__ import annotations

import ast
import importlib

import pytest

from tests.conftest import ROOT

OURS = "ansible_collections.pve_gpu.recover"
SCRIPTS = sorted((ROOT / "bench").rglob("*.py")) + sorted((ROOT / "drift").glob("*.py"))


def references(tree):
    """``[(line, module, name)]``: every name a script takes from one of our modules, imported or as ``alias.name``."""
    aliases, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(OURS):
            for alias in node.names:
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                except ImportError:
                    found.append((node.lineno, node.module, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(OURS):
                    aliases[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            found.append((node.lineno, aliases[node.value.id], node.attr))
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_what_a_script_uses_of_the_collection_exists(script):
    missing = [
        f"{script.relative_to(ROOT)}:{line}: {module} has no {name}"
        for line, module, name in references(ast.parse(script.read_text()))
        if not hasattr(importlib.import_module(module), name)
    ]
    assert missing == []


def test_the_check_finds_a_moved_function():
    tree = ast.parse(
        f"from {OURS}.plugins.module_utils.steps.training_venv import facts as venv_facts\n"
        "venv_facts.installed_versions({})\nvenv_facts.evaluate_step\n"
    )
    module = f"{OURS}.plugins.module_utils.steps.training_venv.facts"
    assert sorted(references(tree)) == [(2, module, "installed_versions"), (3, module, "evaluate_step")]
    assert not hasattr(importlib.import_module(module), "installed_versions")
