"""The step registry (plugins/module_utils/steps/registry.py LOADERS) is the one list of steps: the code's other
lists of steps (the report callback's, the drift runner's order, the unattended probe's) are read from it, and the
two places that must name the steps themselves (recover.yml's role imports, the README's table) are checked against
it here, so a step added or reordered in one place only fails this test instead of silently dropping out of a
report or a drift summary."""

import importlib.util
import re

import yaml
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps import registry as step_registry

from tests.conftest import ROOT

STEPS = list(step_registry.STEP_NAMES)
ACTING = STEPS[1:]  # preflight is the fact pass itself
NS = "pve_gpu.recover."


def load_path(name, path):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def in_order(text, names):
    """The names of ``names`` in the order they first appear in ``text`` (as whole words)."""
    found = {name: re.search(rf"\b{name}\b", text) for name in names}
    return [name for name, match in sorted(found.items(), key=lambda item: item[1].start() if item[1] else -1) if match]


def test_the_registry_starts_with_preflight_and_has_no_duplicates():
    assert STEPS[0] == "preflight"
    assert len(set(STEPS)) == len(STEPS)


def test_recover_yml_passes_every_step_to_the_fact_pass_and_imports_each_role_in_order():
    play = yaml.safe_load((ROOT / "playbooks" / "recover.yml").read_text())[0]
    preflight = next(
        task for task in play["tasks"] if task.get("ansible.builtin.import_role", {}).get("name") == NS + "preflight"
    )
    # Every step of the registry; its settings from its own role's variables, none given outright (not even by
    # the inventory).
    assert preflight["vars"]["preflight_steps_from_variables"] == "all"
    assert preflight["vars"]["preflight_steps"] == {}
    (steps,) = [task for task in play["tasks"] if "block" in task]
    assert [task["ansible.builtin.import_role"]["name"] for task in steps["block"]] == [NS + name for name in ACTING]
    assert [task["tags"] for task in steps["block"]] == [[name] for name in ACTING]
    assert [task["ansible.builtin.import_role"].get("tasks_from") for task in steps["always"]] == ["unlock"]


def test_every_step_has_a_role_with_settings():
    for name in STEPS:
        assert (ROOT / "roles" / name / "meta" / "argument_specs.yml").is_file(), name
        assert (ROOT / "roles" / name / "defaults" / "main.yml").is_file(), name


def test_the_unattended_probe_asks_every_step_that_has_an_unattended_mode():
    unattended = load_path("drift_unattended_for_step_list", "drift/unattended.py")
    assert list(unattended.UNATTENDED_STEPS) == [n for n in STEPS if "unattended" in step_registry.load_step(n).SPEC]
    assert unattended.UNATTENDED_STEPS  # the GPU, code, venv and cache steps


def test_the_report_callback_and_the_drift_runner_name_the_registrys_steps():
    callback = load_path("recover_report_for_step_list", "plugins/callback/recover_report.py")
    assert list(callback.STEP_ROLES) == STEPS
    runner = load_path("drift_runner_for_step_list", "drift/runner.py")
    assert list(runner.STEP_ORDER) == STEPS


def test_the_readme_table_lists_every_step_in_order():
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if re.match(r"\| \d\. ", line)]
    roles = [re.search(r"`(\w+)`", row.split("|")[2]).group(1) for row in rows]
    assert roles[: len(STEPS)] == STEPS


def test_each_step_lives_in_one_package_named_by_it():
    """A step's facts, its container-side probe (and acting script) sit in plugins/module_utils/steps/<step>/; the
    registry loads exactly those facts modules, and no step module lies anywhere else."""
    steps_dir = ROOT / "plugins" / "module_utils" / "steps"
    assert sorted(p.name for p in steps_dir.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(STEPS)
    for name in STEPS:
        module = step_registry.load_step(name)
        assert module.__name__.endswith(f".steps.{name}.facts"), module.__name__
        assert name == module.NAME
        if module.PROBE is not None:
            assert module.PROBE.__name__.endswith(f".steps.{name}.probe")
    loose = [p.name for p in (ROOT / "plugins" / "module_utils").glob("pve_probe_*.py")]
    loose += [p.name for p in (ROOT / "plugins" / "module_utils").glob("pve_script_*.py")]
    assert loose == []
