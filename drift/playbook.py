# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The drift runner's side of ansible-runner: one ansible-playbook run of recover.yml, its events, its reports.

Three things ansible-runner would change are set back (its environment replaces ansible.cfg's callbacks, it turns
host key checking off, it finds ansible-playbook on PATH), and a long step's progress is written to the journal as
it comes: the line the step's action prints at each status call of its job (plugins/plugin_utils/long_step.py),
which ansible-runner hands over as a ``verbose`` event of the step's task, or the progress in a ``runner_on_async_poll``
event where a playbook has Ansible poll the module (plugins/module_utils/node/progress.py). docs/design.md,
"Scheduled drift correction", says why.
"""

from __future__ import annotations

import configparser
import contextlib
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.progress import KEY as PROGRESS_KEY
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.progress import describe

from drift import COLLECTIONS, collections_path
from drift.errors import DriftError, missing_package
from drift.files import load_reports, new_dir
from drift.text import one_line
from drift.unattended import UNATTENDED

PLAYBOOK = "recover.yml"
REPORT_CALLBACK = "pve_gpu.recover.recover_report"
# The events a summary is made of (the rest of a run's events are not kept).
KEPT_EVENTS = ("runner_on_start", "runner_on_failed", "runner_on_unreachable", "playbook_on_stats")


def progress_line(event):
    """``"train200: training_venv: installing the lock with `uv pip sync` (4m12s): Downloading torch (846.0MiB)"``
    from an event that carries a long step's progress, else ``""``; text the target chose is escaped.

    Two kinds: the ``verbose`` event of the line a step's action printed (its task's action is the collection's
    module of that step, and the line names that step after the host), and a ``runner_on_async_poll`` event whose
    status holds the progress (node_progress.describe)."""
    data = event.get("event_data") or {}
    if event.get("event") == "verbose":
        action = str(data.get("resolved_action") or data.get("task_action") or "")
        text = str(event.get("stdout") or "")
        step = action.removeprefix("pve_gpu.recover.")
        ours = action.startswith("pve_gpu.recover.") and text.split(": ", 2)[1:2] == [step]
        return one_line(text, 700) if ours else ""
    if event.get("event") != "runner_on_async_poll":
        return ""
    res = data.get("res") if isinstance(data.get("res"), dict) else {}
    text = describe(res.get(PROGRESS_KEY))
    return f"{one_line(data.get('host') or '?', 200)}: {text}" if text else ""


def import_ansible_runner():
    try:
        import ansible_runner  # noqa: PLC0415 (optional until a run: the pure functions above work without it)
    except ImportError as error:
        raise DriftError(missing_package("ansible-runner", error)) from None
    return ansible_runner


def host_key_checking(project):
    """What ansible-playbook alone would do: the environment's, else ansible.cfg's, else on.

    ansible-runner turns host key checking off unless ANSIBLE_HOST_KEY_CHECKING is set; ssh to the nodes as root
    must not lose it silently.
    """
    if "ANSIBLE_HOST_KEY_CHECKING" in os.environ:
        return os.environ["ANSIBLE_HOST_KEY_CHECKING"]
    config = configparser.ConfigParser(interpolation=None)
    with contextlib.suppress(OSError, configparser.Error):
        config.read(Path(project) / "ansible.cfg", encoding="utf-8")
    return config.get("defaults", "host_key_checking", fallback="True")


def environment(args, report_dir):
    """What ansible-playbook needs beyond this process's environment, whatever ansible-runner sets."""
    callbacks = [c for c in os.environ.get("ANSIBLE_CALLBACKS_ENABLED", "").split(",") if c.strip()]
    env = {
        # systemd gives a bare PATH: the venv's ansible-playbook first.
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)]),
        "PVE_GPU_RECOVER_REPORT_DIR": str(report_dir),
        # ansible-runner's environment replaces ansible.cfg's list: the collection's report callback, by its FQCN.
        "ANSIBLE_CALLBACKS_ENABLED": ",".join(dict.fromkeys([*callbacks, REPORT_CALLBACK])),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_HOST_KEY_CHECKING": host_key_checking(args.project),
    }
    if (args.project / "ansible.cfg").is_file():
        env["ANSIBLE_CONFIG"] = str(args.project / "ansible.cfg")
    # recover.yml imports pve_gpu.recover.recover: the project's own collection (a checkout's collections/), else the
    # one this runner belongs to (an installed copy: AWX, an execution environment), before any other copy.
    own = args.project / "collections"
    env["ANSIBLE_COLLECTIONS_PATH"] = collections_path(own if own.is_dir() else COLLECTIONS, args.project)
    return env


def run_playbook(
    ansible_runner,
    args,
    *,
    phase,
    run_dir,
    deadline,
    limit=None,
    cancel=lambda: False,
    clock=time.monotonic,
    log_line=lambda line: print(line, file=sys.stderr, flush=True),
):
    """One ansible-playbook run of recover.yml through ansible-runner: ``phase`` is ``check`` or ``correct``.

    A long step's progress (a venv build or a warm-up followed as an async job) goes to ``log_line`` as it comes:
    the journal, under systemd. Returns ``{phase, status, rc, seconds, timeout, run_ids, report_dir, log, error,
    reports, events}``.
    """
    report_dir = new_dir(run_dir / phase)
    log = run_dir / f"{phase}.log"
    events = []
    remaining = deadline - clock()
    result = {
        "phase": phase,
        "status": "timeout",
        "rc": None,
        "seconds": 0.0,
        "timeout": args.timeout,
        "report_dir": str(report_dir),
        "log": str(log),
        "error": None,
    }
    if remaining < 1:
        return dict(result, reports={}, events=[], run_ids=[])
    cmdline = ["--check", "--diff"] if phase == "check" else ["--diff"]
    for extra in args.extra_vars:
        cmdline += ["-e", extra]
    started = clock()

    def on_event(event):
        if event.get("event") in KEPT_EVENTS:
            events.append(event)
        elif event.get("event") in ("verbose", "runner_on_async_poll"):
            line = progress_line(event)
            if line:
                log_line(line)
        return True

    try:
        with tempfile.TemporaryDirectory(prefix="pve-gpu-drift-") as private:
            done = ansible_runner.run(
                private_data_dir=private,
                ident=phase,
                project_dir=str(args.project),
                playbook=str(args.project / PLAYBOOK),
                inventory=args.inventory,
                limit=limit,
                forks=args.forks,
                cmdline=shlex.join(cmdline),
                # After the user's -e on the command line: a correction is always unattended.
                extravars={UNATTENDED: True} if phase == "correct" else None,
                envvars=environment(args, report_dir),
                timeout=max(1, math.ceil(remaining)),
                event_handler=on_event,
                cancel_callback=cancel,
                quiet=True,
                settings={"pexpect_timeout": 1, "suppress_ansible_output": True},
            )
            stdout = Path(done.config.artifact_dir) / "stdout"
            if stdout.is_file():
                shutil.copyfile(stdout, log)
            result.update(status=done.status, rc=done.rc)
    except Exception as error:  # one run's failure is reported, never a traceback
        result.update(status="error", error=f"ansible-runner could not run {PLAYBOOK} ({phase}): {one_line(error)}")
    reports = load_reports(report_dir)
    result.update(
        seconds=round(clock() - started, 3),
        reports=reports,
        events=events,
        run_ids=sorted({f["report"]["run_id"] for f in reports.values() if f["report"] and f["report"].get("run_id")}),
    )
    return result


def public_run(run):
    return {k: run[k] for k in ("phase", "status", "rc", "seconds", "run_ids", "report_dir", "log", "error")}
