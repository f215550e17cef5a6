"""The molecule scenarios' Ansible settings mirror ansible.cfg's: a scenario that runs the roles without the
project's ansible.cfg must find the same modules and plugins (target_facts needs its action to name the run)."""

import configparser
import os
import subprocess
import sys

import yaml

from tests.conftest import ROOT

# ansible.cfg [defaults] key -> the environment variable that sets it, for every path the project adds.
PATH_SETTINGS = {
    "library": "ANSIBLE_LIBRARY",
    "module_utils": "ANSIBLE_MODULE_UTILS",
    "roles_path": "ANSIBLE_ROLES_PATH",
    "doc_fragment_plugins": "ANSIBLE_DOC_FRAGMENT_PLUGINS",
    "callback_plugins": "ANSIBLE_CALLBACK_PLUGINS",
    "lookup_plugins": "ANSIBLE_LOOKUP_PLUGINS",
    "action_plugins": "ANSIBLE_ACTION_PLUGINS",
}


def test_every_path_ansible_cfg_adds_is_set_for_molecule_too():
    config = configparser.ConfigParser()
    config.read(ROOT / "ansible.cfg")
    defaults = config["defaults"]
    env = yaml.safe_load((ROOT / ".config" / "molecule" / "config.yml").read_text())["provisioner"]["env"]
    set_in_cfg = [key for key in defaults if key.endswith(("_plugins", "_path")) or key in PATH_SETTINGS]
    unknown = sorted(set(set_in_cfg) - set(PATH_SETTINGS) - {"inventory"})
    assert unknown == [], f"ansible.cfg sets {unknown}: add them to PATH_SETTINGS and the molecule env"
    for key in set_in_cfg:
        if key == "inventory":
            continue
        assert env.get(PATH_SETTINGS[key]) == "${MOLECULE_PROJECT_DIRECTORY}/" + defaults[key], key
    assert env["ANSIBLE_CALLBACKS_ENABLED"] == defaults["callbacks_enabled"]


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
