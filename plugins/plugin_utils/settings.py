# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The fact pass's options and the steps' settings, read on the controller in Python (the target_facts action): the
inventory's target (``pve_vmid``, ``pve_node``), the preflight role's variables (``options_from_variables``) and each
step role's variables (``steps_from_variables``), templated the way the role's task would template them. A Jinja
mapping of them, templated anew in each of Ansible's forked workers, was most of a converged target's controller CPU
(docs/benchmarks.md, the fleet).
"""

from __future__ import annotations

import json
import re
import sys

from ansible.errors import AnsibleError, AnsibleValueOmittedError
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import lookup_loader
from ansible.template import Templar, trust_as_template
from ansible.utils.display import Display
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps import registry as step_registry
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.registry import StepSpecError

display = Display()

# A CT id as plugins/module_utils/node/target.py checks it again on the node.
VMID_MIN = 100


VMID_MAX = 999999999


# Every step's module, imported with this action: ansible-playbook imports the action before it forks the task's
# workers (the linear strategy asks it whether it bypasses the host loop), so each worker finds them imported
# instead of importing them again to read their settings (settings_from_variables).
STEP_MODULES = tuple(step_registry.load_step(name) for name in step_registry.STEP_NAMES)


# What the workers template first: a filter (Ansible loads every builtin filter plugin on the first one) and a
# lookup (the env lookup of roles/gpu_processes/vars/main.yml); see warm_templating.
WARM_TEMPLATE = "{{ (lookup('ansible.builtin.env', 'HOME') | default('') | string | length > 0) | bool }}"


# The lookups a worker would otherwise load for itself: the venv step's lock (roles/training_venv/vars/main.yml's
# _training_venv_lock reads a lock file, or compiles a requirements list); see warm_templating.
WARM_LOOKUPS = ("ansible.builtin.file", "pve_gpu.recover.uv_lock")


def warm_templating(template=WARM_TEMPLATE, modules=None, lookups=WARM_LOOKUPS):
    """Template one expression in this process, once, where it runs tasks (an ansible or ansible-playbook process:
    Ansible's task queue is imported): it imports this action before it forks the task's workers (STEP_MODULES), and
    what Ansible sets up on its first template (Jinja's lexer, the builtin filter plugins it loads all at once, the
    lookup plugin) is then inherited by every worker instead of set up again in each: about 7 ms of each worker's
    CPU (docs/benchmarks.md, the fleet). The ``lookups`` are loaded too: the file lookup of the venv step's lock was
    about 2 ms of each worker's. Elsewhere (ansible-doc, a sanity test's import) it does nothing. Anything
    unexpected leaves it undone: it only ever saves time. Returns whether it templated and loaded them all."""
    if "ansible.executor.task_queue_manager" not in (sys.modules if modules is None else modules):
        return False
    try:
        Templar(loader=DataLoader()).template(trust_as_template(template))
    except Exception as error:  # by design: see above
        display.vvv(f"target_facts: templating not warmed ({type(error).__name__}: {error})")
        return False
    for name in lookups:
        try:
            if lookup_loader.get(name) is None:
                raise AnsibleError("no such lookup")
        except Exception as error:  # by design: see above
            display.vvv(f"target_facts: lookup {name} not loaded before the forks ({type(error).__name__}: {error})")
            return False
    return True


def inventory_problem(host, vmid_set, vmid, node_set, node):
    """The inventory mistake that names ``host``'s target wrongly, as one sentence, or None.

    ``vmid_set``: whether the inventory sets ``pve_vmid`` (even to null: a CT that lost its id must not become its
    node); ``vmid`` its value as templated; ``node_set`` whether ``pve_node`` is set and ``node`` its value. A CT
    id is an integer from 100 to 999999999 written in digits, and a CT needs its node: without pve_node the fact
    pass would run on the CT's own inventory name. Unset, the target is a bare GPU host.
    """
    if not vmid_set:
        return None
    digits = re.fullmatch(r"[0-9]+", str(vmid)) is not None and not isinstance(vmid, bool)
    if digits and VMID_MIN <= int(vmid) <= VMID_MAX and node_set:
        return None
    return (
        f"{host}: pve_vmid must be a Proxmox CT id (an integer from {VMID_MIN} to {VMID_MAX}) with pve_node naming "
        f"its node; got pve_vmid={json.dumps(str(vmid))}, pve_node={node if node_set else 'unset'}. "
        "Fix the inventory."
    )


# Role variables renamed in 2.0.0 (CHANGELOG.md): one left in an inventory would be ignored without a word.
RENAMED_VARIABLES = {"training_venv_python": "training_venv_python_version"}


def renamed_variable_problem(host, names):
    """The first renamed role variable among ``names`` (the host's variables) with its new name; ``""`` if none."""
    for old, new in RENAMED_VARIABLES.items():
        if old in names:
            return f"{host}: {old} was renamed {new} in pve_gpu.recover 2.0.0 (CHANGELOG.md); rename it"
    return ""


# options_from_variables: each option of the pass that the task leaves out and the preflight role's variable it is
# read from, as the role's task passed them before 2.4.0: ``"{{ preflight_<option> }}"``, and for these two
# ``"{{ ... | default(omit, true) }}"`` (a false or empty value is left out: the action names the run and its owner).
OPTION_VARIABLES = {
    "run_id": "preflight_run_id",
    "owner": "preflight_lock_owner",
    "lock_ttl": "preflight_lock_ttl",
    "lock_dir": "preflight_lock_dir",
    "python": "preflight_python",
    "timeout": "preflight_timeout",
    "per_node": "preflight_per_node",
    "steps": "preflight_steps",
}


FALSE_IS_UNSET = frozenset({"run_id", "owner"})


def options_from_variables(given, variable, host):
    """The options of the pass that ``given`` (the task's own) leaves out, read from the variables (pure), each as the
    preflight role's task templated it before 2.4.0: ``vmid`` is ``pve_vmid`` (``default(omit)``), ``node_name`` is
    ``pve_node`` (``default(inventory_hostname)``: ``host``), ``steps_from_variables`` is preflight and
    ``preflight_steps_from_variables``, ``check_run`` is the run's check mode (``ansible_check_mode``), the others
    are OPTION_VARIABLES. ``variable(name)`` is the variable's templated value (KeyError when it is not set, or
    templates to ``omit``: the option is left out, as a template of it would have left it; StepSpecError when it
    cannot be templated: raised again, naming the variable and the option). Raises StepSpecError for steps to read
    that are not a list."""
    found = {}

    def value(option, name):
        return step_registry.variable_value(variable, name, f"the fact pass's {option}")

    def read(option, name, default=step_registry.UNSET):
        if option in given:
            return
        read_value = value(option, name)
        read_value = default if read_value is step_registry.UNSET else read_value
        if read_value is not step_registry.UNSET and not (option in FALSE_IS_UNSET and not read_value):
            found[option] = read_value

    read("vmid", "pve_vmid")
    read("node_name", "pve_node", default=host)
    for option, name in OPTION_VARIABLES.items():
        read(option, name)
    if "steps_from_variables" not in given:
        more = value("steps_from_variables", "preflight_steps_from_variables")
        more = [] if more is step_registry.UNSET else more
        if more == "all":  # recover.yml's: every step of the registry (those that are off are left out)
            more = list(step_registry.STEP_NAMES[1:])
        if not isinstance(more, list):
            raise StepSpecError(
                f"preflight_steps_from_variables must be a list of step names or all, not {more!r}",
                kind="invalid_step",
            )
        found["steps_from_variables"] = [step_registry.preflight_facts.NAME, *more]
    read("check_run", "ansible_check_mode", default=False)
    return found


def variable_reader(templar, task_vars):
    """``variable(name)``: the task variable ``name`` templated by ``templar``; KeyError when it is not set or
    templates to ``omit``, StepSpecError (Jinja's first line) when it cannot be templated. The one reader of the
    role variables the action reads in Python (options_from_variables, step_registry.settings_from_variables)."""

    def variable(name):
        if name not in task_vars:
            raise KeyError(name)
        try:
            return templar.template(task_vars[name])
        except AnsibleValueOmittedError as error:
            raise KeyError(name) from error
        except AnsibleError as error:
            said = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise StepSpecError(said, kind="invalid_step") from error

    return variable
