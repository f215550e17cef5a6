# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The runner's one exception (main() prints it and exits 1), and what it says when a package it needs is missing."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

# The collection's root: a checkout, or an installed copy (both hold requirements/ee.txt and meta/runtime.yml).
ROOT = Path(__file__).resolve().parent.parent
# What the runner imports beyond ansible-core: the lines of requirements/ee.txt that name them.
RUNNER_PACKAGES = ("ansible-runner", "prometheus-client")


class DriftError(Exception):
    """One sentence: what is wrong, what was found, what to do. main() prints it and exits 1."""


class LockHeld(DriftError):
    pass


def requirement(name, root=ROOT):
    """``ansible-runner`` -> ``ansible-runner>=2.4.3``: its line of requirements/ee.txt (the floor the project
    tests, never an exact pin), or the bare name when the file does not say."""
    try:
        lines = (root / "requirements" / "ee.txt").read_text(encoding="utf-8").splitlines()
    except OSError:
        return name
    for line in lines:
        found = re.match(rf"^{re.escape(name)}\s*([<>=!~][^#;\s]*)", line.strip(), re.IGNORECASE)
        if found:
            return f"{name}{found.group(1)}"
    return name


def ansible_core_requirement(root=ROOT):
    """``ansible-core>=2.19.0,<2.22.0`` from meta/runtime.yml's requires_ansible (``ansible-core`` without it)."""
    try:
        text = (root / "meta" / "runtime.yml").read_text(encoding="utf-8")
    except OSError:
        return "ansible-core"
    found = re.search(r"""^requires_ansible:\s*["']?([^"'\n]+)""", text, re.MULTILINE)
    return f"ansible-core{found.group(1).strip()}" if found else "ansible-core"


def missing_package(module, error, root=ROOT):
    """The sentence for a package the runner cannot import: which Python lacks it, and what to install there or in
    a venv of the runner's own (the lower bounds the project tests, for a collection as for a checkout)."""
    python = sys.executable
    packages = shlex.join(requirement(name, root) for name in RUNNER_PACKAGES)
    venv = "/opt/pve-gpu-drift/venv"
    return (
        f"{module} is not importable by {python} ({error}); the runner needs a Python with ansible-core, "
        f"ansible-runner and prometheus-client: install them there ({python} -m pip install {packages}), or make "
        f"it a venv of its own (python3 -m venv {venv} && {venv}/bin/pip install "
        f"{shlex.quote(ansible_core_requirement(root))} {packages}) and run {venv}/bin/python drift/runner.py; the "
        "role drift_timer finds or makes one (drift_timer_python), and a checkout's .venv has them (make setup)"
    )
