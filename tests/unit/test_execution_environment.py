"""The execution environment (execution-environment.yml, ansible-builder schema 3) and the collection's own
meta/execution-environment.yml give AWX/AAP what the controller side needs, at the versions `make test` tests, and
point the report and lock-cache options at the directory a deployment mounts storage on (docs/awx.md)."""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from packaging.requirements import Requirement

from tests.conftest import ROOT, unavailable

EE = yaml.safe_load((ROOT / "execution-environment.yml").read_text())
COLLECTION_EE = yaml.safe_load((ROOT / "meta" / "execution-environment.yml").read_text())


def pins(path):
    """``{name: version}`` of the ``name==version`` lines of a requirements file (and the files it includes)."""
    found = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#")[0].strip()
        if line.startswith("-r "):
            found.update(pins(path.parent / line[3:].strip()))
        elif "==" in line:
            name, version = line.split("==")
            found[name.strip().lower()] = version.strip()
    return found


def documented_env(path, option):
    """The environment variable names a plugin's DOCUMENTATION gives ``option``."""
    tree = ast.parse(path.read_text())
    text = next(
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "DOCUMENTATION"
    )
    return [entry["name"] for entry in yaml.safe_load(text)["options"][option]["env"]]


def test_the_ee_installs_what_make_setup_tests():
    tested = pins(ROOT / "requirements" / "runtime.in")
    deps = EE["dependencies"]
    assert EE["version"] == 3
    assert deps["ansible_core"]["package_pip"] == f"ansible-core=={tested['ansible-core']}"
    assert deps["ansible_runner"]["package_pip"] == f"ansible-runner=={tested['ansible-runner']}"
    # ansible-core 2.19 needs Python 3.11+; the EE's is the one the low end is tested on.
    assert re.fullmatch(r"/usr/bin/python3\.11", deps["python_interpreter"]["python_path"])
    ee_pins = pins(ROOT / deps["python"])
    # The drift runner's metrics (drift/metrics.py) need prometheus-client wherever the runner runs.
    assert ee_pins == {name: tested[name] for name in ("ansible-runner", "prometheus-client", "uv")}
    assert (ROOT / deps["system"]).is_file()


def test_the_collection_tells_ansible_builder_what_it_needs():
    assert COLLECTION_EE["version"] == 1
    assert COLLECTION_EE["dependencies"] == {"python": "requirements/ee.txt", "system": EE["dependencies"]["system"]}
    assert "openssh-clients [platform:rpm]" in (ROOT / "bindep.txt").read_text()


def requirements(path):
    """The requirement lines of a requirements file, comments and blank lines left out."""
    return [Requirement(line.split("#")[0]) for line in path.read_text().splitlines() if line.split("#")[0].strip()]


def test_what_consumers_inherit_are_lower_bounds_the_tested_versions_meet():
    """Every EE that installs the collection adds these lines to its own: an exact pin would force its version on
    every consumer (and clash with theirs). The same packages as this repository's EE, each at least the version
    `make test` tests, no upper bound."""
    inherited = requirements(ROOT / COLLECTION_EE["dependencies"]["python"])
    tested = pins(ROOT / EE["dependencies"]["python"])
    assert sorted(r.name for r in inherited) == sorted(tested)
    for requirement in inherited:
        assert [s.operator for s in requirement.specifier] == [">="], str(requirement)
        assert requirement.specifier.contains(tested[requirement.name]), str(requirement)


def test_the_ee_points_reports_and_lock_cache_where_the_plugins_read_them():
    env = dict(
        re.match(r"ENV (\w+)=(\S+)$", step).groups()
        for step in EE["additional_build_steps"]["append_final"]
        if step.startswith("ENV ")
    )
    report_env = documented_env(ROOT / "plugins" / "callback" / "recover_report.py", "report_dir")
    cache_env = documented_env(ROOT / "plugins" / "lookup" / "uv_lock.py", "cache_dir")
    assert sorted(env) == sorted(report_env + cache_env)
    made = next(step for step in EE["additional_build_steps"]["append_final"] if step.startswith("RUN mkdir"))
    assert all(path in made for path in env.values())


def test_ansible_builder_accepts_the_definition(tmp_path):
    # The venv's own (requirements/tools.in pins it), else one on PATH.
    here = Path(sys.executable).with_name("ansible-builder")
    builder = str(here) if here.is_file() else shutil.which("ansible-builder")
    if builder is None:
        unavailable("ansible-builder is not installed (pip install ansible-builder)")
    done = subprocess.run(
        [builder, "create", "-f", str(ROOT / "execution-environment.yml"), "-c", str(tmp_path / "context")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    build = (tmp_path / "context" / "Dockerfile").read_text()
    assert 'ARG ANSIBLE_INSTALL_REFS="ansible-core==' in build
    assert "ENV PVE_GPU_RECOVER_LOCK_CACHE_DIR=" in build
