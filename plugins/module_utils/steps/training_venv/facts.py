# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The training venv step: is the venv exactly the locked set, and what would a run change.

Its probe part (``venv_probe``) reads, inside the target, the venv's ``pyvenv.cfg``, the Name and
Version of every installed distribution and ``torch/version.py``, without running the venv's python
(``import torch`` costs seconds). Everything here is pure: the lock text and the probe's answer in, facts out.

Exact means exact: versions are compared as strings, local tag included. PEP 440 says ``torch==2.11.0`` is
satisfied by ``2.11.0+cu130``; here they differ, because the local tag is the CUDA build and a wrong build is
the drift this project exists to find. The lock is a ``uv pip compile --generate-hashes`` requirements file or a
PEP 751 ``pylock.toml`` (:func:`parse_pylock`, read into the same form); the role reads it on the controller
(``lookup('file', training_venv_lock_file)``) and passes its TEXT, so the node needs no copy of it and the fact
pass sees exactly what the build will install. Or the lock lives in the training repository (``lock_from_repo``):
the probe reads it inside the target at the commit the training code step pins (:func:`resolve_lock`), so the
code and its venv move together.

Unattended (``unattended``, the scheduled drift corrector), a venv that needs a rebuild is not swapped while a
live process of the target runs from it: the facts name those processes in ``needs_window`` and nothing is
pending. Which processes run from it is read on the node (:func:`read_node`,
pve_process_runs_from.processes_running_from: the target's processes by their cgroup, then each one's exe, an
interpreter's argv[0] and its mapped files), and only when the venv needs a rebuild: a converged run reads nothing
more. On the node, because pve_process already reads the target's processes there with bounded reads (a process
stuck in the driver costs seconds, never the run), the kernel's answer is not the CT's word, and the read costs no
command in the target. Processes the GPU step ends first (its facts, before this step's) do not count.
"""

from __future__ import annotations

import posixpath
import re

from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_ct_act import redact
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_errors import RecoverError
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_process import owner_of
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_process_runs_from import processes_running_from, under
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_text import printable
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_torch_build import variant
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.handoff import ending_pids_of
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import probe as venv_probe

NAME = "training_venv"
PROBE = venv_probe
# The venv's own installers. `python3 -m venv` (the fallback builder) seeds pip (and setuptools on 3.11), uv
# seeds nothing, and uv / pip-tools leave them out of a lock unless something depends on them. Counting them by
# default would make every pip-built venv drift forever; a lock that pins one gets it compared like any other.
TOOLING = ("pip", "setuptools", "wheel")
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
    # pip/setuptools/wheel when the lock does not pin them: "ignore" (see TOOLING) or "exact" (they are extra).
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
SPEC_DEFAULTS = {name: option.get("default") for name, option in SPEC.items()}

_NAME_SEPARATORS = re.compile(r"[-_.]+")
_PIN = re.compile(
    r"^(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(?:\[[^\]]*\])?\s*"
    r"==\s*(?P<version>[A-Za-z0-9][A-Za-z0-9.+!_-]*)\s*(?:;\s*(?P<marker>.+))?$"
)
_HASH = re.compile(r"\s*--hash[=\s]\S+")
_INLINE_COMMENT = re.compile(r"(^|\s+)#.*$")
_OPTION = re.compile(r"^(?P<option>--?[A-Za-z][\w-]*)(?:\s*=\s*|\s+)?(?P<value>.*)$")
_SOURCE_ANNOTATION = re.compile(r"^#\s*from\s+(?P<url>\S+)\s*$")
_HEADER_PYTHON = re.compile(r"(?:^|\s)(?:--python-version|--python|-p)[=\s]+(?P<version>\d+\.\d+)(?:\.\d+)?\b")
_PYTHON_MINOR = re.compile(r"^\d+\.\d+$")
_INDEX_OPTIONS = {"--index-url": "index", "-i": "index", "--extra-index-url": "extra"}
_REJECTED_OPTIONS = ("-e", "--editable", "-r", "--requirement", "-c", "--constraint")
_FIX = "compile it with `uv pip compile --generate-hashes`"
_PYLOCK_FIX = (
    "compile it with `uv pip compile --format pylock.toml --generate-hashes` for the target's python and platform"
)
_PYLOCK_KEY = re.compile(r"^lock-version\s*=", re.MULTILINE)
_PYLOCK_VERSION = re.compile(r"^1(?:\.\d+)*$")
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+!_-]*$")
_DIRECT = ("vcs", "directory", "archive")  # PEP 751 sources that are no index's file
_USERINFO = re.compile(r"^\s*[A-Za-z][A-Za-z0-9+.-]*://[^/@\s]+@")
_SHA = re.compile(r"^(?:[0-9a-fA-F]{40}|[0-9a-fA-F]{64})$")
_CREDENTIALS_FIX = (
    "carries credentials, which would be in every report and log; take them out of the lock and give them as "
    "training_venv_index_credentials"
)
COMMAND_SHOWN = 120  # characters of a process's command line a message quotes
NAME_SHOWN = 120  # characters of a file or package name the venv chose that a message quotes
LISTED = 20  # unowned entries or hooks named one by one; the rest are counted
# What a venv creator (virtualenv, uv before 0.5) writes into site-packages itself, owned by no RECORD: a .pth
# whose only line imports its _virtualenv.py (a distutils patch). Accepted only in a venv whose pyvenv.cfg names
# that creator, and the .pth only with exactly that line.
CREATOR_KEYS = ("uv", "virtualenv")
CREATOR_PTH = {"_virtualenv.pth": "import _virtualenv"}
CREATOR_MODULES = ("_virtualenv.py",)


class VenvError(RecoverError):
    """The lock cannot be used, or the probe answered something that is not a venv probe's answer."""


# -- names and versions ----------------------------------------------------------------------------------------
def canonical_name(name):
    """PEP 503 normalization: ``Typing_Extensions`` -> ``typing-extensions``, ``zope.interface`` ->
    ``zope-interface``."""
    return _NAME_SEPARATORS.sub("-", name).lower()


def freeze_lines(versions):
    """``{"torch": "2.11.0+cu128", "six": "1.17.0"}`` -> ``"six==1.17.0\\ntorch==2.11.0+cu128\\n"``.

    A name installed twice (``"2.10.0, 2.11.0"``, see :func:`installed_versions`) gives one line per record.
    """
    lines = [f"{shown(name)}=={shown(one)}" for name, joined in versions.items() for one in joined.split(", ")]
    return "".join(f"{line}\n" for line in sorted(lines))


def shown(text):
    """A name or version the venv chose, as a message or diff line may show it (one line, escaped, bounded)."""
    return printable(text, NAME_SHOWN)


# -- the lock --------------------------------------------------------------------------------------------------
def _logical_lines(text):
    """``(line number, text)`` per logical line: ``\\``-continued lines joined; a comment line stands alone."""
    pending, start = [], 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("#"):  # like pip: a comment line ends a continued requirement
            if pending:
                yield start, " ".join(pending)
                pending = []
            yield number, line
            continue
        if not pending:
            start = number
        continued = line.endswith("\\")
        pending.append(line[:-1].strip() if continued else line)
        if not continued:
            yield start, " ".join(p for p in pending if p)
            pending = []
    if pending:
        yield start, " ".join(p for p in pending if p)


def parse_lock(text):
    """The pins and sources of a ``uv pip compile --generate-hashes`` lock.

    ``"--index-url https://pypi.org/simple\\n--extra-index-url https://download.pytorch.org/whl/cu128\\n\\n"
    "torch==2.11.0+cu128 \\\\\\n    --hash=sha256:ab...\\n    # from https://download.pytorch.org/whl/cu128\\n"``
    -> ``{"distributions": {"torch": "2.11.0+cu128"}, "indexes": ["https://pypi.org/simple",
    "https://download.pytorch.org/whl/cu128"], "torch_index": "https://download.pytorch.org/whl/cu128",
    "find_links": [], "no_index": False, "sources": {"torch": "https://download.pytorch.org/whl/cu128"},
    "markers": {}, "python": None}``.

    ``python`` is the ``--python-version`` of uv's header comment; ``sources`` come from ``# from URL`` lines
    (``--emit-index-annotation``). Anything that is not an exact pin (``>=``, ``name @ url``, ``-e``, ``-r``) or
    a name pinned twice raises VenvError naming the line: a lock with it cannot say what must be installed. An
    index URL with credentials in it (``https://user:token@host/simple``) is refused: the lock is in the report.
    A PEP 751 ``pylock.toml`` (:func:`lock_format`) is read by :func:`parse_pylock` into the same form.
    """
    if lock_format(text) == "pylock":
        return parse_pylock(text)
    lock = {
        "distributions": {},
        "indexes": [],
        "torch_index": None,
        "find_links": [],
        "no_index": False,
        "sources": {},
        "markers": {},
        "python": None,
    }
    indexes = {"index": [], "extra": []}
    last, in_header = None, True
    for number, line in _logical_lines(text):
        if line.startswith("#"):
            _read_comment(lock, line, last, in_header)
            continue
        requirement = _INLINE_COMMENT.sub("", line).strip()
        if not requirement:
            continue
        in_header = False
        if requirement.startswith("-"):
            _read_option(lock, indexes, number, requirement)
        else:
            last = _read_pin(lock, number, requirement)
    if not lock["distributions"]:
        raise VenvError(f"the lock pins no distribution; {_FIX}", kind="lock")
    lock["indexes"] = indexes["index"] + indexes["extra"]
    lock["torch_index"] = torch_index(lock)
    return lock


def _read_comment(lock, line, last, in_header):
    """uv's header names the python it compiled for; ``# from URL`` names where the pin above comes from."""
    source = _SOURCE_ANNOTATION.match(line)
    if source and last:
        lock["sources"][last] = source.group("url")
    header_python = _HEADER_PYTHON.search(line) if in_header and "compile" in line else None
    if header_python:
        lock["python"] = header_python.group("version")


def _read_option(lock, indexes, number, line):
    """Index, find-links and no-index options are kept; -e, -r, -c are refused; others (--trusted-host) pass."""
    option = _OPTION.match(line)
    name, value = (option.group("option"), option.group("value").strip()) if option else (line, "")
    if name in _REJECTED_OPTIONS or not option:
        raise VenvError(f"the lock, line {number}: `{line}` is not an exact pin (name==version); {_FIX}", kind="lock")
    if name in _INDEX_OPTIONS or name in ("--find-links", "-f"):
        refuse_credentials(f"the lock, line {number}", value)
    if name in _INDEX_OPTIONS:
        # --index-url replaces the default index; each --extra-index-url adds one.
        if _INDEX_OPTIONS[name] == "index":
            indexes["index"] = [value]
        else:
            indexes["extra"].append(value)
    elif name in ("--find-links", "-f"):
        lock["find_links"].append(value)
    elif name == "--no-index":
        lock["no_index"] = True


def _read_pin(lock, number, line):
    """Record ``name==version`` (hashes, extras and a marker allowed) and return its canonical name."""
    pin = _PIN.match(_HASH.sub("", line).strip())
    if not pin:
        what = "a direct reference" if " @ " in line or "://" in line else "not an exact pin (name==version)"
        raise VenvError(f"the lock, line {number}: `{line}` is {what}; {_FIX}", kind="lock")
    name = canonical_name(pin.group("name"))
    if name in lock["distributions"]:
        raise VenvError(
            f"the lock, line {number}: {name} is pinned twice ({lock['distributions'][name]} and "
            f"{pin.group('version')}, for different markers?); compile it for the target only, with "
            f"`uv pip compile --python-platform x86_64-manylinux_2_28 --python-version 3.X`",
            kind="lock",
        )
    lock["distributions"][name] = pin.group("version")
    if pin.group("marker"):
        lock["markers"][name] = pin.group("marker").strip()
    return name


def lock_format(text):
    """``"pylock"`` for a PEP 751 ``pylock.toml`` (a top-level ``lock-version`` key, which no requirements file
    has), else ``"requirements"``."""
    return "pylock" if _PYLOCK_KEY.search(text or "") else "requirements"


def refuse_credentials(where, url):
    """A URL of the lock that carries credentials raises VenvError (the message shows it with them masked)."""
    if isinstance(url, str) and _USERINFO.match(url):
        raise VenvError(f"{where}: {redact(url.strip())} {_CREDENTIALS_FIX}", kind="lock")


def parse_pylock(text):
    """The pins and sources of a PEP 751 ``pylock.toml``, in the form :func:`parse_lock` gives a requirements lock.

    ``lock-version = "1.0"\n[[packages]]\nname = "torch"\nversion = "2.11.0+cu128"\nindex =
    "https://download.pytorch.org/whl/cu128"\nwheels = [{url = "...", hashes = {sha256 = "ab..."}}]`` ->
    ``{"distributions": {"torch": "2.11.0+cu128"}, "indexes": ["https://download.pytorch.org/whl/cu128"],
    "torch_index": "https://download.pytorch.org/whl/cu128", "find_links": [], "no_index": False, "sources":
    {"torch": "https://download.pytorch.org/whl/cu128"}, "markers": {}, "python": None}``.

    ``indexes`` are the packages' ``index`` keys in order of first use (uv writes none: its wheels carry their
    URLs); ``python`` is the ``--python-version`` of uv's header comment. Each package must be an index package
    with an exact version and at least one wheel or sdist with hashes; a ``vcs``, ``directory`` or ``archive``
    package, a name listed twice (entries for other environments), a URL with credentials or a lock-version other
    than 1.x raises VenvError naming the package. Reading TOML needs Python 3.11 (tomllib) on the node.
    """
    try:
        import tomllib  # noqa: PLC0415 (Python 3.11+; only a pylock.toml needs it)
    except ImportError:
        raise VenvError(
            "the lock is a pylock.toml, which needs Python 3.11 or newer on the node (tomllib) to be read; give a "
            f"requirements lock instead: {_FIX}",
            kind="lock",
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise VenvError(f"the lock (pylock.toml) is not valid TOML: {error}; {_PYLOCK_FIX}", kind="lock") from None
    version = data.get("lock-version")
    if not (isinstance(version, str) and _PYLOCK_VERSION.match(version)):
        raise VenvError(
            f"the lock (pylock.toml) has lock-version {shown(repr(version))}; this step reads PEP 751 lock-version "
            f"1.x: {_PYLOCK_FIX}",
            kind="lock",
        )
    packages = data.get("packages")
    if not isinstance(packages, list) or not packages:
        raise VenvError(f"the lock (pylock.toml) lists no package; {_PYLOCK_FIX}", kind="lock")
    lock = {
        "distributions": {},
        "indexes": [],
        "torch_index": None,
        "find_links": [],
        "no_index": False,
        "sources": {},
        "markers": {},
        "python": None,
    }
    for number, package in enumerate(packages, 1):
        _read_package(lock, number, package)
    for line in text.splitlines():  # uv's header: the comment lines before the first key
        if line.strip() and not line.lstrip().startswith("#"):
            break
        _read_comment(lock, line.strip(), None, True)
    for url in lock["sources"].values():
        if url not in lock["indexes"]:
            lock["indexes"].append(url)
    lock["torch_index"] = torch_index(lock)
    return lock


def _hashed(file):
    """Whether a PEP 751 file table (a wheel or the sdist) has a hash: ``{"hashes": {"sha256": "ab..."}}``."""
    hashes = file.get("hashes") if isinstance(file, dict) else None
    return isinstance(hashes, dict) and bool(hashes) and all(isinstance(v, str) and v for v in hashes.values())


def _read_package(lock, number, package):
    """Record one ``[[packages]]`` table of a pylock.toml (see :func:`parse_pylock`)."""
    if not isinstance(package, dict) or not isinstance(package.get("name"), str) or not package["name"]:
        raise VenvError(f"the lock (pylock.toml), package {number}: it has no name; {_PYLOCK_FIX}", kind="lock")
    name = canonical_name(package["name"])
    where = f"the lock (pylock.toml), package {number} ({shown(name)})"
    direct = [key for key in _DIRECT if key in package]
    if direct:
        raise VenvError(f"{where} is a direct reference ({direct[0]}), not an index's file; {_PYLOCK_FIX}", kind="lock")
    version = package.get("version")
    if not (isinstance(version, str) and _VERSION.match(version)):
        raise VenvError(f"{where} has no exact version; {_PYLOCK_FIX}", kind="lock")
    wheels = package.get("wheels") or []
    files = ([package["sdist"]] if "sdist" in package else []) + (wheels if isinstance(wheels, list) else [None])
    if not files or not all(_hashed(file) for file in files):
        raise VenvError(f"{where} lists no wheel or sdist, or one without hashes; {_PYLOCK_FIX}", kind="lock")
    index = package.get("index")
    for url in [index] + [file.get("url") for file in files]:
        refuse_credentials(where, url)
    if name in lock["distributions"]:
        raise VenvError(
            f"{where}: {name} is listed twice ({lock['distributions'][name]} and {shown(version)}, for different "
            f"environments?); compile it for the target only, with `uv pip compile --format pylock.toml "
            f"--python-platform x86_64-manylinux_2_28 --python-version 3.X`",
            kind="lock",
        )
    lock["distributions"][name] = version
    if isinstance(package.get("marker"), str) and package["marker"].strip():
        lock["markers"][name] = package["marker"].strip()
    if isinstance(index, str) and index:
        lock["sources"][name] = index


def torch_index(lock):
    """Where torch comes from: its ``# from`` annotation, else the index named for its variant
    (``2.11.0+cu128`` -> ``https://download.pytorch.org/whl/cu128``), else None."""
    if "torch" in lock["sources"]:
        return lock["sources"]["torch"]
    wanted = variant(lock["distributions"].get("torch"))
    named = [url for url in lock["indexes"] if wanted and url.rstrip("/").rsplit("/", 1)[-1] == wanted]
    return named[0] if named else None


def expected_python(spec, lock):
    """The python minor the venv must have: the spec's, else the lock's ``--python-version``, else None."""
    return spec["python_version"] or lock["python"]


def check_spec(spec):
    """Why the step's settings cannot work (one sentence), or ``""``: called once the SPEC types are checked."""
    for name in ("keep", "unattended_keep"):
        if spec.get(name) is not None and spec[name] < 1:
            return f"{name} is {spec[name]}; the current venv counts, so {name} is at least 1"
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


def python_mismatch(python, lock, where="the lock"):
    """Why ``python_version`` (the setting) cannot be the lock's python (one sentence), or ``""``."""
    if python and lock["python"] and python != lock["python"]:
        return (
            f"python_version is {python} but {where} was compiled for {lock['python']} (--python-version in its "
            f"header): set python_version to {lock['python']}, or compile the lock for {python}"
        )
    return ""


def check_source(source):
    """Why ``lock_from_repo`` cannot work (one sentence), or ``""``."""
    commit, path = source.get("commit") or "", source.get("path") or ""
    if not commit:
        return (
            "lock_from_repo reads the lock at the commit the training code step pins, and that step is off: set "
            "training_code_commit (and training_code_path), or give the lock as training_venv_lock_file"
        )
    if not _SHA.match(commit):
        return (
            f"lock_from_repo's commit is {commit!r}; expected the full sha that training_code_commit pins (40 hex "
            "digits)"
        )
    if not posixpath.isabs(source.get("repo") or ""):
        return f"lock_from_repo's repo is {source.get('repo')!r}; expected the absolute path of training_code_path"
    if posixpath.isabs(path) or posixpath.normpath(path) != path or path in (".", "..") or path.startswith("../"):
        return (
            f"training_venv_lock_from_repo is {path!r}; expected the lock's path relative to the top of the "
            "repository (training_code_path), like requirements/train.lock, without '..'"
        )
    return ""


def lock_source(source):
    """Where a ``lock_from_repo`` lock is read: ``requirements/train.lock at commit 0123456789ab of /srv/train``."""
    return f"{source['path']} at commit {source['commit'][:12]} of {source['repo']}"


def code_step_resets(context):
    """Whether the training code step of this fact pass has work (it fetches and checks out the pinned commit)."""
    return bool(((context.get("steps") or {}).get("training_code") or {}).get("pending"))


def resolve_lock(spec, answer, *, may_defer):
    """``(spec, deferred)``: ``spec`` with ``lock`` the text the build installs and the venv is compared with.

    Without ``lock_from_repo`` that is the setting's. With it, the text the probe read inside the target from the
    training repository at the pinned commit (``answer["repo_lock"]``); the spec returned then has
    ``lock_from_repo`` None. A commit the repository does not have yet is ``deferred`` (``lock`` None) when
    ``may_defer``: in check mode, and in the fact pass while the training code step has work (it fetches the
    commit before this step runs); otherwise, as a path missing at that commit or a lock that cannot be read,
    it raises VenvError naming the fix.
    """
    source = spec.get("lock_from_repo")
    if not source:
        return spec, False
    found = answer.get("repo_lock") if isinstance(answer, dict) else None
    if not isinstance(found, dict):
        raise VenvError(
            "the training_venv probe answered no 'repo_lock' (the lock read from the repository)", kind="probe"
        )
    where = lock_source(source)
    if found.get("missing") == "commit":
        if may_defer:
            return dict(spec, lock=None), True
        raise VenvError(
            f"cannot read the lock {where}: the repository does not have that commit; the training code step "
            "fetches it (training_code_remote) and must run before this one",
            kind="lock",
        )
    if found.get("missing") == "path":
        raise VenvError(
            f"the lock {where} does not exist: commit the lock at that path, or fix training_venv_lock_from_repo (a "
            "path relative to training_code_path)",
            kind="lock",
        )
    if not isinstance(found.get("text"), str):
        raise VenvError(f"cannot read the lock {where}: {printable(found.get('error'))}", kind="lock")
    try:
        wrong = python_mismatch(spec.get("python_version"), parse_lock(found["text"]), f"the lock {where}")
    except VenvError as error:
        raise VenvError(f"the lock {where}: {error}", kind="lock") from None
    if wrong:
        raise VenvError(wrong, kind="lock")
    return dict(spec, lock=found["text"], lock_from_repo=None), False


# -- the venv --------------------------------------------------------------------------------------------------
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
    """``{canonical name: exact version}`` of the venv, from the probe's answer.

    torch's METADATA may say less than its build: PyPI's torch says ``2.11.0`` there and ``2.11.0+cu130`` in
    torch/version.py, so ``{"distributions": [{"name": "torch", "version": "2.11.0"}], "torch_version_py":
    {"version": "2.11.0+cu130"}}`` -> ``{"torch": "2.11.0+cu130"}``. A cu128 index wheel says ``2.11.0+cu128``
    in both and stays so. Only when ``pins`` (the lock) pins exactly the plain version the METADATA says does the
    plain version stand: that pin names PyPI's wheel, which is what is installed (else a rebuild from that very
    lock would still differ). A name with several records gives their versions joined by ``", "``, which never
    equals a pin.
    """
    versions = {name: ", ".join(sorted(set(found))) for name, found in installed_records(answer).items()}
    build = (answer.get("torch_version_py") or {}).get("version")
    metadata = versions.get("torch")
    plain_pin = (pins or {}).get("torch") == metadata
    if build and metadata and "+" not in metadata and build.startswith(f"{metadata}+") and not plain_pin:
        versions["torch"] = build
    return versions


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
    pure. ``answer["build"]`` is the probe's ``pve_ct_venv.build_needs`` (what the build script would use, found the
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
    facts.update(in_use=[], ending_pids=ending_pids_of(context), rebuild=False, prune=[], prune_kept=[])
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
    the diff shows the venv as it stays, and nothing is pending.
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
    the lock comes from the repository), and with ``lock_from_repo`` the lock in the repository:
    ``"lock_from_repo": {"repo", "commit", "path", "git"}``."""
    lock = spec.get("lock")
    python = expected_python(spec, parse_lock(lock)) if lock is not None else spec["python_version"]
    payload = {"path": spec["path"], "timeout": timeout, "uv": spec.get("uv") or "uv", "python": python}
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
