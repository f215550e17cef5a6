# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The training venv step's lock: what it pins, where it comes from, and the names in it; pure.

The lock is a ``uv pip compile --generate-hashes`` requirements file (:func:`parse_lock`) or a PEP 751
``pylock.toml`` (:func:`parse_pylock`, read into the same form), given as text or read inside the target from the
training repository at the commit the training code step pins (``lock_from_repo``, :func:`resolve_lock`). Anything
that is not an exact pin, a name pinned twice or a URL with credentials in it is refused (VenvError, the step's
error, raised by the comparison too). Names are compared PEP 503-normalized (:func:`pve_ct_venv.canonical_name`);
what the venv or the lock chose is shown escaped and bounded (:func:`shown`).
"""

from __future__ import annotations

import copy
import functools
import posixpath
import re

from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_ct_act import redact
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_ct_venv import canonical_name
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_errors import RecoverError
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_text import printable
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_torch_build import variant

_PIN = re.compile(
    r"^(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(?:\[[^\]]*\])?\s*"
    r"==\s*(?P<version>[A-Za-z0-9][A-Za-z0-9.+!_-]*)\s*(?:;\s*(?P<marker>.+))?$"
)
_HASH = re.compile(r"\s*--hash[=\s]\S+")
_INLINE_COMMENT = re.compile(r"(^|\s+)#.*$")
_OPTION = re.compile(r"^(?P<option>--?[A-Za-z][\w-]*)(?:\s*=\s*|\s+)?(?P<value>.*)$")
_SOURCE_ANNOTATION = re.compile(r"^#\s*from\s+(?P<url>\S+)\s*$")
_HEADER_PYTHON = re.compile(r"(?:^|\s)(?:--python-version|--python|-p)[=\s]+(?P<version>\d+\.\d+)(?:\.\d+)?\b")
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
NAME_SHOWN = 120  # characters of a file or package name the venv chose that a message quotes


class VenvError(RecoverError):
    """The lock cannot be used, or the probe answered something that is not a venv probe's answer."""


# -- names and versions ----------------------------------------------------------------------------------------
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


def empty_lock():
    """What a lock means before its lines are read, the same for a requirements lock and a pylock.toml."""
    return {
        "distributions": {},
        "indexes": [],
        "torch_index": None,
        "find_links": [],
        "no_index": False,
        "sources": {},
        "markers": {},
        "python": None,
    }


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

    A text is read once per process: a node's read evaluates the lock of each of its targets four times, the
    same text for all of them (64 reads for 16 CTs made the module's CPU two thirds more with the seeds' 127 KB
    lock; docs/benchmarks.md); each call gets a copy of its own.
    """
    return copy.deepcopy(_parse_lock(text))


@functools.lru_cache(maxsize=8)
def _parse_lock(text):
    """:func:`parse_lock`'s reading, kept per text (an error is raised again each time, never kept)."""
    if lock_format(text) == "pylock":
        return parse_pylock(text)
    lock = empty_lock()
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
    lock = empty_lock()
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
