"""The drift timer, the drift playbook and the alert rules from an installed collection: this checkout built with
`ansible-galaxy collection build`, installed into a temporary collections path and used from a directory with no
checkout and no ansible.cfg of ours (no /opt/pve-gpu-recover assumed). Real ansible-playbook runs of the role's
entry points: `run` (playbooks/drift.yml) runs the installed drift/runner.py, `main` installs units that point at
the installed collection and the Python the role found (check mode: no systemd needed), `rules` writes the rules
drift/rules.py makes from the role's variables."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from drift import rules
from tests.conftest import ROOT, unavailable

BIN = Path(sys.executable).parent
INVENTORY = textwrap.dedent("""\
    all:
      children:
        pve_nodes:
          hosts:
            pve-x: {ansible_host: 127.0.0.1, ansible_port: 9, ansible_user: root}
        gpu_targets:
          hosts:
            ct300: {pve_node: pve-x, pve_vmid: 300}
    """)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("installed")
    home, consumer, collections = tmp / "home", tmp / "consumer", tmp / "collections"
    for directory in (home, consumer):
        directory.mkdir()
    (consumer / "empty.cfg").write_text("")
    (consumer / "hosts.yml").write_text(INVENTORY)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("ANSIBLE_", "PVE_GPU_"))}
    env.update(
        HOME=str(home),
        ANSIBLE_CONFIG=str(consumer / "empty.cfg"),
        ANSIBLE_COLLECTIONS_PATH=str(collections),
        ANSIBLE_COLLECTIONS_SCAN_SYS_PATH="false",
        ANSIBLE_LOCAL_TEMP=str(tmp / "ansible-tmp"),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_SHOW_CUSTOM_STATS="true",
    )

    def galaxy(*argv):
        done = subprocess.run(
            [str(BIN / "ansible-galaxy"), "collection", *argv],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr

    galaxy("build", "--output-path", str(tmp / "dist"), str(ROOT))
    (artifact,) = (tmp / "dist").glob("*.tar.gz")
    galaxy("install", "-p", str(collections), str(artifact))
    root = collections / "ansible_collections" / "pve_gpu" / "recover"
    assert not (root / ".venv").exists() and not (root / "collections").exists()  # nothing of a checkout's
    # What a user of the collection validates reports and summaries with, and makes the rules with, comes with it.
    for shipped in ("docs/schema/report.schema.json", "docs/schema/summary.schema.json", "drift/rules.py"):
        assert (root / shipped).read_text() == (ROOT / shipped).read_text(), shipped
    return SimpleNamespace(root=root, consumer=consumer, env=env, tmp=tmp)


def playbook(installed, *argv, check=False):
    command = [str(BIN / "ansible-playbook"), "-i", str(installed.consumer / "hosts.yml"), *argv]
    done = subprocess.run(
        command, cwd=installed.consumer, env=installed.env, capture_output=True, text=True, timeout=300, check=False
    )
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def play(installed, name, tasks_from, variables, *argv, check=False):
    """A play of the consumer's own that runs an entry point of the installed role on this machine."""
    path = installed.consumer / f"{name}.yml"
    path.write_text(
        json.dumps(
            [
                {
                    "name": name,
                    "hosts": "localhost",
                    "connection": "local",
                    "gather_facts": False,
                    "tasks": [
                        {
                            "name": "The role's entry point",
                            "ansible.builtin.import_role": {
                                "name": "pve_gpu.recover.drift_timer",
                                "tasks_from": tasks_from,
                            },
                            "vars": variables,
                        }
                    ],
                }
            ]
        )
    )
    return playbook(installed, *argv, str(path), check=check)


def test_the_drift_playbook_runs_the_installed_runner(installed, tmp_path):
    state = tmp_path / "state"
    done = playbook(
        installed,
        "-e",
        f"drift_timer_state_dir={state}",
        "-e",
        f"drift_timer_textfile_dir={tmp_path}",
        "pve_gpu.recover.drift",
    )
    assert done.returncode == 2, done.stdout + done.stderr  # the target's node does not answer: exit 1 fails it
    summary = json.loads((state / "summary.json").read_text())
    assert summary["project"] == str(installed.root)  # the installed copy's recover.yml, no checkout
    assert summary["targets"]["ct300"]["status"] == "unreachable"
    assert (summary["targets"]["ct300"]["node"], summary["targets"]["ct300"]["vmid"]) == ("pve-x", 300)
    assert "drift check failed (exit 1)" in done.stdout
    # The Python the role found: the one that runs the play has ansible-runner and prometheus-client.
    assert not (state / "venv").exists()


def test_a_python_that_lacks_what_the_runner_needs_is_named_with_what_to_install(installed, tmp_path):
    lacking = shutil.which("python3", path="/usr/bin")
    probe = subprocess.run([lacking, "-c", "import ansible_runner"], capture_output=True, check=False)
    if probe.returncode == 0:
        unavailable(f"{lacking} has ansible-runner: no Python here lacks it")
    state = ["-e", f"drift_timer_state_dir={tmp_path / 'state'}", "-e", "drift_timer_textfile_dir="]
    done = playbook(installed, *state, "-e", f"drift_timer_python={lacking}", "pve_gpu.recover.drift")
    assert done.returncode == 2
    assert f"drift_timer_python {lacking} cannot run drift/runner.py: it lacks ansible-core, ansible_runner," in (
        " ".join(done.stdout.split())
    )
    assert "-m pip install 'ansible-core>=2.19.0,<2.22.0' 'ansible-runner>=2.4.3'" in " ".join(done.stdout.split())
    # None found (the places the role looks, as if the play's Python lacked them too; the list itself:
    # test_drift_timer_units.py), none to make: each place looked at is named with what it lacks.
    looked = json.dumps({"_drift_timer_python_candidates": [f"{installed.root}/.venv/bin/python", lacking]})
    done = playbook(installed, *state, "-e", looked, "-e", "drift_timer_venv_install=false", "pve_gpu.recover.drift")
    assert done.returncode == 2
    said = " ".join(done.stdout.split())
    assert "no Python here can run drift/runner.py" in said
    assert f"{installed.root}/.venv/bin/python: not there" in said
    assert f"{lacking}: ansible-core, ansible_runner, prometheus_client, ansible-playbook beside it" in said
    assert "drift_timer_venv_install is false" in said


def test_the_timer_points_at_the_installed_collection_and_the_python_found(installed, tmp_path):
    variables = {
        "drift_timer_unit_dir": str(tmp_path / "units"),
        "drift_timer_state_dir": str(tmp_path / "state"),
        "drift_timer_textfile_dir": str(tmp_path / "textfile"),
        "drift_timer_inventory": str(installed.consumer / "hosts.yml"),
        "drift_timer_user": os.environ.get("USER") or "root",
    }
    (tmp_path / "units").mkdir()
    (tmp_path / "state").mkdir()
    done = play(installed, "timer", "main", variables, "--check", "--diff", check=True)
    service = done.stdout[done.stdout.index("pve-gpu-drift.service") :]
    assert f'ExecStart="{sys.executable}" "{installed.root}/drift/runner.py" \\' in service
    assert f'    --project "{installed.root}" \\' in service
    assert "/opt/pve-gpu-recover" not in done.stdout


def test_the_rules_entry_point_writes_what_drift_rules_makes_of_the_roles_variables(installed, tmp_path):
    if not shutil.which("promtool"):
        unavailable("promtool is not installed (Debian package prometheus; `make system-deps`)")
    dest = tmp_path / "pve_gpu_recover.rules.yml"
    settings = {"selector": 'job="drift"', "alerts": {"PveGpuRecoverTargetFailed": {"severity": "page"}}}
    variables = {
        "drift_timer_rules_dest": str(dest),
        "drift_timer_on_calendar": "*:0/15",
        "drift_timer_rules": settings,
    }
    play(installed, "rules", "rules", variables, check=True)
    assert dest.read_text() == rules.render({"period": "15m", **settings})
    assert play(installed, "rules", "rules", variables, check=True).stdout.count("changed=0") == 1  # idempotent
    # A schedule whose period the role cannot tell, and settings the generator refuses: each says what to do.
    done = play(installed, "rules", "rules", dict(variables, drift_timer_on_calendar="Mon..Fri 06:00"))
    assert done.returncode == 2
    assert "set drift_timer_rules.period (e.g. 30m)" in " ".join(done.stdout.split())
    bad = dict(variables, drift_timer_rules={"alerts": {"PveGpuRecoverDrfit": {}}})
    done = play(installed, "rules", "rules", bad)
    assert done.returncode == 2
    assert "drift_timer_rules: drift/rules.py: alerts: unknown alert 'PveGpuRecoverDrfit'" in done.stdout
    assert dest.read_text() == rules.render({"period": "15m", **settings})  # the installed rules are left as they were


def test_where_no_python_has_them_the_role_makes_a_venv_and_checks_it(installed, tmp_path):
    """pip for real (PyPI, or the index pip is set up for here); a package list that lacks ansible-runner makes a
    venv the runner cannot use: refused, naming what it lacks, never run."""
    lacking = shutil.which("python3", path="/usr/bin")
    state = tmp_path / "state"
    given = {
        "_drift_timer_python_candidates": [lacking],
        "drift_timer_venv_packages": ["prometheus-client"],
        "drift_timer_state_dir": str(state),
        "drift_timer_textfile_dir": "",
    }
    done = playbook(installed, "-e", json.dumps(given), "pve_gpu.recover.drift")
    said = " ".join(done.stdout.split())
    if "could not be made" in said:
        unavailable(f"pip cannot install prometheus-client here (no index): {said[-300:]}")
    assert done.returncode == 2
    venv = state / "venv" / "bin" / "python"
    imported = subprocess.run([str(venv), "-c", "import prometheus_client"], capture_output=True, check=False)
    assert imported.returncode == 0, imported.stderr
    assert f"the runner's venv {state / 'venv'} was made with prometheus-client, yet it lacks ansible-core" in said
    assert not (state / "summary.json").exists()  # the runner never ran
