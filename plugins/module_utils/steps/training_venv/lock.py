# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The training venv step's lock: what it pins, where it comes from, and the names in it; pure.

The lock is a ``uv pip compile --generate-hashes`` requirements file (:func:`parse_lock`) or a PEP 751
``pylock.toml`` (:func:`parse_pylock`, read into the same form), given as text or read inside the target from the
training repository at the commit the training code step pins (``lock_from_repo``, :func:`resolve_lock`). Anything
that is not an exact pin, a name pinned twice or a URL with credentials in it is refused (VenvError, the step's
error, raised by the comparison too). Names are compared PEP 503-normalized (:func:`ct_venv.canonical_name`);
what the venv or the lock chose is shown escaped and bounded (:func:`shown`).
"""

from __future__ import annotations

import copy
import functools
import posixpath
import re

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct.act import MASK
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct.venv import canonical_name
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.errors import RecoverError
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.text import printable
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.torch_build import variant

# The lock's characters (ASCII): a distribution's name (PEP 508) and an exact version as a lock writes it.
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_OPTION_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_DIGITS = frozenset("0123456789")
_PYTHON_OPTIONS = ("--python-version", "--python", "-p")  # in uv's header: what it compiled for
_INDEX_OPTIONS = {"--index-url": "index", "-i": "index", "--extra-index-url": "extra"}
_VALUE_OPTIONS = ("--index-url", "-i", "--extra-index-url", "--find-links", "-f")  # each names a URL or a path
_REJECTED_OPTIONS = ("-e", "--editable", "-r", "--requirement", "-c", "--constraint")
_FIX = "compile it with `uv pip compile --generate-hashes`"
_PYLOCK_FIX = (
    "compile it with `uv pip compile --format pylock.toml --generate-hashes` for the target's python and platform"
)
_PYLOCK_KEY = re.compile(r"^lock-version\s*=", re.MULTILINE)
_VERSION_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.+!_-")
_DIRECT = ("vcs", "directory", "archive")  # PEP 751 sources that are no index's file
_USERINFO = re.compile(r"^\s*[A-Za-z][A-Za-z0-9+.-]*://[^/@\s]+@")
_SHA = re.compile(r"^(?:[0-9a-fA-F]{40}|[0-9a-fA-F]{64})$")
_CREDENTIALS_FIX = (
    "carries credentials, which would be in every report and log; take them out of the lock and give them as "
    "training_venv_index_credentials"
)
NAME_SHOWN = 120  # characters of a file or package name the venv chose that a message quotes
# The most a lock may weigh on the node (UTF-8 bytes), checked before it is parsed: a lock read in the training
# repository is the target's word (the target sends up to ct_git.BLOB_LIMIT, 4 MiB), parsed in the fact pass that
# holds every CT of the node. The seeds' CUDA stack (92 pins, every wheel's hash) is 127 KB; a lock with 1,000 such
# pins fits.
LOCK_MAX_BYTES = 1024 * 1024


class VenvError(RecoverError):
    """The lock cannot be used, or the probe answered something that is not a venv probe's answer."""


# -- names and versions ----------------------------------------------------------------------------------------
def shown(text, limit=NAME_SHOWN):
    """A name, a version or a line the target chose, as a message or diff line may show it (one line, escaped, cut
    to ``limit`` characters; only that much of it is ever escaped)."""
    if isinstance(text, str) and len(text) > limit:
        text = text[: limit + 1]  # printable cuts it and adds "..."
    return printable(text, limit)


def is_name(text):
    """A distribution's name as PEP 508 spells it: letters, digits, ``.``, ``_``, ``-``, beginning and ending with a
    letter or digit (``torch``, ``nvidia-cudnn-cu12``); checked character by character, no backtracking."""
    return bool(text) and text[0] in _ALNUM and text[-1] in _ALNUM and _NAME_CHARS.issuperset(text)


def _is_version(text):
    """An exact version as a lock writes it (``2.11.0+cu128``, ``1!2.0.post1``)."""
    return bool(text) and text[0] in _ALNUM and _VERSION_CHARS.issuperset(text)


def _is_option(text):
    """An option's name: ``-i``, ``--extra-index-url``, ``--no-index``."""
    name = text[2:] if text.startswith("--") else text[1:] if text.startswith("-") else ""
    return bool(name) and name[0].isascii() and name[0].isalpha() and _OPTION_CHARS.issuperset(name)


def _python_minor(value):
    """``3.11`` of ``3.11`` or ``3.11.4``; None for anything else (``3.11rc1``, ``python3``)."""
    parts = value.split(".")
    if len(parts) in (2, 3) and all(part and _DIGITS.issuperset(part) for part in parts):
        return f"{parts[0]}.{parts[1]}"
    return None


def _without_comment(line):
    """``line`` up to its inline comment: a ``#`` at its start or after whitespace, as pip reads one."""
    start = 0
    while True:
        found = line.find("#", start)
        if found < 0:
            return line
        if found == 0 or line[found - 1].isspace():
            return line[:found]
        start = found + 1


def _without_hashes(line):
    """``line``'s words without its ``--hash=...`` / ``--hash ...`` options, joined by one space."""
    words, kept = line.split(), []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word == "--hash":
            skip = True
        elif not word.startswith("--hash="):
            kept.append(word)
    return " ".join(kept)


def check_size(text):
    """A lock larger than LOCK_MAX_BYTES raises VenvError before anything else reads it (see LOCK_MAX_BYTES)."""
    if len(text) > LOCK_MAX_BYTES or len(text.encode("utf-8", "surrogatepass")) > LOCK_MAX_BYTES:
        raise VenvError(
            f"the lock is {len(text.encode('utf-8', 'surrogatepass')):,} bytes; a lock here is at most "
            f"{LOCK_MAX_BYTES:,} bytes ({LOCK_MAX_BYTES >> 20} MiB; the seeds' CUDA stack of 92 pins is 127 KB): "
            f"{_FIX} for the target's python and platform only",
            kind="lock",
        )


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
    """:func:`parse_lock`'s reading, kept per text (an error is raised again each time, never kept).

    Linear in the text's length whatever it holds (issue 40): lines are split, stripped and partitioned, never
    matched by a regular expression that could backtrack."""
    check_size(text)
    if lock_format(text) == "pylock":
        return parse_pylock(text)
    lock = empty_lock()
    indexes = {"index": [], "extra": []}
    last, in_header = None, True
    for number, line in _logical_lines(text):
        if line.startswith("#"):
            _read_comment(lock, line, last, in_header)
            continue
        requirement = _without_comment(line).strip()
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
    words = line[1:].split()
    if last and len(words) == 2 and words[0] == "from":
        lock["sources"][last] = words[1]
    if in_header and "compile" in line:
        for number, word in enumerate(words):
            name, equals, value = word.partition("=")
            if name not in _PYTHON_OPTIONS:
                continue
            if not equals and number + 1 < len(words):
                value = words[number + 1]
            minor = _python_minor(value.lstrip("="))
            if minor:
                lock["python"] = minor
                return


def _read_option(lock, indexes, number, line):
    """Index, find-links and no-index options are kept; -e, -r, -c are refused; others (--trusted-host) pass."""
    first = line.split(None, 1)[0]  # the line is stripped: its first word starts it
    name, equals, value = first.partition("=")  # --index-url=URL, --index-url URL, --index-url = URL
    value = value + line[len(first) :] if equals else line[len(first) :].lstrip()
    value = (value[1:] if not equals and value.startswith("=") else value).strip()
    if name in _REJECTED_OPTIONS or not _is_option(name):
        raise VenvError(
            f"the lock, line {number}: `{shown(line)}` is not an exact pin (name==version); {_FIX}", kind="lock"
        )
    if name in _VALUE_OPTIONS and not value:
        raise VenvError(f"the lock, line {number}: `{shown(line)}` names no URL or path; {_FIX}", kind="lock")
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
    pin = _pin_of(_without_hashes(line))
    if pin is None:
        what = "a direct reference" if " @ " in line or "://" in line else "not an exact pin (name==version)"
        raise VenvError(f"the lock, line {number}: `{shown(line)}` is {what}; {_FIX}", kind="lock")
    name = canonical_name(pin["name"])
    if name in lock["distributions"]:
        raise VenvError(
            f"the lock, line {number}: {name} is pinned twice ({lock['distributions'][name]} and "
            f"{shown(pin['version'])}, for different markers?); compile it for the target only, with "
            f"`uv pip compile --python-platform x86_64-manylinux_2_28 --python-version 3.X`",
            kind="lock",
        )
    lock["distributions"][name] = pin["version"]
    if pin["marker"]:
        lock["markers"][name] = pin["marker"]
    return name


def _pin_of(text):
    """``{"name", "version", "marker"}`` of ``name[extras] == version ; marker`` (hashes removed), or None.

    ``_pin_of("uvicorn[standard]==0.30.6 ; sys_platform == 'linux'")`` -> ``{"name": "uvicorn", "version":
    "0.30.6", "marker": "sys_platform == 'linux'"}``; ``_pin_of("torch>=2.11")`` -> None."""
    requirement, semicolon, marker = text.partition(";")
    marker = marker.strip()
    name, equals, version = requirement.partition("==")
    name, version = name.strip(), version.strip()
    if not equals or (semicolon and not marker) or not _is_version(version):
        return None
    if name.endswith("]"):
        name, bracket, extras = name[:-1].partition("[")
        if not bracket or "]" in extras or "[" in extras:
            return None
        name = name.strip()
    if not is_name(name):
        return None
    return {"name": name, "version": version, "marker": marker or None}


def lock_format(text):
    """``"pylock"`` for a PEP 751 ``pylock.toml`` (a top-level ``lock-version`` key, which no requirements file
    has), else ``"requirements"``."""
    return "pylock" if _PYLOCK_KEY.search(text or "") else "requirements"


def refuse_credentials(where, url):
    """A URL of the lock that carries credentials raises VenvError (the message shows it with them masked)."""
    if isinstance(url, str) and _USERINFO.match(url):
        # Masked by hand, in linear time (ct_act.redact searches the whole text): the user information is what lies
        # between "://" and the first "@", which the match above found.
        scheme, _sep, rest = url.strip().partition("://")
        raise VenvError(f"{where}: {scheme}://{MASK}@{shown(rest.partition('@')[2])} {_CREDENTIALS_FIX}", kind="lock")


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
    except RecursionError:  # tomllib reads nested arrays and tables recursively
        raise VenvError(
            f"the lock (pylock.toml) nests deeper than Python's recursion limit: it is no lock; {_PYLOCK_FIX}",
            kind="lock",
        ) from None
    version = data.get("lock-version")
    parts = version.split(".") if isinstance(version, str) else [None]
    if parts[0] != "1" or not all(part and _DIGITS.issuperset(part) for part in parts[1:]):
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
    if not (isinstance(version, str) and _is_version(version)):
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
