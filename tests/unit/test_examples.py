"""The example inventories and the README's way to them: every variable an example sets is an option of a role, of
the type that role declares (roles/*/meta/argument_specs.yml); the first example (inventory/proxmox-minimal) turns
on GPU cleanup and verify only, with no network, pin or compilation; the README leads from its quick start straight
to a first `--check --diff` with it, the full example second, and explains its words in a glossary."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

from tests.conftest import ROOT

INVENTORIES = sorted(p.name for p in (ROOT / "inventory").iterdir() if (p / "hosts.yml").is_file())
README = (ROOT / "README.md").read_text()
# An inventory's connection settings and the two every target has; the rest must be a role's.
CONNECTION = re.compile(r"^ansible_|^(pve_node|pve_vmid)$")


def role_options():
    """``{role: {option: spec}}`` of every role's entry points, for what an inventory gives: ``required`` and
    ``default`` dropped (an inventory may leave any option out; the roles' own validation runs with the full spec)."""
    found = {}
    for path in sorted((ROOT / "roles").glob("*/meta/argument_specs.yml")):
        options = {}
        for entry in yaml.safe_load(path.read_text())["argument_specs"].values():
            for name, spec in entry.get("options", {}).items():
                options[name] = {k: v for k, v in spec.items() if k not in ("required", "default", "description")}
        found[path.parent.parent.name] = options
    return found


def hostvars(inventory):
    """Each host's variables as Ansible reads the inventory (hosts.yml, group_vars/)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    done = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-inventory"), "-i", f"inventory/{inventory}", "--list"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    return listed, {
        host: {k: v for k, v in hv.items() if k != "ansible_local"} for host, hv in listed["_meta"]["hostvars"].items()
    }


@pytest.mark.parametrize("inventory", INVENTORIES)
def test_every_variable_an_example_sets_is_a_role_option_of_its_type(inventory):
    options = role_options()
    known = {name for role in options.values() for name in role}
    _, hosts = hostvars(inventory)
    assert hosts, inventory
    for host, variables in hosts.items():
        unknown = sorted(k for k in variables if not CONNECTION.search(k) and k not in known)
        assert unknown == [], f"{inventory}: {host} sets variables no role declares"
        for role, spec in options.items():
            given = {k: v for k, v in variables.items() if k in spec and not (isinstance(v, str) and "{{" in v)}
            errors = ArgumentSpecValidator(spec).validate(given).error_messages
            assert errors == [], f"{inventory}: {host}: {role}: {errors}"


def test_the_minimal_example_turns_on_gpu_cleanup_and_verify_only():
    listed, hosts = hostvars("proxmox-minimal")
    assert listed["gpu_targets"]["hosts"] == ["train200"]
    assert listed["pve_nodes"]["hosts"] == ["pve1"]
    target = hosts["train200"]
    assert (target["pve_node"], target["pve_vmid"]) == ("pve1", 200)
    steps = ("gpu_processes", "training_code", "training_venv", "compile_cache", "verify")
    assert {step: target[f"{step}_enabled"] for step in steps} == {
        "gpu_processes": True,
        "training_code": False,
        "training_venv": False,
        "compile_cache": False,
        "verify": True,
    }
    assert target["verify_import_torch"] == "never"  # it names no venv, so torch is never imported
    # No network, no pin, nothing to compile or copy: no URL, no version, no file of the controller's.
    values = json.dumps(target)
    assert not re.search(r"https?://|==|playbook_dir|inventory_dir|\.whl|\.lock", values), values
    for setting in (
        "training_code_commit",
        "training_venv_requirements",
        "training_venv_lock_file",
        "compile_cache_warmup",
    ):
        assert setting not in target


# -- the README -----------------------------------------------------------------------------------------------------
def sections(text):
    """``[(heading, body)]`` of the README's ``##`` sections, in order."""
    parts = re.split(r"^(## .+)$", text, flags=re.MULTILINE)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def test_the_readme_leads_from_the_quick_start_to_a_first_check_with_the_minimal_example():
    order = [heading for heading, _ in sections(README)]
    assert order[:2] == ["## Quick start", "## Point it at a real Proxmox node"]
    quick = dict(sections(README))["## Quick start"]
    assert "make setup" in quick and "inventory/proxmox-minimal" in quick
    assert "Proxmox VE node will do" not in quick  # the lab and the tests refuse on a node
    path = dict(sections(README))["## Point it at a real Proxmox node"]
    # Within the first screenful of the path: the minimal example's copy and the check, before the full example.
    copy = path.index("cp -r inventory/proxmox-minimal inventory/mine")
    check = path.index("ansible-playbook -i inventory/mine recover.yml --check --diff")
    full = path.index("### The full example")
    assert copy < check < full
    assert README.index("## Point it at a real Proxmox node") < README.index("## Requirements")


def test_the_readme_explains_its_words_in_a_glossary():
    glossary = dict(sections(README))["## Glossary"]
    defined = re.findall(r"^- \*\*([^*]+)\*\*", glossary, re.MULTILINE)
    words = ["fact pass", "window", "stand-in", "target", "node", "CT", "drift", "converged", "unattended"]
    assert [word for word in words if not any(term.startswith(word) for term in defined)] == []
