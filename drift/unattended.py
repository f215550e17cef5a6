# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Whether a checkout really runs unattended: the test ``--correct`` passes before it touches a target.

A correction runs ``recover.yml -e recover_unattended=true`` and trusts the roles to hand that to the fact pass and
to each acting module, which then leave a live job's processes, venv and caches to a window. Mentioning the
variable proves nothing (a role can default it and never pass it on), so the runner runs the checkout's own
recover.yml, in check mode with ``recover_unattended=true``, against a synthetic target on localhost with every
step on and pending, and looks at what each module was called with:

* a copy of the checkout without its modules (``library/`` and its links in ``plugins/modules/``, a role's
  ``library/``): each module is a stand-in of the same name that does nothing but return the options it got (the
  fact pass's returns every step pending), so the playbook, roles, templates and action plugins are the checkout's
  own and nothing real runs;
* the fact pass (``target_facts``) must get ``unattended`` true in the settings of every step in UNATTENDED_STEPS,
  and each of those steps' modules must have run with option ``unattended`` true (Ansible's boolean, as the
  module's spec reads it).

A module that never ran, a run that failed, or any other shape fails the test: refused, never assumed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ansible_collections.pve_gpu.recover.plugins.module_utils.steps import registry as step_registry

from drift import collections_path  # also puts the collection on sys.path

PLAYBOOK = "recover.yml"
UNATTENDED = "recover_unattended"
# The steps that touch what a live job needs (docs/design.md, "Unattended mode"): their modules must honour it.
# The steps that honour the unattended mode: those whose settings have `unattended` (the registry's, in its order).
UNATTENDED_STEPS = tuple(
    name for name in step_registry.STEP_NAMES if "unattended" in step_registry.load_step(name).SPEC
)
FACT_PASS = "target_facts"  # noqa: S105 (a module name)
PROBE_HOST = "unattended-probe"
PROBE_NODE = "unattended-probe-node"
# The key the stand-ins return what they got under.
PROBE_KEY = "pve_gpu_recover_probe"
# Not copied: nothing Ansible reads for recover.yml (nor hidden top-level directories but .ansible; every module,
# library/, its links in plugins/modules/ and a role's library/, is replaced by stand-ins).
SKIP_TOP = {"reports", "tests", "docs", "bench", "molecule", "__pycache__"}
SKIP_ANY = {"library", "__pycache__", ".git", ".venv", ".venv-latest"}

STUB = """#!/usr/bin/python
# WANT_JSON
# A stand-in made by drift/unattended.py: returns the options it got, changes nothing.
import json
import sys

NAME = {name!r}
with open(sys.argv[1], encoding="utf-8") as handle:
    args = json.load(handle)
params = {{k: v for k, v in args.items() if not k.startswith("_ansible_")}}
probe = {{"module": NAME, "params": params, "check_mode": args.get("_ansible_check_mode")}}
result = {{"changed": False, {key!r}: probe}}
if NAME == "target_facts":
    names = [n for n in (params.get("steps") or {{}}) if isinstance(n, str)]
    facts = {{
        n: {{"pending": n != "preflight", "changes": ["probe"], "problems": [], "diff": {{"before": "", "after": ""}},
            "needs_window": [], "ending_pids": [], "kept_gpus": [], "venv_changes": False}}
        for n in names
    }}
    facts.update(run_id=params.get("run_id") or "probe", target={{"label": NAME}}, lock={{"held": False}},
                 pending=[n for n in names if n != "preflight"], problems=[])
    result["ansible_facts"] = {{"pve_gpu_recover": facts}}
print(json.dumps(result))
"""


# -- pure -------------------------------------------------------------------------------------------------------------
def stub_module(name):
    """The stand-in for module ``name``: a WANT_JSON script that returns its options under PROBE_KEY (the fact
    pass's also every step it was given pending, so each acting task runs)."""
    return STUB.format(name=name, key=PROBE_KEY)


def probe_inventory(python, lock_file):
    """The synthetic target: a CT on a node, both this machine (connection local), every step on."""
    local = {"ansible_connection": "local", "ansible_python_interpreter": python}
    settings = {
        # Every step on (<step>_enabled), with what a step that is on needs, so its acting task is templated and run.
        **{f"{step}_enabled": True for step in (*UNATTENDED_STEPS, "verify")},
        "training_code_commit": "0" * 40,
        "training_venv_lock_file": str(lock_file),
    }
    return {
        "all": {
            "vars": dict(local, **settings),
            "hosts": {PROBE_NODE: {}},
            "children": {"gpu_targets": {"hosts": {PROBE_HOST: {"pve_vmid": 100, "pve_node": PROBE_NODE}}}},
        }
    }


def is_true(value):
    """Ansible's boolean as a module's ``type: bool`` option reads it (``True``, ``"true"``, ``"yes"``, ``1``)."""
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("y", "yes", "on", "1", "true", "t")


def calls_of(events):
    """``{module: [params, ...]}`` from the probe run's events (the stand-ins' results), and its failures."""
    calls, failures = {}, []
    for event in events:
        data = event.get("event_data") or {}
        res = data.get("res") if isinstance(data.get("res"), dict) else {}
        if event.get("event") in ("runner_on_failed", "runner_on_unreachable") and not data.get("ignore_errors"):
            failures.append(f"{data.get('task')}: {res.get('msg') or 'failed'}")
            continue
        probe = res.get(PROBE_KEY)
        if event.get("event") == "runner_on_ok" and isinstance(probe, dict) and isinstance(probe.get("params"), dict):
            calls.setdefault(probe.get("module"), []).append(probe["params"])
    return calls, failures


def contract_problems(calls, failures=(), steps=UNATTENDED_STEPS):
    """What keeps a checkout from running unattended, one sentence each; ``[]`` when it honours the contract.

    ``calls`` is :func:`calls_of`'s: the fact pass must get each step's settings with ``unattended`` true, and each
    step's module must have run with ``unattended`` true.
    """
    problems = [f"the check run failed at {failure}" for failure in failures]
    passes = calls.get(FACT_PASS) or []
    if not passes:
        problems.append(f"the fact pass ({FACT_PASS}) never ran")
    for params in passes:
        settings = params.get("steps") if isinstance(params.get("steps"), dict) else {}
        for step in steps:
            spec = settings.get(step)
            if not isinstance(spec, dict):
                problems.append(f"the fact pass got no settings for {step}")
            elif not is_true(spec.get("unattended")):
                problems.append(f"the fact pass got {step}'s settings with unattended={spec.get('unattended')!r}")
    for step in steps:
        runs = calls.get(step) or []
        if not runs:
            problems.append(f"the {step} module never ran with work pending")
        problems += [
            f"the {step} module ran with unattended={params.get('unattended')!r}"
            for params in runs
            if not is_true(params.get("unattended"))
        ]
    return problems


# -- the probe run ----------------------------------------------------------------------------------------------------
def module_names(project):
    """The modules the checkout ships: ``library/*.py`` (``plugins/modules`` links to them) and every role's
    ``library/*.py``."""
    project = Path(project)
    found = [
        *project.glob("library/*.py"),
        *project.glob("roles/*/library/*.py"),
    ]
    return sorted({path.stem for path in found if path.stem != "__init__"})


def copy_checkout(project, into):
    """The checkout's files Ansible reads for recover.yml, links kept as links (collections/ then finds the copy),
    every module a stand-in: library/ holds only those (plugins/modules links to it), and no role keeps a
    ``library`` directory."""

    def skip(directory, names):
        top = Path(directory) == Path(project)
        hidden = {n for n in names if top and n.startswith(".") and n != ".ansible"}
        return [n for n in names if n in SKIP_ANY or n in hidden or (top and n in SKIP_TOP)]

    shutil.copytree(project, into, symlinks=True, ignore=skip)
    # An installed collection has no collections/ link to itself: the copy gets one, so recover.yml's
    # pve_gpu.recover.recover is the copy's (stand-in modules), never the installed original.
    link = Path(into) / "collections" / "ansible_collections" / "pve_gpu" / "recover"
    if not os.path.lexists(link):
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.join("..", "..", ".."))
    # Where the collection finds its modules (plugins/modules, by FQCN: in a checkout a link to library/) and where
    # a plain project does (library/).
    for stubs in (Path(into) / "library", Path(into) / "plugins" / "modules"):
        if stubs.is_symlink():
            continue
        stubs.mkdir(parents=True, exist_ok=True)
        for real in stubs.glob("*.py"):
            real.unlink()
        for name in [*module_names(project), *UNATTENDED_STEPS, FACT_PASS]:
            (stubs / f"{name}.py").write_text(stub_module(name), encoding="utf-8")


def probe(ansible_runner, project, *, timeout=120, cancel=lambda: False, python=sys.executable):
    """Run the checkout's recover.yml as described above; the contract's problems (``[]``: it honours it)."""
    with tempfile.TemporaryDirectory(prefix="pve-gpu-drift-unattended-") as name:
        temp = Path(name)
        copy = temp / "project"
        copy_checkout(project, copy)
        lock_file = temp / "lock.txt"
        lock_file.write_text("# the unattended probe's lock: never installed\n", encoding="utf-8")
        inventory = temp / "hosts.json"
        inventory.write_text(json.dumps(probe_inventory(python, lock_file)), encoding="utf-8")
        (temp / "runner").mkdir()
        events = []
        env = {
            "PATH": os.pathsep.join([str(Path(python).parent), os.environ.get("PATH", os.defpath)]),
            # Its temp files and the fact pass's payload store stay here, apart from real runs'.
            "ANSIBLE_LOCAL_TEMP": str(temp / "ansible-tmp"),
            "PVE_GPU_RECOVER_REPORT_DIR": str(temp / "reports"),
            "ANSIBLE_NOCOLOR": "1",
        }
        if (copy / "ansible.cfg").is_file():
            env["ANSIBLE_CONFIG"] = str(copy / "ansible.cfg")
        # The copy first, whatever collections path this process has (an AWX job's names its own).
        env["ANSIBLE_COLLECTIONS_PATH"] = collections_path(copy / "collections", copy)
        try:
            done = ansible_runner.run(
                private_data_dir=str(temp / "runner"),
                ident="unattended",
                project_dir=str(copy),
                playbook=str(copy / PLAYBOOK),
                inventory=[str(inventory)],
                cmdline="--check",
                extravars={UNATTENDED: True},
                envvars=env,
                timeout=max(1, int(timeout)),
                event_handler=lambda event: events.append(event) or True,
                cancel_callback=cancel,
                quiet=True,
                settings={"pexpect_timeout": 1, "suppress_ansible_output": True},
            )
        except Exception as error:  # the probe's failure refuses --correct, with why
            return [f"ansible-runner could not run the check: {error}"]
        calls, failures = calls_of(events)
        problems = contract_problems(calls, failures)
        if done.status != "successful" and not failures:
            problems.insert(0, f"the check run ended {done.status} (rc {done.rc})")
        return problems
