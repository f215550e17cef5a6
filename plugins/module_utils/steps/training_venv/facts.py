# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The training venv step: is the venv exactly the locked set, and what would a run change.

Its probe part (``venv_probe``) reads, inside the target, the venv's ``pyvenv.cfg``, the Name and
Version of every installed distribution and ``torch/version.py``, without running the venv's python
(``import torch`` costs seconds). Everything here is pure: the lock text and the probe's answer in, facts out.

Exact means exact: versions are compared as strings, local tag included. PEP 440 says ``torch==2.11.0`` is
satisfied by ``2.11.0+cu130``; here they differ, because the local tag is the CUDA build and a wrong build is
the drift this project exists to find. The lock is a ``uv pip compile --generate-hashes`` requirements file or a
PEP 751 ``pylock.toml`` (:func:`lock.parse_pylock`, read into the same form); the role reads it on the controller
(``lookup('file', training_venv_lock_file)``) and passes its TEXT, so the node needs no copy of it and the fact
pass sees exactly what the build will install. Or the lock lives in the training repository (``lock_from_repo``):
the probe reads it inside the target at the commit the training code step pins (:func:`lock.resolve_lock`), so the
code and its venv move together.

Unattended (``unattended``, the scheduled drift corrector), a venv that needs a rebuild is not swapped while a
live process of the target runs from it: the facts name those processes in ``needs_window`` and nothing is
pending. Which processes run from it is read on the node (:func:`read_node`,
runs_from.processes_running_from: the target's processes by their cgroup, then each one's exe, an
interpreter's argv[0] and its mapped files), and only when the venv needs a rebuild: a converged run reads nothing
more. On the node, because node/process.py already reads the target's processes there with bounded reads (a process
stuck in the driver costs seconds, never the run), the kernel's answer is not the CT's word, and the read costs no
command in the target. Processes the GPU step ends first (its facts, before this step's) do not count.

Here: NAME, SPEC and the settings check, the window rule, retention and the fact pass's node reads. The lock
(parsing, ``lock_from_repo``, VenvError) is lock.py's; the venv compared with it is compare.py's.
"""

from __future__ import annotations

import re

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.process import owner_of
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.runs_from import processes_running_from, under
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.text import printable
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.handoff import ending_pids_of
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import probe as venv_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.compare import (
    build_problem,
    deferred_facts,
    venv_facts,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.lock import (
    VenvError,
    check_source,
    expected_python,
    lock_source,
    parse_lock,
    python_mismatch,
    resolve_lock,
    shown,
)

NAME = "training_venv"
PROBE = venv_probe
SPEC = {
    # Where the venv lives inside the target; a rebuild puts the new venv beside it and swaps.
    "path": {"type": "path", "default": "/opt/venvs/train"},
    # The lock's text (`uv pip compile --generate-hashes` output: name==version pins, hashes, index options; or a
    # PEP 751 pylock.toml). Exactly one of lock and lock_from_repo (check_spec).
    "lock": {"type": "str"},
    # The lock committed in the training repository instead, read inside the target at the pinned commit:
    # {"repo": training_code_path, "commit": training_code_commit, "path": relative to repo, "git": training_code_git}.
    "lock_from_repo": {
        "type": "dict",
        "options": {
            "repo": {"type": "path", "required": True},
            "commit": {"type": "str", "required": True},
            "path": {"type": "str", "required": True},
            "git": {"type": "str", "default": "git"},
        },
    },
    # Python minor the venv must have ("3.11"); None: the `--python-version` the lock was compiled with, found in
    # uv's header, else not checked. A lock's wheels are only valid for the python it was compiled for. (Not
    # `python`: that option is the target's interpreter that runs the probe parts, in every module.)
    "python_version": {"type": "str"},
    # pip/setuptools/wheel when the lock does not pin them: "ignore" (see compare.TOOLING) or "exact" (they are extra).
    "tooling": {"type": "str", "default": "ignore", "choices": ["ignore", "exact"]},
    # The scheduled drift corrector: never swap the venv under a live process of the target (needs_window).
    "unattended": {"type": "bool", "default": False},
    # Versions (<path>.<stamp>) that stay, the current one counted; None: all of them (attended) or
    # unattended_keep (unattended: nobody watches the disk fill with a GB-sized venv per rebuild).
    "keep": {"type": "int"},
    "unattended_keep": {"type": "int", "default": 3},
    # What builds the venv: uv inside the target (a name on its PATH or a path), else python3 -m venv + pip; a uv
    # wheel the role installs into the target when a rebuild is due (only whether one is given counts here). A
    # rebuild the target cannot do is a problem of the fact pass, before any step changes anything.
    "uv": {"type": "str", "default": "uv"},
    "uv_wheel": {"type": "path"},
}
# The settings whose role variable is not training_venv_<setting> (registry.settings_from_variables): the role
# computes them (roles/training_venv/vars/main.yml): the lock's text from training_venv_lock_file or
# training_venv_requirements, where it is read in the repository from training_venv_lock_from_repo.
ROLE_VARIABLES = {"lock": "_training_venv_lock", "lock_from_repo": "_training_venv_lock_from_repo"}
SPEC_DEFAULTS = {name: option.get("default") for name, option in SPEC.items()}
_PYTHON_MINOR = re.compile(r"^\d+\.\d+$")
COMMAND_SHOWN = 120  # characters of a process's command line a message quotes
# Where the uv of a wheel goes inside the target, one directory per version (acting.install_uv puts it there).
UV_HOME = "/usr/local/lib/pve-gpu-recover"
# PyPI's file name of a uv wheel (PEP 427: name-version[-build]-python-abi-platform.whl): its version says where.
_UV_WHEEL = re.compile(r"uv-([0-9][0-9A-Za-z.+!_]*)-(?:[0-9][^-/]*-)?py3-none-[^-/]+\.whl")


def check_spec(spec):
    """Why the step's settings cannot work (one sentence), or ``""``: called once the SPEC types are checked."""
    for name in ("keep", "unattended_keep"):
        if spec.get(name) is not None and spec[name] < 1:
            return f"{name} is {spec[name]}; the current venv counts, so {name} is at least 1"
    wheel = spec.get("uv_wheel")
    if wheel and wheel_uv_path(wheel) is None:
        return (
            f"uv_wheel is {shown(wheel, 300)}, whose name does not say its uv's version; give PyPI's uv wheel under "
            "its own file name, uv-<version>-py3-none-<platform>.whl (training_venv_uv_wheel)"
        )
    python = spec["python_version"]
    if python is not None and not _PYTHON_MINOR.match(python):
        return f"python_version is {python!r}; expected a minor version like '3.11'"
    source = spec.get("lock_from_repo")
    if source and spec.get("lock") is not None:
        return (
            "lock and lock_from_repo are both set; give the lock one way: training_venv_lock_file, "
            "training_venv_requirements or training_venv_lock_from_repo"
        )
    if source:
        return check_source(source)
    if spec.get("lock") is None:
        return (
            "no lock: give training_venv_lock_file, training_venv_requirements or training_venv_lock_from_repo (a "
            "lock in the training repository)"
        )
    try:
        lock = parse_lock(spec["lock"])
    except VenvError as error:
        return str(error)
    return python_mismatch(python, lock)


def code_step_resets(context):
    """Whether the training code step of this fact pass has work (it fetches and checks out the pinned commit)."""
    return bool(((context.get("steps") or {}).get("training_code") or {}).get("pending"))


def code_step_waits(context):
    """The training code step's ``needs_window`` in this fact pass (unattended: it does not move the repository
    under a live job), or ``[]``."""
    return list(((context.get("steps") or {}).get("training_code") or {}).get("needs_window") or [])


def waiting_facts(spec, answer, context, code_waits):
    """The facts of a venv whose lock is the repository's (``lock_from_repo``) while the training code step waits
    for a window: the venv waits with it (the code and its venv move together), so nothing is compared or pending
    and ``needs_window`` says why."""
    label = context["target"]["label"]
    facts = deferred_facts(spec, answer, label)
    sentence = (
        f"{label}: the venv at {spec['path']} follows the lock {lock_source(spec['lock_from_repo'])}, and the "
        f"training code step waits for a window ({'; '.join(code_waits)}): the venv waits with the code"
    )
    stays = facts["diff"]["before"]
    facts.update(changes=[], pending=False, diff={"before": stays, "after": stays}, needs_window=[sentence])
    facts.update(in_use=[], ending_pids=ending_pids_of(context), rebuild=False, uv_installed=False, prune=[])
    facts["prune_kept"] = []
    facts["keep"] = effective_keep(spec)
    return facts


def venv_roots(spec, answer):
    """The directories a process runs the venv from: ``path`` and, when it is a symlink (every venv this project
    built), the version it points to (``real_path``, resolved inside the target by the probe)."""
    roots = [spec["path"]]
    real = answer.get("real_path") if isinstance(answer, dict) else None
    if isinstance(real, str) and real.startswith("/") and real not in roots:
        roots.append(real)
    return roots


def describe_user(user):
    """``pid 516 (python3, pid 41 inside: 'python3 train.py'; mapped /opt/venvs/train.X/.../libtorch.so)``; a
    process the build script found inside the target (``inside``): ``pid 41 inside the target (python3)``."""
    if user.get("inside"):
        return f"pid {user['pid']} inside the target ({shown(user.get('name'))})"
    inside = f", pid {user['ns_pid']} inside" if user.get("ns_pid") not in (None, user["pid"]) else ""
    command = f": '{printable(user['command'])}'" if user.get("command") else ""
    how = f"; {user['how']} {shown(user['file'])}" if user.get("how") else f"; {user.get('error')}"
    return f"pid {user['pid']} ({shown(user.get('name'))}{inside}{command}{how})"


def window_message(label, path, changes, users, when=""):
    """The one sentence of a venv an unattended run does not swap: what it would change, who runs from it
    (``when``: words after "runs from it", e.g. that the build script found it just before the swap)."""
    shown = "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")
    sure = [u for u in users if not u.get("error")]
    unsure = [u for u in users if u.get("error")]
    who = []
    if sure:
        who.append(f"{', '.join(describe_user(u) for u in sure)} {'runs' if len(sure) == 1 else 'run'} from it{when}")
    if unsure:
        who.append(f"whether {', '.join(describe_user(u) for u in unsure)} runs from it cannot be told")
    return (
        f"{label}: the venv at {path} needs a rebuild ({shown}) but {' and '.join(who)}: it is not swapped under a "
        "live process; rebuilding it needs a window (stop the job, or run recover.yml without recover_unattended)"
    )


def evaluate_step(spec, answer, node, context):
    """The training venv facts of the fact pass (and of the module): :func:`venv_facts`, then the window rule.

    ``node``: :func:`read_node`'s ``{"users": [...]}`` (unattended with a rebuild due only) and, from the module in
    check mode, ``"ending"``: pids (inside the target) the GPU step would end first. Adds ``needs_window`` (one
    sentence, or none), ``in_use`` (the processes running from the venv, those the GPU step ends first left out)
    and ``ending_pids``. Unattended, a rebuild due while ``in_use`` is not empty is no change: ``changes`` is empty,
    the diff shows the venv as it stays, and nothing is pending. ``rebuild`` says a build is due, ``uv_installed``
    that it finds the uv of the role's wheel in the target already (:func:`wheel_uv_state`).
    """
    label = context["target"]["label"]
    code_waits = code_step_waits(context)
    if spec.get("lock_from_repo") and code_waits:
        return waiting_facts(spec, answer, context, code_waits)
    may_defer = bool(context.get("check_mode")) or code_step_resets(context)
    spec, deferred = resolve_lock(spec, answer, may_defer=may_defer)
    facts = deferred_facts(spec, answer, label) if deferred else venv_facts(spec, answer, label)
    ending = sorted(set(ending_pids_of(context)) | set(node.get("ending") or []))
    users = [u for u in node.get("users") or [] if u.get("ns_pid") not in ending]
    facts.update(in_use=users, needs_window=[], ending_pids=ending)
    if spec.get("unattended") and facts["changes"] and not facts["problems"] and users:
        facts["needs_window"] = [window_message(label, spec["path"], facts["changes"], users)]
        stays = facts["diff"]["before"]
        facts.update(changes=[], pending=False, diff={"before": stays, "after": stays})
    facts["rebuild"] = bool(facts["changes"]) and not facts["problems"]
    # A rebuild the target cannot do (no builder, no such python) stops the fact pass before anything changes.
    missing = build_problem(spec, answer, label, facts["expected_python"]) if facts["rebuild"] else None
    if missing:
        facts["problems"].append(missing)
        facts["rebuild"] = False
    # The uv of the role's wheel already in the target: the role copies no wheel, the module pipes no uv.
    facts["uv_installed"], unsafe = wheel_uv_state(spec, answer, label, facts["rebuild"])
    if unsafe:
        facts["problems"].append(unsafe)
        facts["rebuild"] = False
    # Retention: old versions beyond keep go, never the current one nor one a live process uses.
    version_users = node.get("version_users") or {}
    prune, kept = [], []
    for path in prune_candidates(spec, answer, facts["rebuild"]) if not (facts["problems"] or deferred) else []:
        using = [u for u in version_users.get(path, []) if u.get("ns_pid") not in ending]
        if using:
            kept.append({"path": path, "pids": sorted(u["pid"] for u in using), "reason": "in use"})
        else:
            prune.append(path)
    facts.update(prune=prune, prune_kept=kept, keep=effective_keep(spec))
    facts["changes"] = facts["changes"] + [prune_line(path, facts["keep"]) for path in prune]
    facts["pending"] = bool(facts["changes"]) and not facts["problems"]
    return facts


# -- the uv of the role's wheel ------------------------------------------------------------------------------------
def wheel_uv_version(wheel):
    """The uv version of the wheel ``wheel``, from its file name alone (nothing is opened):
    ``/ctl/uv-0.13.9-py3-none-manylinux_2_17_x86_64.whl`` -> ``0.13.9``; None without a wheel or for a name that is
    not PyPI's (``uv.whl``)."""
    found = _UV_WHEEL.fullmatch(str(wheel or "").rsplit("/", 1)[-1])
    return found.group(1) if found else None


def wheel_uv_path(wheel):
    """Where the uv of the wheel ``wheel`` goes in the target: ``/usr/local/lib/pve-gpu-recover/uv-0.13.9/uv``
    (:func:`wheel_uv_version`), or None."""
    version = wheel_uv_version(wheel)
    return f"{UV_HOME}/uv-{version}/uv" if version else None


def wheel_uv_state(spec, answer, label, rebuild):
    """``(installed, problem)``: whether a due rebuild finds the uv of the role's wheel in the target (the probe's
    ``wheel_uv``, ``ct_venv.trusted_executable``), and the problem (one sentence, or None) when another user than
    root could change the place it goes, where it would be put and run as root. ``(False, None)`` without a wheel
    or a rebuild (that uv is not run then)."""
    found = answer.get("wheel_uv")
    unsafe = found.get("unsafe") if isinstance(found, dict) else None
    if found is not None and not (
        isinstance(found, dict) and isinstance(found.get("installed"), bool) and isinstance(unsafe, (str, type(None)))
    ):
        raise VenvError("the training_venv probe answered a 'wheel_uv' of the wrong shape", kind="probe")
    if not (rebuild and spec.get("uv_wheel") and found):
        return False, None
    if unsafe:
        return False, (
            f"{label}: the uv of training_venv_uv_wheel would be put and run as root at "
            f"{wheel_uv_path(spec['uv_wheel'])}, but a user other than root could change it: {printable(unsafe)}; "
            "so nothing is built: make every directory from / to it root's and not writable by a group or other "
            "users (chown root:root, chmod go-w), or remove what another user put there"
        )
    return found["installed"], None


# -- retention -------------------------------------------------------------------------------------------------
def effective_keep(spec):
    """How many versions stay, the current one counted: ``keep``; unset, ``unattended_keep`` in an unattended run
    and None (every one) in an attended one."""
    if spec.get("keep") is not None:
        return spec["keep"]
    return spec.get("unattended_keep", SPEC_DEFAULTS["unattended_keep"]) if spec.get("unattended") else None


def plan_prune(versions, current, keep):
    """The finished versions retention removes, oldest first; the same rule as the build script's plan_retention.

    ``current``: the version that counts as current after this run (the one a rebuild makes, any name not in
    ``versions``; else the one ``path`` resolves to), or None when there is none. ``plan_prune(["/v/t.1", "/v/t.2",
    "/v/t.3"], "/v/t.3", 2)`` -> ``["/v/t.1"]``; ``keep`` None -> ``[]``.
    """
    if keep is None:
        return []
    older = [v for v in sorted(versions, reverse=True) if v != current]
    return sorted(older[max(keep - (1 if current else 0), 0) :])


def prune_candidates(spec, answer, rebuilding):
    """The versions retention would remove in this run, before asking who uses them."""
    versions = [v for v in answer.get("versions") or [] if isinstance(v, str) and v.startswith("/")]
    # A rebuild makes the newest version, which counts as current; else the one path resolves to counts.
    current = f"{spec['path']}.<new>" if rebuilding else (answer.get("real_path") if answer.get("exists") else None)
    return plan_prune(versions, current, effective_keep(spec))


def prune_line(path, keep):
    """``remove old venv version /opt/venvs/train.20261201T101500Z (keep 3: the current one and the 2 newest old
    ones stay)``."""
    stay = {1: "only the current one stays", 2: "the current one and the newest old one stay"}.get(
        keep, f"the current one and the {keep - 1} newest old ones stay"
    )
    return f"remove old venv version {shown(path)} (keep {keep}: {stay})"


# -- the fact pass ---------------------------------------------------------------------------------------------
def probe_payload(spec, timeout=60):
    """What the probe part reads inside the target: ``{"path": "/opt/venvs/train", "timeout": 60, "uv": "uv",
    "python": "3.11"}`` (``python``: :func:`expected_python`, what a build would ask for; the spec's alone while
    the lock comes from the repository), with ``lock_from_repo`` the lock in the repository:
    ``"lock_from_repo": {"repo", "commit", "path", "git"}``, and with ``uv_wheel`` where its uv goes
    (:func:`wheel_uv_path`): ``"wheel_uv": "/usr/local/lib/pve-gpu-recover/uv-0.13.9/uv"``."""
    lock = spec.get("lock")
    python = expected_python(spec, parse_lock(lock)) if lock is not None else spec["python_version"]
    payload = {"path": spec["path"], "timeout": timeout, "uv": spec.get("uv") or "uv", "python": python}
    if wheel_uv_path(spec.get("uv_wheel")):  # is the uv of the role's wheel there already
        payload["wheel_uv"] = wheel_uv_path(spec["uv_wheel"])
    source = spec.get("lock_from_repo")
    if source:
        payload["lock_from_repo"] = {key: source.get(key) for key in ("repo", "commit", "path")}
        payload["lock_from_repo"]["git"] = source.get("git") or "git"
    return payload


def read_node(spec, target, answer, context):
    """Node-side: ``{"users": [...]}``, the target's processes running from the venv, read only unattended when the
    venv needs a rebuild; ``{"version_users": {version: [...]}}``, who uses each old version retention would remove,
    read only when there is one. A venv in spec within ``keep`` reads nothing: ``{}``.

    Each user is ``{"pid", "ns_pid", "name", "command" (shortened), "how" (exe, argv0, mapped), "file"}``, or,
    when its files could not be read in time, the same with ``"how": None`` and ``"error"``: an unattended run
    swaps nothing under a process it cannot vouch for. A lock that cannot be read yet (:func:`resolve_lock`)
    reads nothing either.
    """
    if spec.get("lock_from_repo") and code_step_waits(context):
        return {}
    spec, deferred = resolve_lock(spec, answer, may_defer=True)
    if deferred:
        return {}
    facts = venv_facts(spec, answer, context["target"]["label"])
    if facts["problems"]:
        return {}
    owner = owner_of(context["target"])
    node = {}
    if spec.get("unattended") and facts["changes"]:
        found, unreadable = processes_running_from(owner, venv_roots(spec, answer))
        users = [dict(user_of(info), how=how, file=path) for info, how, path in found]
        users += [dict(user_of(info), how=None, error=error) for info, error in unreadable]
        node["users"] = sorted(users, key=lambda u: u["pid"])
    rebuilding = bool(facts["changes"]) and not node.get("users")
    candidates = prune_candidates(spec, answer, rebuilding)
    if candidates:  # only when retention has work: a converged venv within keep reads nothing more
        node["version_users"] = version_users(owner, candidates)
    return node


def version_users(owner, versions):
    """``{version: [user]}``: who runs from (or sits in: cwd) each old version; a process whose files could not
    be read counts for every one of them (nothing is removed under a process nobody can vouch for)."""
    found, unreadable = processes_running_from(owner, versions, cwd=True)
    using = {}
    for info, how, path in found:
        root = under(path, versions)
        using.setdefault(root, []).append(dict(user_of(info), how=how, file=path))
    for info, error in unreadable:
        for version in versions:
            using.setdefault(version, []).append(dict(user_of(info), how=None, error=error))
    return using


def user_of(info):
    command = " ".join(info.cmdline)
    shown = command if len(command) <= COMMAND_SHOWN else command[:COMMAND_SHOWN] + "..."
    return {"pid": info.pid, "ns_pid": info.ns_pid, "name": info.comm, "command": shown}
