# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Training venv probe: what is installed in the venv, read from its files alone.

In a CT this file's source is fed to the CT's python3 on stdin by ``Target.run_probes`` (one ``pct exec``);
on a bare host ``probe()`` runs in the module's own process. So: standard library only, Python 3.9+, no
imports from ansible, and the answer is plain JSON.

It never runs the venv's python and never imports torch (``import torch`` takes seconds on a real node): it
reads ``pyvenv.cfg``, the header of each distribution's METADATA (PKG-INFO for an .egg-info), each one's RECORD
(top_level.txt for an .egg-info) and ``torch/version.py``, which it reads line by line (ct_venv; never exec:
the venv is untrusted input). It only reads; the module decides what is wrong.

What the venv imports is more than its distributions: every ``.pth`` file in site-packages runs at start-up, and so
does a ``sitecustomize``/``usercustomize`` module; a package directory no RECORD owns is importable all the same.
So the probe also names, from one listing of site-packages, every such start-up hook with the distributions whose
RECORD lists it (``hooks``), and every importable top-level entry that no RECORD owns (``unowned``).

With ``lock_from_repo`` in the payload it also reads the lock from the training repository at the pinned commit
(``ct_git.read_at_commit``: git's object database, as root in the code step's view of the repository), so the
lock the venv is compared with is the one committed beside the code.
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# pylint: disable=disallowed-name

import csv
import os
import re
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git as ct_git
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import venv as ct_venv

SHARED = (ct_venv, ct_git)  # container-side modules Target.run_probes ships with this part

# torch/version.py assigns plain literals (`cuda: Optional[str] = '12.8'`, `debug = False`); an annotation may
# sit between the name and the `=`.
TORCH_VERSION_KEYS = {"__version__": "version", "cuda": "cuda", "git_version": "git_version"}
TORCH_VERSION_KEYS.update({"hip": "hip", "rocm": "rocm", "xpu": "xpu", "debug": "debug"})
# Top-level entries of site-packages that Python imports or runs at start-up. Anything else (a README, an
# .egg-link) is never imported by itself.
IMPORTABLE_SUFFIXES = (".py", ".pyc", ".pyo", ".so", ".pyd", ".pth")
START_UP_MODULES = ("sitecustomize", "usercustomize")
# Records and bytecode: __pycache__ is read only for a source beside it, never by itself (PEP 3147).
_NOT_ENTRIES = re.compile(r"(?:\.dist-info|\.egg-info|^__pycache__)$")
MARKER = ".pve-gpu-recover-building"  # in a version the build has not finished (venv_script)
HOOK_TEXT = 200  # characters of an unowned .pth file the answer carries (the module recognizes a venv creator's)


def _head(path):
    """The first HOOK_TEXT characters of a file, or None when it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read(HOOK_TEXT)
    except OSError:
        return None


def record_tops(text, site_packages):
    """The top-level entries of site-packages a RECORD's text lists: ``"torch/__init__.py,sha256=..,1\n"
    "../../../bin/torchrun,,\nsix.py,,\n"`` -> ``{"torch", "six.py"}`` (paths outside site-packages left out).

    torch's RECORD alone is 12,000 lines, grouped by directory: a line under the directory of the line before
    costs one ``startswith``."""
    prefix = site_packages.rstrip("/") + "/"
    tops, under = set(), None
    for line in text.split("\n"):
        if under is not None and line.startswith(under):
            continue
        if line.startswith(('"', "/")):  # a CSV-quoted path (a comma in it) or an absolute one
            path = next(csv.reader([line]))[0] if line.startswith('"') else line.partition(",")[0]
            if path.startswith("/"):
                if not path.startswith(prefix):
                    continue
                path = path[len(prefix) :]
        else:
            path = line.partition(",")[0]
        top, sep, _ = path.partition("/")
        tops.add(top)
        under = f"{top}/" if sep and not line.startswith(('"', "/")) else None
    return tops - {"", ".", ".."}


def import_name(entry):
    """The module name a top-level entry answers to: ``torch`` -> ``torch``, ``six.py`` -> ``six``,
    ``_cffi_backend.cpython-311-x86_64-linux-gnu.so`` -> ``_cffi_backend``, ``README.txt`` -> None (not
    importable), ``distutils-precedence.pth`` -> ``distutils-precedence``."""
    if not entry.endswith(IMPORTABLE_SUFFIXES):
        return None
    return entry.split(".", 1)[0]


def _owned(record, names, site_packages, is_dist_info):
    """What a record directory owns in site-packages: its RECORD's top-level entries; an .egg-info's
    ``top_level.txt`` names instead (matched by import name, ``name/`` for a directory)."""
    if is_dist_info and "RECORD" in names:
        try:
            with open(os.path.join(record, "RECORD"), encoding="utf-8", errors="replace") as handle:
                return record_tops(handle.read(), site_packages), ()
        except OSError:
            return set(), ()
    if not is_dist_info and "top_level.txt" in names:
        text = ct_venv.read_small_text(os.path.join(record, "top_level.txt")) or ""
        return set(), tuple(line.strip() for line in text.splitlines() if line.strip())
    return set(), ()


def _distribution(site_packages, entry):
    """One installed distribution from its record directory (or egg-info file), or ``(None, why broken)``.

    The distribution carries ``owns`` (top-level entries its RECORD lists) and ``owns_names`` (top_level.txt
    module names of an .egg-info); the probe drops both from the answer once it has matched the entries."""
    record = os.path.join(site_packages, entry)
    if entry.endswith(".egg-info") and not os.path.isdir(record):
        metadata, names = record, ()  # a distutils install writes the egg-info as one file
    else:
        try:
            names = os.listdir(record)
        except OSError as error:
            return None, f"unreadable: {error.strerror}"
        metadata_name = "METADATA" if entry.endswith(".dist-info") else "PKG-INFO"
        if metadata_name not in names:
            return None, f"no {metadata_name}"
        metadata = os.path.join(record, metadata_name)
    header = ct_venv.metadata_header(metadata)
    if header is None:
        return None, "its metadata cannot be read"
    if not header.get("name") or not header.get("version"):
        return None, "its metadata has no Name or no Version"
    installer = ct_venv.read_small_text(os.path.join(record, "INSTALLER")) if "INSTALLER" in names else None
    owns, owns_names = _owned(record, names, site_packages, entry.endswith(".dist-info"))
    owns.add(entry)
    return {
        "name": header["name"],
        "version": header["version"],
        "installer": installer.strip() if installer else None,
        "direct_url": "direct_url.json" in names,  # installed from a path or URL, not an index
        "owns": owns,
        "owns_names": owns_names,
    }, None


def parse_torch_version_py(text):
    """``__version__ = '2.11.0+cu130'\\ncuda: Optional[str] = '13.0'`` -> ``{"version": "2.11.0+cu130",
    "cuda": "13.0", "git_version": None, "hip": None, "rocm": None, "xpu": None, "debug": None}``."""
    return ct_venv.read_version_py(text, TORCH_VERSION_KEYS)


def finished_versions(path):
    """The finished versions beside ``path`` that the build made: ``<path>.<UTC stamp>`` real directories without
    the build's marker, sorted (oldest first); what retention may remove."""
    parent, base = os.path.split(path.rstrip("/"))
    try:
        names = sorted(name for name in os.listdir(parent or "/") if ct_venv.is_version_name(name, base))
    except OSError:
        return []
    found = []
    for name in names:
        full = os.path.join(parent, name)
        if os.path.isdir(full) and not os.path.islink(full) and not os.path.lexists(os.path.join(full, MARKER)):
            found.append(full)
    return found


def start_up_and_unowned(site_packages, listing, distributions):
    """``(hooks, unowned)`` of a site-packages listing, given each distribution's ``owns``/``owns_names``.

    A hook is a ``.pth`` file or a ``sitecustomize``/``usercustomize`` module (file or package), owned or not;
    ``unowned`` lists every other importable top-level entry (a directory, ``.py``, ``.so``, ...) that no
    distribution owns."""
    owners = {}
    for dist in distributions:
        for top in dist["owns"]:
            owners.setdefault(top, []).append(dist["name"])
    by_name = {}
    for dist in distributions:
        for name in dist["owns_names"]:
            by_name.setdefault(name, []).append(dist["name"])
    hooks, unowned = [], []
    for entry in listing:
        if _NOT_ENTRIES.search(entry):
            continue
        is_dir = os.path.isdir(os.path.join(site_packages, entry))
        name = entry if is_dir else import_name(entry)
        if name is None:
            continue
        owned = sorted(set(owners.get(entry, []) + by_name.get(name, [])))
        if entry.endswith(".pth") or name in START_UP_MODULES:
            hook = {"entry": entry, "owners": owned, "text": None}
            if entry.endswith(".pth") and not owned:
                hook["text"] = _head(os.path.join(site_packages, entry))
            hooks.append(hook)
        elif not owned:
            unowned.append(entry)
    return hooks, unowned


def probe(payload):
    """Answer ``{"path": venv, "timeout": s, "uv": name or path, "python": minor or None[, "wheel_uv": path]}`` with
    the venv's interpreter, distributions and torch build, and what a build of it would use.

    ``{"path", "exists" (pyvenv.cfg read), "directory" (the path is a directory), "real_path" (where it resolves,
    only when it exists), "python" ("3.11"),
    "pyvenv" ({key: value}), "interpreter" ({"path", "exists"}), "lib_pythons" (["3.11"]), "site_packages",
    "distributions" ([{"name", "version", "installer", "direct_url"}]), "broken" ([{"record", "reason"}]),
    "hooks" ([{"entry", "owners", "text"}]: every ``.pth`` file and ``sitecustomize``/``usercustomize`` module in
    site-packages, with the Names of the distributions whose RECORD lists it; ``text``, the start of an unowned
    ``.pth``), "unowned" (importable top-level entries no RECORD or top_level.txt owns),
    "torch_version_py" (parse_torch_version_py() or None), "versions" (:func:`finished_versions`), "errors" (what
    could not be read), "unsafe" (``ct_venv.venv_unsafe``), "build" (``ct_venv.build_needs``: what a
    build would use, for the ``uv`` and ``python`` of the payload, on this process's PATH, the build's own)}``; with
    ``lock_from_repo`` (``{"repo", "commit", "path", "git"}``) also "repo_lock" (``ct_git.read_at_commit``:
    ``{"text", "missing", "error"}``); with ``wheel_uv`` (where the uv of the role's wheel goes) also "wheel_uv"
    (``ct_venv.trusted_executable``: ``{"installed", "unsafe"}``, a few lstat calls).
    """
    path = payload["path"]
    deadline = time.monotonic() + float(payload.get("timeout", 60))
    source = payload.get("lock_from_repo")
    answer = {
        "path": path,
        "exists": False,
        "directory": os.path.isdir(path),
        "python": None,
        "pyvenv": None,
        "interpreter": None,
        "lib_pythons": [],
        "site_packages": None,
        "distributions": [],
        "broken": [],
        "hooks": [],
        "unowned": [],
        "torch_version_py": None,
        "versions": finished_versions(path),
        "errors": [],
        # Why a user other than root could change the venv (its python runs as root), or None.
        "unsafe": ct_venv.venv_unsafe(path),
        # What a build would run (uv, or python -m venv with ensurepip), so that one it cannot do fails the fact
        # pass before any step changes anything.
        "build": ct_venv.build_needs(payload.get("uv") or "uv", payload.get("python"), os.environ.get("PATH")),
    }
    if payload.get("wheel_uv"):  # the uv of the role's wheel: a rebuild installs it unless root's is there
        answer["wheel_uv"] = ct_venv.trusted_executable(payload["wheel_uv"])
    if source:
        answer["repo_lock"] = ct_git.read_at_commit(
            source.get("git") or "git", source["repo"], source["commit"], source["path"], deadline=deadline
        )
    text = ct_venv.read_small_text(os.path.join(path, "pyvenv.cfg"))
    if text is None:
        return answer
    pyvenv = ct_venv.read_config(text)
    interpreter = os.path.join(path, "bin", "python")
    answer.update(
        exists=True,
        # Where the venv really is (a version behind the symlink): the node compares the files processes run from
        # with it (an unattended run swaps no venv a live process runs from).
        real_path=os.path.realpath(path),
        pyvenv=pyvenv,
        # A venv's bin/python links to its base interpreter; a dangling link means that python is gone.
        interpreter={"path": os.path.realpath(interpreter), "exists": os.path.exists(interpreter)},
    )
    site_packages, minors, python = ct_venv.site_packages(path, ct_venv.config_minor(pyvenv))
    answer.update(python=python, lib_pythons=minors, site_packages=site_packages)
    if site_packages is None:  # a venv without its site-packages is broken, not unreadable: a rebuild fixes it
        answer["broken"].append({"record": f"lib/python{python or 'X.Y'}/site-packages", "reason": "missing"})
        return answer
    try:
        listing = sorted(os.listdir(site_packages))
    except OSError as error:
        answer["errors"].append(f"cannot list {site_packages}: {error.strerror}")
        return answer
    entries = [e for e in listing if e.endswith((".dist-info", ".egg-info"))]
    for done, entry in enumerate(entries):
        if time.monotonic() >= deadline:
            answer["errors"].append(
                f"stopped after {payload.get('timeout')} s having read {done} of {len(entries)} records "
                f"in {site_packages}"
            )
            break
        found, reason = _distribution(site_packages, entry)
        if found is None:
            answer["broken"].append({"record": entry, "reason": reason})
        else:
            answer["distributions"].append(found)
    if not answer["errors"]:  # a listing matched against half the RECORDs would name owned files as unowned
        answer["hooks"], answer["unowned"] = start_up_and_unowned(site_packages, listing, answer["distributions"])
    for dist in answer["distributions"]:
        del dist["owns"], dist["owns_names"]
    torch_version = ct_venv.read_small_text(os.path.join(site_packages, "torch", "version.py"))
    if torch_version is not None:
        answer["torch_version_py"] = parse_torch_version_py(torch_version)
    return answer
