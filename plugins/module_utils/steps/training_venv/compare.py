# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The training venv compared with its lock: the probe's answer checked, what is installed (torch's build
included), how it differs from the lock, what else makes it need a rebuild (its python, broken records, start-up
hooks and files no distribution owns), what keeps the target from building it, and the venv's facts before the
window rule (:func:`venv_facts`; :func:`deferred_facts` while the lock cannot be read yet); pure.

Exact means exact: versions are compared as strings, local tag included (facts.py says why).
"""

from __future__ import annotations

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import venv as ct_venv
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct.venv import canonical_name
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.text import printable
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.torch_build import variant
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.lock import (
    VenvError,
    expected_python,
    lock_source,
    parse_lock,
    shown,
)

# The venv's own installers. `python3 -m venv` (the fallback builder) seeds pip (and setuptools on 3.11), uv
# seeds nothing, and uv / pip-tools leave them out of a lock unless something depends on them. Counting them by
# default would make every pip-built venv drift forever; a lock that pins one gets it compared like any other.
TOOLING = ("pip", "setuptools", "wheel")
LISTED = 20  # unowned entries or hooks named one by one; the rest are counted
# What a venv creator (virtualenv, uv before 0.5) writes into site-packages itself, owned by no RECORD: a .pth
# whose only line imports its _virtualenv.py (a distutils patch). Accepted only in a venv whose pyvenv.cfg names
# that creator, and the .pth only with exactly that line.
CREATOR_KEYS = ("uv", "virtualenv")
CREATOR_PTH = {"_virtualenv.pth": "import _virtualenv"}
CREATOR_MODULES = ("_virtualenv.py",)


def freeze_lines(versions):
    """``{"torch": "2.11.0+cu128", "six": "1.17.0"}`` -> ``"six==1.17.0\\ntorch==2.11.0+cu128\\n"``.

    A name installed twice (``"2.10.0, 2.11.0"``, see :func:`installed_versions`) gives one line per record.
    """
    lines = [f"{shown(name)}=={shown(one)}" for name, joined in versions.items() for one in joined.split(", ")]
    return "".join(f"{line}\n" for line in sorted(lines))


def check_answer(answer):
    """The probe's answer comes from inside a CT: a part that is not what the probe prints is a VenvError."""
    if not isinstance(answer, dict):
        raise VenvError("the training_venv probe answered no object", kind="probe")
    for key, kind in (("exists", bool), ("distributions", list), ("broken", list), ("errors", list)):
        if not isinstance(answer.get(key), kind):
            raise VenvError(f"the training_venv probe answered no {key!r} ({kind.__name__})", kind="probe")
    for dist in answer["distributions"]:
        if not (isinstance(dist, dict) and isinstance(dist.get("name"), str) and isinstance(dist.get("version"), str)):
            raise VenvError(
                f"the training_venv probe answered a distribution without name/version: {dist!r}", kind="probe"
            )
    if not all(isinstance(broken, dict) for broken in answer["broken"]):
        raise VenvError("the training_venv probe answered a broken record that is not an object", kind="probe")
    hooks, unowned = answer.get("hooks", []), answer.get("unowned", [])
    if not (isinstance(hooks, list) and all(_is_hook(hook) for hook in hooks)):
        raise VenvError("the training_venv probe answered hooks that are not [{entry, owners}]", kind="probe")
    if not (isinstance(unowned, list) and all(isinstance(entry, str) for entry in unowned)):
        raise VenvError("the training_venv probe answered unowned entries that are not names", kind="probe")
    version_py = answer.get("torch_version_py")
    if version_py is not None and not isinstance(version_py, dict):
        raise VenvError("the training_venv probe answered a torch_version_py that is not an object", kind="probe")
    if answer.get("unsafe") is not None and not isinstance(answer["unsafe"], str):
        raise VenvError("the training_venv probe answered an unsafe that is not a sentence", kind="probe")
    if answer.get("build") is not None and not _is_build(answer["build"]):
        raise VenvError("the training_venv probe answered a build that is not what a build would use", kind="probe")


BUILD_TYPES = {"path": (str, type(None)), "uv": (str, type(None)), "uv_missing": (str, type(None))}
BUILD_TYPES.update({"python": (str,), "base_python": (str, type(None)), "uv_python": (str, type(None))})
BUILD_TYPES.update({"venv": (bool, type(None)), "ensurepip": (bool, type(None)), "own": (str,)})


def _is_build(build):
    return isinstance(build, dict) and all(isinstance(build.get(key), kinds) for key, kinds in BUILD_TYPES.items())


def _is_hook(hook):
    return (
        isinstance(hook, dict)
        and isinstance(hook.get("entry"), str)
        and isinstance(hook.get("owners"), list)
        and all(isinstance(owner, str) for owner in hook["owners"])
        and isinstance(hook.get("text"), (str, type(None)))
    )


def installed_records(answer):
    """``{canonical name: [version of each record]}``: a name appears twice when two records were left behind."""
    records = {}
    for dist in answer["distributions"]:
        records.setdefault(canonical_name(dist["name"]), []).append(dist["version"])
    return records


def installed_versions(answer, pins=None):
    """``{canonical name: exact version}`` of the venv, from the probe's answer (the rule:
    :func:`ct_venv.installed_versions`, which the build script reads its venv by too)."""
    records = [(dist["name"], dist["version"]) for dist in answer["distributions"]]
    return ct_venv.installed_versions(records, (answer.get("torch_version_py") or {}).get("version"), pins)


def torch_inconsistency(answer):
    """Why torch's files and its METADATA do not describe one build (a half-finished install), or None."""
    records = installed_records(answer).get("torch", [])
    version_py = answer.get("torch_version_py")
    build = (version_py or {}).get("version")
    if not records:
        return (
            f"torch/version.py says {shown(build)} but no torch is installed (files left behind)"
            if version_py
            else None
        )
    if version_py is None:
        return f"torch {shown(', '.join(records))} is installed without torch/version.py"
    if not build:
        return "torch/version.py has no __version__"
    if len(records) == 1 and records[0] != build and not build.startswith(f"{records[0]}+"):
        return (
            f"torch's METADATA says {shown(records[0])} but torch/version.py says {shown(build)} (files of two builds "
            "mixed)"
        )
    return None


def ignored_tooling(locked, policy):
    """The venv's own installers left out of the comparison: ``TOOLING`` the lock does not pin, under "ignore"."""
    return set(TOOLING) - set(locked) if policy == "ignore" else set()


def compare(locked, installed, policy="ignore"):
    """The differences between the lock and the venv, by EXACT version string (local tag included).

    ``compare({"torch": "2.11.0+cu128", "six": "1.17.0"}, {"torch": "2.11.0+cu130", "sglang": "0.5.4",
    "pip": "25.2"}, "ignore")`` -> ``{"missing": [{"name": "six", "locked": "1.17.0"}], "extra": [{"name":
    "sglang", "installed": "0.5.4"}], "wrong": [{"name": "torch", "locked": "2.11.0+cu128", "installed":
    "2.11.0+cu130"}]}``. ``policy`` "ignore" leaves out pip/setuptools/wheel that the lock does not pin; "exact"
    counts them as extra. Each list is sorted by name.
    """
    ignored = ignored_tooling(locked, policy)
    return {
        "missing": [{"name": n, "locked": locked[n]} for n in sorted(set(locked) - set(installed))],
        "extra": [{"name": n, "installed": installed[n]} for n in sorted(set(installed) - set(locked) - ignored)],
        "wrong": [
            {"name": n, "locked": locked[n], "installed": installed[n]}
            for n in sorted(set(locked) & set(installed))
            if locked[n] != installed[n]
        ],
    }


def describe_wrong(entry):
    """``torch 2.11.0+cu130 -> 2.11.0+cu128 (build variant cu130, expected cu128)``; the note only when the
    build variants differ (``numpy 2.3.3 -> 2.3.4``)."""
    have, want = variant(entry["installed"]), variant(entry["locked"])
    line = f"{entry['name']} {shown(entry['installed'])} -> {entry['locked']}"
    if have == want:
        return line
    have = f"build variant {shown(have)}" if have else "no build variant"
    return f"{line} ({have}, expected {want or 'no variant'})"


def venv_changes(path, answer, python, lock_count):
    """What makes the venv as a whole need a rebuild (not one distribution), one line each."""
    if not answer["exists"]:
        what = f"python {python}" if python else "the target's python3"
        if answer.get("directory"):
            return [
                f"replace {path}, a directory without pyvenv.cfg (moved aside), by a venv: {what}, {lock_count} "
                "distributions from the lock"
            ]
        return [f"create venv at {path} ({what}, {lock_count} distributions from the lock)"]
    changes = []
    if python and answer.get("python") != python:
        changes.append(f"rebuild venv at {path}: python {answer.get('python') or 'unknown'}, expected {python}")
    interpreter = answer.get("interpreter") or {}
    if interpreter.get("exists") is False:
        changes.append(f"rebuild venv at {path}: its interpreter {shown(interpreter.get('path'))} is gone")
    for broken in answer["broken"]:
        record, reason = shown(broken.get("record")), shown(broken.get("reason"))
        changes.append(f"rebuild venv at {path}: {record} is broken ({reason})")
    for name, found in sorted(installed_records(answer).items()):
        if len(found) > 1:
            times = f"{len(found)} times ({shown(', '.join(found))})"
            changes.append(f"rebuild venv at {path}: {shown(name)} is installed {times}")
    torch_problem = torch_inconsistency(answer)
    if torch_problem:
        changes.append(f"rebuild venv at {path}: {torch_problem}")
    return changes


def _listed(lines, what):
    """The first LISTED lines, and one line counting the rest."""
    if len(lines) <= LISTED:
        return lines
    return [*lines[:LISTED], f"{what}: and {len(lines) - LISTED} more"]


def created_by_creator(answer, entry, text=None):
    """Whether ``entry`` is what the venv's creator wrote itself (virtualenv's ``_virtualenv.pth`` + ``.py``)."""
    if not any(key in (answer.get("pyvenv") or {}) for key in CREATOR_KEYS):
        return False
    if entry in CREATOR_PTH:
        return (text or "").strip() == CREATOR_PTH[entry]
    return entry in CREATOR_MODULES


def import_changes(path, answer, allowed):
    """What the venv imports beyond its distributions, one line each; pure.

    ``allowed``: the canonical names whose files are fine (the lock's, and tooling that is ignored). Drift: a
    pyvenv.cfg with ``include-system-site-packages = true`` (the system's packages are importable); a ``.pth``
    file or ``sitecustomize``/``usercustomize`` that no allowed distribution's RECORD lists (they run at start-up);
    an importable top-level entry that no RECORD owns. ``import_changes("/v", {"pyvenv": {}, "hooks": [{"entry":
    "evil.pth", "owners": [], "text": "import os"}], "unowned": ["hack"]}, {"torch"})`` -> ``["rebuild venv at /v:
    evil.pth runs code at start-up and no distribution's RECORD lists it", "rebuild venv at /v: hack is importable
    and no distribution's RECORD owns it"]``.
    """
    changes = []
    system = str((answer.get("pyvenv") or {}).get("include-system-site-packages", "")).strip().lower()
    if system == "true":
        changes.append(
            f"rebuild venv at {path}: pyvenv.cfg sets include-system-site-packages = true (the system's packages "
            "are importable beside the lock's)"
        )
    hooks = []
    for hook in answer.get("hooks", []):
        owners = sorted({canonical_name(owner) for owner in hook["owners"]})
        if set(owners) & allowed or (not owners and created_by_creator(answer, hook["entry"], hook.get("text"))):
            continue
        entry = shown(hook["entry"])
        what = "runs code at start-up" if entry.endswith(".pth") else "is imported at start-up"
        whose = (
            f"only {', '.join(shown(o) for o in owners)} (not in the lock) lists it"
            if owners
            else "no distribution's RECORD lists it"
        )
        hooks.append(f"rebuild venv at {path}: {entry} {what} and {whose}")
    unowned = [
        f"rebuild venv at {path}: {shown(entry)} is importable and no distribution's RECORD owns it"
        for entry in answer.get("unowned", [])
        if not created_by_creator(answer, entry)
    ]
    return (
        changes
        + _listed(hooks, f"rebuild venv at {path}: start-up hooks")
        + _listed(unowned, f"rebuild venv at {path}: unowned entries")
    )


def unsafe_problem(label, path, why):
    """The problem of a venv another user than root could change (the probe's ``venv_unsafe``): its python runs
    as root (the build's checks, verify's ``import torch``), and ``-I`` still runs the venv's ``.pth`` files."""
    return (
        f"{label}: the venv {printable(path)} could be changed by a user other than root: {printable(why)}; its "
        "python runs as root, so nothing is built, swapped or run there: make every directory from / to it root's "
        "and not writable by a group or other users (chown root:root, chmod go-w), or set training_venv_path to "
        "such a place"
    )


def build_problem(spec, answer, label, python):
    """Why the target cannot build the venv a rebuild needs (one sentence: what is missing and the fix), or None;
    pure. ``answer["build"]`` is the probe's ``ct_venv.build_needs`` (what the build script would use, found the
    same way); ``python``: the minor the venv must have (None: any python3). An answer without it is not judged.

    uv (the target's, or the wheel's the role installs) needs an interpreter of ``python`` it can find without a
    download; ``python3 -m venv`` + pip needs ``python3.X`` on PATH with ``venv`` and ``ensurepip`` in its library
    (Debian's python3.X-venv). A library that could not be found is not held against it."""
    need = answer.get("build")
    if need is None:
        return None
    path, name = spec["path"], need["python"]
    own = f"its python3 is {need['own']}"
    if spec.get("uv_wheel") or need["uv"]:
        if need["uv_python"]:
            return None
        which = f"uv ({shown(need['uv'])})" if need["uv"] else "the uv of training_venv_uv_wheel"
        looked = f"no {name} on PATH {shown(need['path'])}"
        if python:
            looked += f", no python3 or python of {python}, none uv installed itself"
        return (
            f"{label}: the venv at {path} needs a rebuild with {name}, but {which} finds none in the target "
            f"({looked}; uv downloads none during recovery): install {name} there, or compile the lock for a "
            f"python the target has ({own}) and set training_venv_python_version to it"
        )
    no_uv = f"no uv ({shown(need['uv_missing'])})"
    if not need["base_python"]:
        return (
            f"{label}: the venv at {path} needs a rebuild but the target cannot build it: {no_uv} and no {name} "
            f"on PATH; install {name} there with its venv module (apt install {name} {name}-venv), or compile the "
            f"lock for a python the target has ({own}) and set training_venv_python_version to it"
        )
    lacking = [module for module in ("venv", "ensurepip") if need[module] is False]
    if lacking:
        return (
            f"{label}: the venv at {path} needs a rebuild but the target cannot build it: {no_uv} and "
            f"`{name} -m venv` fails there, since {shown(need['base_python'])} has no {' and no '.join(lacking)} "
            f"module; install it (apt install {name}-venv), or install uv there (training_venv_uv: its path), or "
            "set training_venv_uv_wheel to PyPI's uv wheel on the controller"
        )
    return None


def venv_facts(spec, answer, label):
    """The venv's facts before the window rule: what is installed, how it differs from the lock, the diff; pure.

    Returns ``{"path", "exists", "python", "expected_python", "installed", "torch", "lock", "missing", "extra",
    "wrong", "broken", "changes", "problems", "diff": {"before", "after"}, "pending"}``. A missing venv, a python
    minor other than the expected one, a broken record and any distribution difference are drift (``changes``,
    ``pending``); what the probe could not read is a problem (nothing is decided on half the facts). ``spec`` has
    its lock's text (:func:`resolve_lock`).
    """
    check_answer(answer)
    lock = parse_lock(spec["lock"])
    locked = lock["distributions"]
    python = expected_python(spec, lock)
    installed = installed_versions(answer, locked) if answer["exists"] else {}
    differences = compare(locked, installed, spec["tooling"])
    ignored = ignored_tooling(locked, spec["tooling"])
    changes = venv_changes(spec["path"], answer, python, len(locked))
    if answer["exists"]:
        # The lock's files and the ignored tooling's (setuptools' distutils-precedence.pth) may run at start-up.
        allowed = set(locked) | (ignored & set(installed))
        changes += import_changes(spec["path"], answer, allowed)
        changes += [describe_wrong(e) for e in differences["wrong"]]
        changes += [f"install {e['name']} {e['locked']} (missing)" for e in differences["missing"]]
        changes += [
            f"remove {shown(e['name'])} {shown(e['installed'])} (not in the lock)" for e in differences["extra"]
        ]
    problems = [f"{label}: the training venv probe could not read everything: {error}" for error in answer["errors"]]
    if answer.get("unsafe"):
        problems.append(unsafe_problem(label, spec["path"], answer["unsafe"]))
    version_py = answer.get("torch_version_py") or {}
    torch = installed.get("torch")
    return {
        "path": spec["path"],
        "exists": answer["exists"],
        "python": answer.get("python"),
        "expected_python": python,
        "installed": installed,
        "torch": {
            "version": torch,
            "variant": variant(torch),
            "cuda": version_py.get("cuda"),
            "git_version": version_py.get("git_version"),
        }
        if torch
        else None,
        "lock": {
            "count": len(locked),
            "torch": locked.get("torch"),
            "indexes": lock["indexes"],
            "torch_index": lock["torch_index"],
        },
        **differences,
        "broken": answer["broken"],
        "changes": changes,
        "problems": problems,
        "diff": {
            "before": freeze_lines({n: v for n, v in installed.items() if n not in ignored}),
            "after": freeze_lines(locked),
        },
        "pending": bool(changes) and not problems,
    }


def deferred_facts(spec, answer, label):
    """The facts while the lock cannot be read yet (:func:`resolve_lock` deferred it: the pinned commit is not in the
    repository, and the training code step fetches it first); pure. Nothing is compared: the one change says
    the venv is compared with that lock once it can be read, and the module does so then (a real run fails if it
    still cannot be read)."""
    check_answer(answer)
    installed = installed_versions(answer) if answer["exists"] else {}
    change = (
        f"compare the venv at {spec['path']} with the lock {lock_source(spec['lock_from_repo'])} once the training "
        "code step has fetched that commit, and rebuild it if it is not that lock"
    )
    problems = [f"{label}: the training venv probe could not read everything: {error}" for error in answer["errors"]]
    if answer.get("unsafe"):
        problems.append(unsafe_problem(label, spec["path"], answer["unsafe"]))
    return {
        "path": spec["path"],
        "exists": answer["exists"],
        "python": answer.get("python"),
        "expected_python": spec["python_version"],
        "installed": installed,
        "torch": None,
        "lock": None,
        "missing": [],
        "extra": [],
        "wrong": [],
        "broken": answer["broken"],
        "changes": [change],
        "problems": problems,
        "diff": {"before": freeze_lines(installed), "after": ""},
        "pending": not problems,
    }
