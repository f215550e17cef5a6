"""Settings a user can guess, the same for every step (issue 20, item 5):

- one way to turn a step on: `<step>_enabled`, in defaults and argument_specs; off, the fact pass leaves the step
  out and its acting task is skipped;
- one venv variable: the compile cache's and verify's venv default to `training_venv_path`;
- `python` means one thing: the CT's interpreter that runs probe parts and scripts (doc fragment
  pve_target.python), in every module that has it, and every role passes it `preflight_python`, the fact pass's.
"""

import importlib
import re

import pytest
import yaml
from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_steps
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_target import PYTHON_ARGUMENT_SPEC

from tests.conftest import ROOT

ACTING = list(pve_steps.STEP_NAMES[1:])
PYTHON = "{{ preflight_python | default('python3') }}"


def role(step, path):
    return yaml.safe_load((ROOT / "roles" / step / path).read_text())


def acting_task(tasks, module, when=()):
    """``(task, when)``: the task that calls ``module``, and every condition on it and the blocks around it."""
    for task in tasks:
        conditions = [*when, *([task["when"]] if isinstance(task.get("when"), str) else task.get("when", []))]
        if module in task:
            return task, conditions
        if "block" in task:
            found = acting_task(task["block"], module, conditions)
            if found:
                return found
    return None


@pytest.mark.parametrize("step", ACTING)
def test_each_step_is_turned_on_by_its_enabled_variable(step):
    defaults = role(step, "defaults/main.yml")
    options = role(step, "meta/argument_specs.yml")["argument_specs"]["main"]["options"]
    assert f"{step}_enabled" in defaults
    assert options[f"{step}_enabled"]["type"] == "bool"
    assert options[f"{step}_enabled"]["default"] == defaults[f"{step}_enabled"]
    # The fact pass leaves the step out while it is off (pve_steps.settings_from_variables reads the variable).
    assert pve_steps.settings_from_variables([step], {f"{step}_enabled": False}.__getitem__) == {}
    when = acting_task(role(step, "tasks/main.yml"), f"pve_gpu.recover.{step}")[1]
    assert when[0] == f"{step}_enabled | bool"
    # No other switch: nothing private decides whether the step runs.
    computed = ROOT / "roles" / step / "vars" / "main.yml"
    assert not [name for name in (role(step, "vars/main.yml") if computed.is_file() else {}) if "enabled" in name]


@pytest.mark.parametrize("step", ["compile_cache", "verify"])
def test_the_venv_is_named_once(step):
    assert role(step, "defaults/main.yml")[f"{step}_venv"] == "{{ training_venv_path | default('/opt/venvs/train') }}"
    assert role("training_venv", "defaults/main.yml")["training_venv_path"] == "/opt/venvs/train"


@pytest.mark.parametrize("step", ACTING)
def test_python_is_the_cts_interpreter_everywhere_and_the_fact_passs(step):
    module = importlib.import_module(step)
    task = acting_task(role(step, "tasks/main.yml"), f"pve_gpu.recover.{step}")[0]
    args = task[f"pve_gpu.recover.{step}"]
    if "python" in module.ARGUMENT_SPEC:
        assert module.ARGUMENT_SPEC["python"] == PYTHON_ARGUMENT_SPEC["python"]
        assert "pve_gpu.recover.pve_target.python" in module.DOCUMENTATION
        assert args["python"] == PYTHON
    else:
        assert "python" not in args  # verify runs the venv's own python, never the CT's
    assert "python_executable" not in module.ARGUMENT_SPEC
    # A role variable named like an interpreter is the fact pass's alone (the venv's minor is *_python_version).
    assert not [name for name in role(step, "defaults/main.yml") if re.search(r"_python$", name)]


def test_the_fact_pass_runs_on_the_same_interpreter():
    (task,) = role("preflight", "tasks/main.yml")
    # Every option from the role's variables, read by the action (python from preflight_python: the action's
    # OPTION_VARIABLES, tests/unit/plugins/test_action_target_facts.py).
    assert task["pve_gpu.recover.target_facts"] == {"options_from_variables": True}
    assert role("preflight", "defaults/main.yml")["preflight_python"] == PYTHON_ARGUMENT_SPEC["python"]["default"]
