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
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import PYTHON_ARGUMENT_SPEC
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps import registry as step_registry

from tests.conftest import ROOT

ACTING = list(step_registry.STEP_NAMES[1:])
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
    # The fact pass leaves the step out while it is off (step_registry.settings_from_variables reads the variable).
    assert step_registry.settings_from_variables([step], {f"{step}_enabled": False}.__getitem__) == {}
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
    # Every option from the role's variables, read by the action (python from preflight_python: OPTION_VARIABLES of
    # plugins/plugin_utils/settings.py, tests/unit/plugins/action/test_target_facts.py).
    assert task["pve_gpu.recover.target_facts"] == {"options_from_variables": True}
    assert role("preflight", "defaults/main.yml")["preflight_python"] == PYTHON_ARGUMENT_SPEC["python"]["default"]


# -- one truth per setting (issue 42 item 3) -----------------------------------------------------------------------
# A step's setting is declared once: the step's SPEC (the fact pass's settings) or its module's ARGUMENT_SPEC (the
# acting module's own options). Everything else that names it (the module's DOCUMENTATION, the role's defaults and
# meta/argument_specs.yml, the role task's option mapping, the fact pass's reading of `<step>_<setting>`) is held to
# it here, for every step: name, type, elements, default, choices, no_log, required, suboptions.
STEPS = list(step_registry.STEP_NAMES)
MODULE_OF = {"preflight": "target_facts"}
# Options a task fills from the inventory, the fact pass or the run, never from a role variable of the step.
NOT_SETTINGS = {"vmid", "node_name", "state", "python", "ending_pids", "memory_kept_gpus", "venv_pending"}
NOT_SETTINGS |= {"venv_pending_torch"}
NOT_SETTINGS |= {"controller_pid", "owner", "controller", "run_id", "check_run", "batch", "options_from_variables"}
NOT_SETTINGS |= {"steps_from_variables", "steps", "fail_on_problems", "run_lock"}
TEMPLATE = re.compile(r"^\s*\{\{\s*(\w+)")


@pytest.fixture(scope="module")
def docs():
    """Every step module's DOCUMENTATION as ansible-doc renders it (doc fragments merged), in one call."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    names = [f"pve_gpu.recover.{MODULE_OF.get(step, step)}" for step in STEPS]
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"))
    done = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "ansible-doc"), "--json", *names],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return {name.rsplit(".", 1)[1]: doc["doc"]["options"] for name, doc in json.loads(done.stdout).items()}


def spec_differences(where, spec, other, *, doc=False):
    """Each way ``other`` (a DOCUMENTATION option or a role argument spec entry) differs from ``spec`` (an argument
    spec entry): one sentence each."""
    found = []
    keys = ("type", "elements", "default", "choices", "required") + (() if doc else ("no_log",))
    blank = {"type": "str", "required": False, "no_log": False}
    for key in keys:
        want, have = spec.get(key, blank.get(key)), other.get(key, blank.get(key))
        if key == "type" and not doc and {want, have} == {"path", "str"}:
            continue  # a role variable holding a path may say str
        if want != have:
            found.append(f"{where}: {key} is {have!r} there, {want!r} in the spec")
    inner, their = spec.get("options") or {}, other.get("suboptions" if doc else "options") or {}
    if set(inner) != set(their):
        found.append(f"{where}: suboptions {sorted(their)} there, {sorted(inner)} in the spec")
    for name in set(inner) & set(their):
        found += spec_differences(f"{where}.{name}", inner[name], their[name], doc=doc)
    return found


def effective_default(spec, suboptions="options"):
    """The value an option takes when it is not given: its default, or a dict of its suboptions' defaults."""
    if spec.get("type") == "dict" and spec.get(suboptions) and spec.get("default") in (None, {}):
        inner = {name: effective_default(sub, suboptions) for name, sub in spec[suboptions].items()}
        return {name: value for name, value in inner.items() if value is not None}
    return spec.get("default")


def role_mapping(step):
    """``{option: role variable}``: which role variable gives each option of the step's module: the acting task's
    own mapping, read from roles/<step>/tasks/main.yml; for preflight, the fact pass action's OPTION_VARIABLES."""
    if step == "preflight":
        from ansible_collections.pve_gpu.recover.plugins.plugin_utils import settings  # noqa: PLC0415

        return dict(settings.OPTION_VARIABLES)
    task = acting_task(role(step, "tasks/main.yml"), f"pve_gpu.recover.{step}")[0]
    mapping = {}
    for option, value in task[f"pve_gpu.recover.{step}"].items():
        found = TEMPLATE.match(str(value))
        if found and option not in NOT_SETTINGS:
            mapping[option] = found.group(1)
    return mapping


def module_problems(step, spec, facts, documented):
    """The module takes the step's SPEC as it is (declared once), and its DOCUMENTATION says what its spec does."""
    problems = []
    if step != "preflight":  # the fact pass takes preflight's settings in its option steps, not as options
        redeclared = [name for name in facts.SPEC if spec.get(name) is not facts.SPEC[name]]
        problems += [f"SPEC {name} is redeclared by the module" for name in redeclared]
    if set(documented) != set(spec):
        problems.append(f"documented {sorted(set(documented) ^ set(spec))} differ from the argument spec")
    for name in set(documented) & set(spec):
        # Compared as the values they give (a dict default with suboptions is its suboptions' defaults: Ansible's
        # validator fills those into the default dict itself, so a process that ran the module sees them there).
        want = dict(spec[name], default=effective_default(spec[name]))
        doc = dict(documented[name], default=effective_default(documented[name], "suboptions"))
        problems += spec_differences(f"DOCUMENTATION {name}", want, doc, doc=True)
    return problems


def role_variable_problems(step, settings, given, defaults, options):
    """Every role variable that gives an option (``given``: the task's mapping, the fact pass's `<step>_<setting>`)
    is named for it and has its type, choices, no_log and default (an empty variable may leave an option without
    a default unset; a templated default is the role's own computation, stated alike in both role files)."""
    problems = []
    for option, variable in sorted(given.items()):
        if variable.startswith("_") or option not in settings:
            continue  # computed by the role (vars/main.yml) from variables that are checked themselves
        where = f"{variable} (option {option})"
        if variable != f"{step}_{option}" and step != "preflight":  # preflight's: the action's OPTION_VARIABLES
            problems.append(f"{where}: the role variable of option {option} is named {step}_{option}")
        if variable not in options:
            problems.append(f"{where}: not in meta/argument_specs.yml")
            continue
        default = defaults.get(variable)
        want = dict(settings[option], default=effective_default(settings[option]))
        if (isinstance(default, str) and "{{" in default) or (want["default"] is None and default in ("", [], {})):
            want["default"] = default
        elif step == "preflight" and option in ("run_id", "owner") and default is None:
            want["default"] = None  # unset: the action names the run and who runs it
        described = dict(options[variable], default=effective_default(options[variable]))
        problems += spec_differences(where, dict(want, required=False), dict(described, required=False))
    return problems


def defaults_problems(defaults, options):
    """Every variable in defaults/main.yml is described in argument_specs with the same default, and the reverse."""
    problems = []
    for variable in sorted(set(defaults) | set(options) - {"pve_vmid", "pve_node"}):
        if variable not in defaults and not options[variable].get("required"):
            problems.append(f"{variable}: described in argument_specs, not in defaults/main.yml")
        elif variable not in options:
            problems.append(f"{variable}: in defaults/main.yml, not described in argument_specs")
        elif options[variable].get("default") != defaults.get(variable):
            problems.append(
                f"{variable}: default {defaults.get(variable)!r} vs argument_specs {options[variable].get('default')!r}"
            )
    return problems


@pytest.mark.parametrize("step", STEPS)
def test_each_setting_is_declared_once_and_agrees_everywhere(step, docs):
    module = importlib.import_module(MODULE_OF.get(step, step))
    facts = step_registry.load_step(step)
    # The options a role variable may give: the module's, and for preflight the fact pass's own settings too.
    spec = module.ARGUMENT_SPEC
    settings = {**facts.SPEC, **spec} if step == "preflight" else spec
    defaults = role(step, "defaults/main.yml")
    options = role(step, "meta/argument_specs.yml")["argument_specs"]["main"]["options"]
    given = role_mapping(step)
    renamed = getattr(facts, "ROLE_VARIABLES", {})
    for name in facts.SPEC:  # the fact pass reads setting s from <step>_s, or the variable ROLE_VARIABLES names
        variable = renamed.get(name, f"{step}_{name}")
        if variable is not None:
            given.setdefault(name, variable)
    problems = [
        *module_problems(step, spec, facts, docs[MODULE_OF.get(step, step)]),
        *role_variable_problems(step, settings, given, defaults, options),
        *defaults_problems(defaults, options),
    ]
    assert problems == [], "\n".join(problems)
