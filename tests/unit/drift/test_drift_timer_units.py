"""roles/drift_timer: its two units rendered with Ansible's templating from the role's defaults and vars, checked
by `systemd-analyze verify`, and the role's argument specs in step with its defaults."""

import shlex
import shutil
import subprocess
import sys

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

from tests.conftest import ROOT

ROLE = ROOT / "roles" / "drift_timer"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def trusted(value):
    """Role files are trusted templates to Ansible; values loaded by hand are made so the same way."""
    if isinstance(value, str):
        return trust_as_template(value)
    if isinstance(value, dict):
        return {key: trusted(item) for key, item in value.items()}
    if isinstance(value, list):
        return [trusted(item) for item in value]
    return value


def role_vars(**overrides):
    loader = DataLoader()
    defaults = loader.load_from_file(str(ROLE / "defaults" / "main.yml"))
    internal = loader.load_from_file(str(ROLE / "vars" / "main.yml"))
    # What Ansible gives every role: its own path (from which the role finds its collection).
    magic = {"role_path": str(ROLE), "ansible_playbook_python": sys.executable}
    return loader, trusted({**defaults, **internal, **magic, **overrides})


def templated(expression, **overrides):
    """A variable of the role as Ansible templates it."""
    loader, variables = role_vars(**overrides)
    return Templar(loader=loader, variables=variables).template(trust_as_template(expression))


def render(unit, **overrides):
    """What ansible.builtin.template writes for templates/pve-gpu-drift.<unit>.j2."""
    loader, variables = role_vars(**overrides)
    source = (ROLE / "templates" / f"pve-gpu-drift.{unit}.j2").read_text()
    templar = Templar(loader=loader, variables=variables)
    return templar.template(trust_as_template(source), escape_backslashes=False, preserve_trailing_newlines=True)


@pytest.fixture
def project(tmp_path):
    """A checkout whose path needs systemd's quoting (a space and a %): ExecStart's files must exist to verify."""
    project = tmp_path / "pve gpu%recover"
    (project / "drift").mkdir(parents=True)
    (project / "drift" / "runner.py").write_text("")
    return project


def write_units(directory, **overrides):
    directory.mkdir(exist_ok=True)
    paths = []
    for unit in ("service", "timer"):
        path = directory / f"pve-gpu-drift.{unit}"
        path.write_text(render(unit, **overrides))
        paths.append(path)
    return paths


def verify(*paths):
    # Not a skip: the issue asks that the units pass it, and `make unit` installs it (SYSTEM_PACKAGES).
    assert SYSTEMD_ANALYZE, "systemd-analyze is not installed (Debian package systemd; `make system-deps`)"
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", *map(str, paths)], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "drift_timer_correct": True,
            "drift_timer_limit": 'train*:!"odd"$name',
            "drift_timer_forks": 5,
            "drift_timer_extra_vars": {"preflight_expected_gpu_count": 8},
            "drift_timer_textfile_dir": "",
            "drift_timer_on_calendar": "*-*-* *:00/15:00",
        },
    ],
    ids=["defaults", "everything-set"],
)
def test_the_rendered_units_pass_systemd_analyze_verify(tmp_path, project, overrides):
    overrides = {"drift_timer_project_dir": str(project), "drift_timer_python": sys.executable, **overrides}
    service, timer = write_units(tmp_path / "units", **overrides)
    done = verify(service, timer)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pve-gpu-drift" not in done.stderr, done.stderr  # no warning about our units either


def test_a_broken_schedule_fails_verification(tmp_path, project):
    _, timer = write_units(
        tmp_path / "units",
        drift_timer_project_dir=str(project),
        drift_timer_python=sys.executable,
        drift_timer_on_calendar="every other tuesday",
    )
    done = verify(timer)
    assert done.returncode != 0
    assert "Failed to parse calendar specification" in done.stderr


def test_the_roles_validate_command_verifies_the_template_modules_temporary_file(tmp_path, project):
    """ansible.builtin.template validates a file named `source`: the role's wrapper verifies it under the unit's
    name, as the template module runs it (split like a shell would, no shell)."""
    _, variables = role_vars()
    (tmp_path / "units").mkdir()
    for unit in ("service", "timer"):
        source = tmp_path / "units" / "source"
        source.write_text(render(unit, drift_timer_project_dir=str(project), drift_timer_python=sys.executable))
        command = f"{variables['_drift_timer_verify']} pve-gpu-drift.{unit} %s" % source
        done = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
    source.write_text("[Timer]\nOnCalendar=never ever\n")
    done = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert sorted(p.name for p in (tmp_path / "units").iterdir()) == ["source"]


def test_execstart_quotes_paths_for_systemd_and_passes_every_setting(project):
    service = render(
        "service",
        drift_timer_project_dir=str(project),
        drift_timer_python=sys.executable,
        drift_timer_correct=True,
        drift_timer_limit='a"b$c',
        drift_timer_extra_vars={"x": 1},
    )
    escaped = str(project).replace("%", "%%")
    assert f'ExecStart="{sys.executable}" "{escaped}/drift/runner.py" \\' in service
    assert f'    --project "{escaped}" \\' in service
    assert '    --limit "a\\"b$$c" \\' in service
    assert '    --extra-vars "@/var/lib/pve-gpu-drift/extra-vars.json" \\' in service
    assert '    --textfile "/var/lib/prometheus/node-exporter/pve_gpu_recover.prom" \\' in service
    assert "    --correct \\" in service
    assert "    --timeout 3000\n" in service
    for line in ("Type=oneshot", "SuccessExitStatus=2", "TimeoutStartSec=3060", "KillMode=mixed", "User=root"):
        assert f"\n{line}\n" in service
    defaults = render("service", drift_timer_project_dir=str(project), drift_timer_python=sys.executable)
    assert "--correct" not in defaults
    assert "--limit" not in defaults
    assert "--extra-vars" not in defaults


def test_the_timer_is_persistent_and_randomized():
    timer = render("timer")
    for line in ("OnCalendar=hourly", "RandomizedDelaySec=300", "Persistent=true", "Unit=pve-gpu-drift.service"):
        assert f"\n{line}\n" in timer
    assert "WantedBy=timers.target" in timer


def test_every_default_is_in_the_argument_specs_with_its_value():
    """The entry points (main: the timer; run: once, as an AWX schedule; rules: the alert rules) document every
    default they read."""
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    assert sorted(specs) == ["main", "rules", "run"]
    assert sorted({name for spec in specs.values() for name in spec["options"]}) == sorted(defaults)
    for spec in specs.values():
        for name, option in spec["options"].items():
            if not option.get("required"):
                assert option["default"] == defaults[name], name
            assert option["description"], name


# -- from an installed collection: where the timer expects things --------------------------------------------------
def test_by_default_the_timer_runs_the_collection_the_role_belongs_to_with_the_python_found():
    """No checkout at /opt/pve-gpu-recover assumed: the role's own collection (its roles/ holds the role), and the
    Python tasks/python.yml found (else the venv it makes)."""
    assert templated("{{ _drift_timer_project }}") == str(ROOT)
    service = render("service", __drift_timer_found_python="/usr/local/drift/bin/python")
    assert f'ExecStart="/usr/local/drift/bin/python" "{ROOT}/drift/runner.py" \\' in service
    assert f'    --project "{ROOT}" \\' in service
    assert f"WorkingDirectory={ROOT}\n" in service
    # Nothing found yet (check mode on a first install): the venv the role makes.
    assert 'ExecStart="/var/lib/pve-gpu-drift/venv/bin/python" ' in render("service")
    assert templated("{{ _drift_timer_python_candidates }}", ansible_playbook_python="/usr/bin/python3") == [
        f"{ROOT}/.venv/bin/python",
        "/usr/bin/python3",
        "/var/lib/pve-gpu-drift/venv/bin/python",
    ]
    assert templated("{{ _drift_timer_python_candidates }}", drift_timer_python="/usr/bin/python3") == [
        "/usr/bin/python3"
    ]


def test_the_venv_gets_ansible_cores_range_and_what_the_execution_environment_lists():
    """One truth: the role's packages are meta/runtime.yml's ansible-core range and requirements/ee.txt's lines."""
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    requires = yaml.safe_load((ROOT / "meta" / "runtime.yml").read_text())["requires_ansible"]
    ee = [
        line.split("#")[0].strip()
        for line in (ROOT / "requirements" / "ee.txt").read_text().splitlines()
        if line.split("#")[0].strip()
    ]
    assert defaults["drift_timer_venv_packages"] == [f"ansible-core{requires}", *ee]


@pytest.mark.parametrize(
    ("calendar", "period"),
    [
        ("hourly", "1h"),
        ("*:00", "1h"),
        ("*-*-* *:30:00", "1h"),
        ("*:0/15", "15m"),
        ("*-*-* *:00/15:00", "15m"),
        ("daily", "1d"),
        ("minutely", "1m"),
        ("Mon..Fri 06:00", ""),
    ],
)
def test_the_rules_period_comes_from_the_timers_calendar_where_it_says_one(calendar, period):
    assert templated("{{ _drift_timer_calendar_period }}", drift_timer_on_calendar=calendar) == period
    settings = templated("{{ _drift_timer_rules_settings }}", drift_timer_on_calendar=calendar)
    assert settings == {"period": period}
    given = {"period": "2h", "selector": 'job="node"'}
    assert templated(
        "{{ _drift_timer_rules_settings }}", drift_timer_on_calendar=calendar, drift_timer_rules=given
    ) == (given)
