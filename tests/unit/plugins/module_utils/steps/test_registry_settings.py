"""step_registry.settings_from_variables: the fact pass reads each step's settings from its role's variables
(``<step>_<setting>``, or the variable the step's VARIABLES names), in Python on the controller.

The rule is tested as a pure function; then every step's role is held to it (each setting has its variable), and the
roles' own defaults and vars, templated by Ansible as a play would, give settings that pass each step's own check
and are the SPEC's defaults where the role has no other: the Jinja mapping recover.yml had before 2.2.0 gave the
same.
"""

import pytest
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps import registry as step_registry
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.registry import (
    StepSpecError,
    settings_from_variables,
)

from tests.conftest import ROOT

ON = {f"{name}_enabled": True for name in step_registry.STEP_NAMES[1:]}


def reader(variables):
    """``variable(name)`` over a dict, recording what was asked."""
    asked = []

    def variable(name):
        asked.append(name)
        return variables[name]

    return variable, asked


def test_each_setting_is_its_steps_variable_and_one_not_set_keeps_its_default():
    variable = reader({**ON, "verify_gpu_name": "NVIDIA H200", "verify_gpu_count": 8, "preflight_min_free_gib": 20})[0]
    assert settings_from_variables(["preflight", "verify"], variable) == {
        "preflight": {"min_free_gib": 20},
        "verify": {"gpu_name": "NVIDIA H200", "gpu_count": 8},
    }


def test_a_step_that_is_off_is_left_out_and_nothing_else_of_it_is_read():
    """The venv step's lock is a lookup (a uv compile on the controller): a step that is off never pays for it."""
    variable, asked = reader({"training_venv_enabled": "false", "_training_venv_lock": "never read"})
    assert settings_from_variables(["training_venv"], variable) == {}
    assert asked == ["training_venv_enabled"]
    for off in (False, "no", "off", 0, "0"):
        assert settings_from_variables(["verify"], reader({"verify_enabled": off})[0]) == {}, off
    for on in (True, "yes", "true", 1):
        assert settings_from_variables(["verify"], reader({"verify_enabled": on})[0]) == {"verify": {}}, on


def test_a_setting_the_role_computes_is_read_from_the_variable_the_step_names():
    variable, asked = reader(
        {**ON, "_training_venv_lock": "torch==2.11.0+cu128", "training_venv_lock": "a user's typo, never read"}
    )
    assert settings_from_variables(["training_venv"], variable) == {"training_venv": {"lock": "torch==2.11.0+cu128"}}
    assert "training_venv_lock" not in asked and "_training_venv_lock_from_repo" in asked
    variable = reader({**ON, "_gpu_processes_controller_pid": "4711"})[0]
    assert settings_from_variables(["gpu_processes"], variable) == {"gpu_processes": {"controller_pid": "4711"}}


def test_a_setting_no_role_variable_gives_is_never_read():
    """Where preflight finds the driver on the node is the module's to know, not a role variable's."""
    variable, asked = reader({"preflight_kernel_version_file": "/tmp/planted", "preflight_library_globs": ["/x"]})
    assert settings_from_variables(["preflight"], variable) == {"preflight": {}}
    assert "preflight_kernel_version_file" not in asked and "preflight_library_globs" not in asked
    assert "preflight_enabled" not in asked  # preflight is the fact pass itself: never off


def test_a_step_whose_role_variables_are_not_loaded_is_a_clear_error_never_its_defaults():
    """Without the role's settings (import_role tasks_from: settings) a step would run on its SPEC's defaults, and
    a step that is off by default (compile_cache) would be read."""
    with pytest.raises(StepSpecError, match=r"^the variables of role pve_gpu\.recover\.compile_cache are not loaded"):
        settings_from_variables(["compile_cache"], reader({})[0])


def test_steps_come_in_the_order_they_run_whatever_the_order_asked():
    variable = reader(ON)[0]
    assert list(settings_from_variables(["verify", "preflight", "gpu_processes"], variable)) == [
        "preflight",
        "gpu_processes",
        "verify",
    ]


def test_an_unknown_step_or_an_enabled_that_is_no_boolean_is_a_clear_error():
    variable = reader({"verify_enabled": "maybe"})[0]
    unknown = r"^unknown step\(s\) nope in steps_from_variables \(the preflight role's preflight_steps_from_variables\)"
    with pytest.raises(StepSpecError, match=unknown):
        settings_from_variables(["verify", "nope"], variable)
    with pytest.raises(StepSpecError, match=r"^verify_enabled: The value 'maybe' is not a valid boolean") as raised:
        settings_from_variables(["verify"], variable)
    assert raised.value.kind == "invalid_step"


# -- the roles against the rule -----------------------------------------------------------------------------------
def role_variables(step, loader=None):
    """A role's defaults and vars as Ansible loads them (templates trusted), or as plain YAML."""
    loader = loader or DataLoader()
    found = {}
    for part in ("defaults", "vars"):
        path = ROOT / "roles" / step / part / "main.yml"
        if path.is_file():
            found.update(loader.load_from_file(str(path), trusted_as_template=True) or {})
    return found


@pytest.mark.parametrize("step", step_registry.STEP_NAMES)
def test_every_setting_of_every_step_has_its_role_variable(step):
    module = step_registry.load_step(step)
    variables = role_variables(step)
    renamed = getattr(module, "ROLE_VARIABLES", {})
    assert set(renamed) <= set(module.SPEC)
    missing = sorted(
        key for key in module.SPEC if renamed.get(key, f"{step}_{key}") not in variables and renamed.get(key, 1)
    )
    assert missing == [], f"roles/{step} has no variable for these settings"
    # A renamed setting's variable is the role's own computation (vars/main.yml, `_` first), never a user's.
    assert all(name.startswith(f"_{step}_") for name in renamed.values() if name is not None)
    if step != "preflight":
        assert f"{step}_enabled" in variables


def test_the_roles_own_variables_templated_by_ansible_pass_every_steps_check():
    """What recover.yml hands the fact pass on a fresh inventory: every role's defaults and vars, templated as a
    play templates them, read by the rule, are settings each step's check accepts, with the SPEC's defaults."""
    variables = {"inventory_hostname": "ct200", "recover_unattended": False}
    for step in step_registry.STEP_NAMES:
        variables.update(role_variables(step))
    # The roles' two lookups (the lock file, the controller's environment) need Ansible's plugin loader, which a
    # unit test's process does not set up: their results are given, as a play's lookups would return them.
    lock = (ROOT / "tests/fixtures/venv/lock_cu128.txt").read_text()
    variables.update(training_venv_lock_file="lock.txt", _training_venv_lock=lock, _gpu_processes_controller_pid=None)
    # The steps that are off until a user gives them what to do.
    variables.update(training_code_commit="3f2a1c04" * 5, compile_cache_enabled=True)
    templar = Templar(loader=DataLoader(), variables=variables)

    def variable(name):
        return templar.template(variables[name])

    read = settings_from_variables(list(step_registry.STEP_NAMES), variable)
    assert list(read) == list(step_registry.STEP_NAMES)
    specs = step_registry.validate_specs(read)
    assert specs["gpu_processes"]["unattended"] is False and specs["gpu_processes"]["grace"] == 10
    assert specs["verify"]["venv"] == specs["compile_cache"]["venv"] == "/opt/venvs/train"
    assert specs["training_venv"]["lock"] == lock and specs["gpu_processes"]["controller_pid"] is None
    assert specs["training_venv"]["lock_from_repo"] is None
    # Where the role has nothing of its own (a computed value, a template), its default is the SPEC's.
    given = {"training_code": {"commit"}, "training_venv": {"lock"}}  # what the test gave above
    for step, settings in specs.items():
        module = step_registry.load_step(step)
        defaults = getattr(module, "SPEC_DEFAULTS", None) or {k: v.get("default") for k, v in module.SPEC.items()}
        # A role's "" is its SPEC's None: nothing given (training_code_remote).
        differing = {key for key in settings if (settings[key] or None) != (defaults[key] or None)}
        assert differing - given.get(step, set()) == set(), step


def test_a_commit_yaml_reads_as_a_number_is_its_text():
    digits = "1234567890" * 4  # a sha of digits only: YAML reads it as an int
    variable = reader({"training_code_commit": int(digits), "training_code_enabled": True})[0]
    specs = step_registry.validate_specs(settings_from_variables(["training_code"], variable))
    assert specs["training_code"]["commit"] == digits
