"""The molecule scenarios' Ansible settings mirror ansible.cfg's: a scenario that runs the roles without the
project's ansible.cfg must find the same modules and plugins (target_facts needs its action to name the run)."""

import configparser

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
