"""The step registry (plugins/module_utils/pve_steps.py LOADERS) is the one list of steps: every other place that names
the steps in order (the playbook, its included steps, the report callback, the drift runner, target_facts' docs,
docs/design.md and the README's table) is checked against it here, so a step added or reordered in one place only
fails this test instead of silently dropping out of a report or a drift summary."""

import importlib.util
import re

import yaml
from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_steps

from tests.conftest import ROOT

STEPS = list(pve_steps.STEP_NAMES)
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


def test_recover_yml_loads_every_steps_settings_in_order_and_passes_each_to_the_fact_pass():
    play = yaml.safe_load((ROOT / "playbooks" / "recover.yml").read_text())[0]
    imports = [task["ansible.builtin.import_role"] for task in play["tasks"] if "ansible.builtin.import_role" in task]
    settings = [role["name"].removeprefix(NS) for role in imports if role.get("tasks_from") == "settings"]
    assert settings == ACTING
    preflight = next(
        task for task in play["tasks"] if task.get("ansible.builtin.import_role", {}).get("name") == NS + "preflight"
    )
    assert preflight["vars"]["preflight_steps_from_variables"] == ACTING
    # Every step's settings come from its own role's variables: none given outright, not even by the inventory.
    assert preflight["vars"]["preflight_steps"] == {}


def test_the_included_steps_run_every_acting_step_in_order():
    block = yaml.safe_load((ROOT / "playbooks" / "tasks" / "steps.yml").read_text())[0]["block"]
    assert [task["ansible.builtin.import_role"]["name"] for task in block] == [NS + name for name in ACTING]
    assert [task["tags"] for task in block] == [[name] for name in ACTING]


def test_every_step_has_a_role_with_settings():
    for name in STEPS:
        assert (ROOT / "roles" / name / "meta" / "argument_specs.yml").is_file(), name
    for name in ACTING:
        assert (ROOT / "roles" / name / "tasks" / "settings.yml").is_file(), name


def test_the_report_callback_and_the_drift_runner_name_the_registrys_steps():
    callback = load_path("recover_report_for_step_list", "plugins/callback/recover_report.py")
    assert list(callback.STEP_ROLES) == STEPS
    runner = load_path("drift_runner_for_step_list", "drift/runner.py")
    assert list(runner.STEP_ORDER) == STEPS


def test_target_facts_documents_the_steps_in_order():
    text = (ROOT / "plugins" / "modules" / "target_facts.py").read_text()
    sentence = text[text.index("Known steps, in their order") :][:400]
    assert in_order(sentence, STEPS) == STEPS


def test_the_readme_table_lists_every_step_in_order():
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if re.match(r"\| \d\. ", line)]
    roles = [re.search(r"`(\w+)`", row.split("|")[2]).group(1) for row in rows]
    assert roles[: len(STEPS)] == STEPS


def test_design_md_describes_every_step_in_order():
    text = (ROOT / "docs" / "design.md").read_text()
    steps = text[text.index("\n## Steps") : text.index("\n## Scheduled drift correction")]
    roles = re.findall(r"^\d\. \*\*[^*]+\*\* \([^)]*role `(\w+)`\)", steps, flags=re.MULTILINE)
    assert roles == STEPS


def test_each_step_lives_in_one_package_named_by_it():
    """A step's facts, its container-side probe (and acting script) sit in plugins/module_utils/steps/<step>/; the
    registry loads exactly those facts modules, and no step module lies anywhere else."""
    steps_dir = ROOT / "plugins" / "module_utils" / "steps"
    assert sorted(p.name for p in steps_dir.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(STEPS)
    for name in STEPS:
        module = pve_steps.load_step(name)
        assert module.__name__.endswith(f".steps.{name}.facts"), module.__name__
        assert name == module.NAME
        if module.PROBE is not None:
            assert module.PROBE.__name__.endswith(f".steps.{name}.probe")
    loose = [p.name for p in (ROOT / "plugins" / "module_utils").glob("pve_probe_*.py")]
    loose += [p.name for p in (ROOT / "plugins" / "module_utils").glob("pve_script_*.py")]
    assert loose == []
