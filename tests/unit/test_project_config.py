"""The molecule scenarios' Ansible settings mirror ansible.cfg's: a scenario that runs the roles without the
project's ansible.cfg must find the same modules and plugins (target_facts needs its action to name the run)."""

import configparser
import os
import subprocess
import sys

import yaml

from tests.conftest import ROOT


def test_molecule_finds_the_collection_where_ansible_cfg_does():
    """A scenario runs without the project's ansible.cfg: it must find the same collection (the checkout, through
    collections/) and enable the same callback; no other plugin path may be set anywhere, or two copies could mix."""
    config = configparser.ConfigParser()
    config.read(ROOT / "ansible.cfg")
    defaults = config["defaults"]
    env = yaml.safe_load((ROOT / ".config" / "molecule" / "config.yml").read_text())["provisioner"]["env"]
    assert defaults["collections_path"].split(":")[0] == "collections"
    assert (ROOT / "collections" / "ansible_collections" / "pve_gpu" / "recover").resolve() == ROOT
    assert env["ANSIBLE_COLLECTIONS_PATH"] == "${MOLECULE_PROJECT_DIRECTORY}/collections"
    assert env["ANSIBLE_CALLBACKS_ENABLED"] == defaults["callbacks_enabled"] == "pve_gpu.recover.recover_report"
    plugin_paths = ("library", "module_utils", "roles_path", "action_plugins", "callback_plugins", "lookup_plugins")
    assert not [key for key in defaults if key in plugin_paths or key.endswith("_plugins")]
    assert not [key for key in env if key in ("ANSIBLE_LIBRARY", "ANSIBLE_MODULE_UTILS", "ANSIBLE_ROLES_PATH")]


def test_a_run_without_an_inventory_stops_and_names_one_never_the_lab():
    """ansible.cfg names no real inventory: `ansible-playbook recover.yml` without -i must reach nothing (not the lab,
    not a node), and say what to pass."""
    config = configparser.ConfigParser()
    config.read(ROOT / "ansible.cfg")
    assert config["defaults"]["inventory"] == "inventory/none/hosts.sh"
    assert config.getboolean("inventory", "any_unparsed_is_failed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    done = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "ansible-inventory"), "--list"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0, done.stdout
    assert "no inventory given. Name the targets: -i inventory/proxmox" in done.stderr
    assert "pve-lab" not in done.stdout
