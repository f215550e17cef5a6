# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Container side, shared: who could change a venv whose python runs as root (verify, the venv build's checks) or an
executable root runs (the uv of the role's wheel), and what builds a venv in the target (the venv probe asks before
anything changes, the build script uses the same).

The training venv, verify and compile_cache probe parts and the venv build script import it (``SHARED``):
``Target.run_probes`` ships its source with theirs in the same ``pct exec``, and on a node it is imported as usual.
So: standard library only, Python 3.9+, nothing of ours imported.
"""

import os
import pwd
import stat
import sys

# A METADATA header as the target wrote it is read this far at most (Name and Version are its lines 2 and 3).
HEADER_LINES = 200
HEADER_LINE_CHARS = 8192
# A small file the target wrote (pyvenv.cfg, torch/version.py...) is read this far at most: a few KB in real ones.
SMALL_FILE_LIMIT = 65536
VENV_INSIDE = ("bin", "pyvenv.cfg", "lib")  # what the venv's python reads or runs at start-up, with lib/pythonX.Y/...


class _Absent(Exception):
    """A component does not exist (yet): root creates it, nobody else can have changed it."""


def _writers(path, info, sticky_ok):
    """Why a user other than root could change ``path`` (its lstat ``info``), or None: not root's, or writable by
    a group or every user (a sticky directory of root's excepted where ``sticky_ok``: there an entry of root's
    can be renamed or removed by root alone)."""
    if info.st_uid != 0:
        return f"{path} is owned by uid {info.st_uid}, not root"
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022 and not (sticky_ok and stat.S_ISDIR(info.st_mode) and mode & stat.S_ISVTX):
        who = "every user" if mode & 0o002 else f"group {info.st_gid}"
        return f"{path} may be written by {who} (mode {mode:04o})"
    return None


def _lstat(path):
    try:
        return os.lstat(path)
    except FileNotFoundError:
        raise _Absent(path) from None


def _above(parts, what="a venv's path"):
    """Why a directory above the last of ``parts`` could be changed by another user than root, or None."""
    for depth in range(len(parts)):
        here = "/" + "/".join(parts[:depth])
        info = _lstat(here)
        if stat.S_ISLNK(info.st_mode):
            return f"{here} is a symlink (to {os.readlink(here)}): {what} must be real directories from /"
        why = _writers(here, info, sticky_ok=True) if stat.S_ISDIR(info.st_mode) else f"{here} is not a directory"
        if why:
            return why
    return None


def is_version_name(name, base):
    """Whether ``name`` is ``<base>.<UTC stamp>``, a version the training venv step built: ``train.20261207T064401Z``
    for ``train``. (Not a regular expression: this runs in every CT's fact pass, whose python imports no ``re``.)"""
    stamp = name[len(base) + 1 :] if name.startswith(base + ".") else ""
    return (
        len(stamp) == 16 and stamp[:8].isdecimal() and stamp[8] == "T" and stamp[9:15].isdecimal() and stamp[15] == "Z"
    )


def _version_of(path):
    """``(real, None)``: the directory the venv at ``path`` is (itself, or the version its link names);
    ``(None, why)`` when the link is not the step's own (root's, to a sibling ``<path>.<stamp>``)."""
    info = _lstat(path)
    if not stat.S_ISLNK(info.st_mode):
        return path, None
    parent, base = os.path.split(path)
    target = os.readlink(path)
    real = os.path.normpath(os.path.join(parent, target))
    if os.path.dirname(real) != parent or not is_version_name(os.path.basename(real), base):
        return None, f"{path} is a symlink to {target}, not to a version {base}.<stamp> beside it"
    if info.st_uid != 0:  # a link's own mode means nothing; its owner may replace it in a sticky parent
        return None, f"{path} is owned by uid {info.st_uid}, not root"
    return real, None


def _inside(real):
    """Why the venv directory ``real`` or what its python reads at start-up could be changed by another user."""
    found = [real] + [os.path.join(real, name) for name in VENV_INSIDE]
    try:
        pythons = sorted(n for n in os.listdir(os.path.join(real, "lib")) if n.startswith("python"))
    except OSError:
        pythons = []
    for name in pythons:
        found += [os.path.join(real, "lib", name), os.path.join(real, "lib", name, "site-packages")]
    for here in found:
        try:
            info = _lstat(here)
        except _Absent:
            if here == real:
                return None  # a dangling link: no python to run; the step rebuilds it
            continue
        if stat.S_ISLNK(info.st_mode):
            return f"{here} is a symlink (to {os.readlink(here)})"
        if here == real and not stat.S_ISDIR(info.st_mode):
            return f"{here} is not a directory"
        why = _writers(here, info, sticky_ok=False)
        if why:
            return why
    return None


def venv_unsafe(path):
    """Why a user other than root could change the venv at ``path`` (so its python must never run as root), or
    None; None too for a venv (or directories) that do not exist yet, which root creates.

    Each component from ``/`` is read by ``lstat``: a symlink is refused, except ``path`` itself when it is the
    training venv step's link (root's) to a sibling ``<path>.<stamp>``; every directory above, the venv (the
    version) and its ``bin``, ``pyvenv.cfg``, ``lib``, ``lib/pythonX.Y`` and their ``site-packages`` must be
    root's and not writable by a group or every user. A sticky directory of root's (``/tmp``) is accepted above
    the venv: the next component must be root's anyway, and only root can then move it.
    ``venv_unsafe("/srv/alice/venv")`` with ``/srv/alice`` owned by uid 1000 -> ``"/srv/alice is owned by uid
    1000, not root"``."""
    parts = [part for part in os.path.normpath("/" + path).split("/") if part]
    if not parts:
        return "it is the filesystem root /"
    try:
        why = _above(parts)
        if why:
            return why
        real, why = _version_of("/" + "/".join(parts))
        return why or _inside(real)
    except _Absent:
        return None


def trusted_executable(path):
    """Whether root may run the file at ``path`` as one only root could have put there and changed: ``{"installed":
    True, "unsafe": None}`` for a regular file of root's that a group or every user may not write, with root's
    execute bit, below real directories from ``/`` that only root can change (:func:`venv_unsafe`'s rule for the
    directories above a venv). ``installed`` False for none (a missing file or directory) or another thing (a
    link, never followed; another owner's file; a file others may write; one root cannot run; a directory): root
    puts its own in its place. ``unsafe`` (why) when a directory above could be changed by another user: nothing
    may be put there nor run from there. lstat alone: nothing is opened or followed."""
    parts = [part for part in os.path.normpath("/" + path).split("/") if part]
    try:
        why = _above(parts, "a path root runs from")
        if why:
            return {"installed": False, "unsafe": why}
        info = _lstat("/" + "/".join(parts))
    except _Absent:
        return {"installed": False, "unsafe": None}
    runs = stat.S_ISREG(info.st_mode) and info.st_mode & stat.S_IXUSR
    return {"installed": bool(runs) and _writers(path, info, sticky_ok=False) is None, "unsafe": None}


# -- what builds a venv: the build script runs it, the probe says beforehand whether it can ------------------------
# The regular expression below is used by the venv step's build only; ``re`` is imported where it is, so that the
# verify part, which ships this module to every CT, never imports it.
_UV_MANAGED = r"^cpython-(\d+\.\d+)\."  # uv python install: cpython-3.11.9-linux-x86_64-gnu


def find_command(name, path):
    """The executable ``name`` names: itself when it holds a ``/`` (an executable file), else the first one on
    ``path`` (a PATH string; None: this process's); None when there is none. ``find_command("uv",
    "/usr/local/bin:/usr/bin")`` -> ``"/usr/bin/uv"`` when only /usr/bin has one."""
    if "/" in name:
        return name if os.path.isfile(name) and os.access(name, os.X_OK) else None
    # Imported here only: shutil imports bz2 and lzma, 2 ms of the start of every probe that ships this module and
    # not ct_git (which imports it anyway), such as a CT read for preflight and verify alone.
    import shutil  # noqa: PLC0415

    return shutil.which(name, path=path)


def builder(uv, path):
    """What the build uses: ``("uv", its path)`` when ``uv`` (a name looked up on ``path``, or a path) can be run,
    else ``("venv+pip", why uv is not used)``: ``builder("uv", "/usr/bin")`` -> ``("venv+pip", "uv is not on PATH
    (/usr/bin)")`` when /usr/bin has no uv."""
    found = find_command(uv, path)
    if found:
        return "uv", found
    if "/" in uv:
        return "venv+pip", f"{uv} is not an executable file"
    return "venv+pip", f"{uv} is not on PATH ({path or ''})"


def python_name(minor):
    """The interpreter ``-m venv`` runs with: ``python3.11`` for a pinned minor, else ``python3``."""
    return f"python{minor}" if minor else "python3"


def base_python(minor, path):
    """The path of :func:`python_name` on ``path``, or None."""
    return find_command(python_name(minor), path)


def own_minor():
    """This interpreter's python minor: ``"3.11"``."""
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def interpreter_minor(executable):
    """The python minor of an interpreter, told from its files alone (it is never run): the name it resolves to
    (``/usr/bin/python3`` -> ``python3.11`` -> ``"3.11"``), or this very interpreter's own; None when unknown (a
    pyenv shim, a binary named ``python3``)."""
    real = os.path.realpath(executable)
    named = python_name_minor(os.path.basename(real))
    if named:
        return named
    if sys.executable and real == os.path.realpath(sys.executable):
        return own_minor()
    return None


def stdlib_has(executable, minor, package):
    """Whether the standard library of the interpreter ``executable`` (python ``minor``) holds ``package``
    (``ensurepip``, ``venv``), from its files: this interpreter's own library when it is this one, else
    ``<prefix>/lib/python<minor>/`` beside its ``<prefix>/bin``. None when that library is not found (not told).

    Debian and Ubuntu leave ``ensurepip`` out of python3.X until ``python3.X-venv`` is installed, and ``python3 -m
    venv`` then fails: ``stdlib_has("/usr/bin/python3.11", "3.11", "ensurepip")`` -> False there."""
    real = os.path.realpath(executable)
    if sys.executable and real == os.path.realpath(sys.executable):
        library = os.path.dirname(os.__file__)
    elif minor:
        library = os.path.join(os.path.dirname(os.path.dirname(real)), "lib", f"python{minor}")
    else:
        return None
    if not os.path.isfile(os.path.join(library, "os.py")):
        return None
    return os.path.isfile(os.path.join(library, package, "__init__.py"))


def uv_python_dirs(environ=None):
    """Where uv keeps the pythons it installed (``uv python install``): ``UV_PYTHON_INSTALL_DIR``, else
    ``$XDG_DATA_HOME/uv/python``, else ``~/.local/share/uv/python`` of ``$HOME`` or of this user's passwd entry."""
    environ = os.environ if environ is None else environ
    if environ.get("UV_PYTHON_INSTALL_DIR"):
        return [environ["UV_PYTHON_INSTALL_DIR"]]
    if environ.get("XDG_DATA_HOME"):
        return [os.path.join(environ["XDG_DATA_HOME"], "uv", "python")]
    home = environ.get("HOME")
    if not home:
        try:
            home = pwd.getpwuid(os.geteuid()).pw_dir
        except KeyError:
            return []
    return [os.path.join(home, ".local", "share", "uv", "python")]


def uv_python(minor, path, environ=None):
    """The interpreter ``uv venv --python <minor>`` would find with downloads off (the build's
    ``UV_PYTHON_DOWNLOADS=never``), told from files alone: ``python<minor>`` on ``path``, a ``python3`` or ``python``
    there of that minor (:func:`interpreter_minor`), or one uv installed itself; None when there is none. Without a
    minor the build asks for ``python3``: the one on ``path``."""
    import re  # noqa: PLC0415 (see _UV_MANAGED)

    if not minor:
        return find_command("python3", path)
    found = find_command(f"python{minor}", path)
    if found:
        return found
    for name in ("python3", "python"):
        found = find_command(name, path)
        if found and interpreter_minor(found) == minor:
            return found
    for directory in uv_python_dirs(environ):
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            managed = re.match(_UV_MANAGED, name)
            if managed and managed.group(1) == minor:
                return os.path.join(directory, name)
    return None


def build_needs(uv, minor, path):
    """What building the venv would use, read from files alone (nothing is run), for the venv step to say before
    anything changes whether a build can work.

    ``uv``: the uv setting (name or path); ``minor``: the python the venv must have (None: any ``python3``);
    ``path``: the PATH the build runs with. Returns ``{"path", "uv" (the uv the build would run, or None),
    "uv_missing" (why there is none, or None), "python" (the interpreter ``-m venv`` would run: ``python3.11``),
    "base_python" (its path, or None), "venv" and "ensurepip" (whether its standard library holds them; None: not
    told), "uv_python" (an interpreter of ``minor`` uv would find, or None), "own" (this interpreter's minor)}``.
    """
    kind, found = builder(uv, path)
    base = base_python(minor, path)
    base_minor = minor or (interpreter_minor(base) if base else None)
    return {
        "path": path,
        "uv": found if kind == "uv" else None,
        "uv_missing": None if kind == "uv" else found,
        "python": python_name(minor),
        "base_python": base,
        "venv": stdlib_has(base, base_minor, "venv") if base else None,
        "ensurepip": stdlib_has(base, base_minor, "ensurepip") if base else None,
        "uv_python": uv_python(minor, path),
        "own": own_minor(),
    }


# -- torch/version.py, read as text (never executed: the venv is untrusted input) ----------------------------------
def _word_end(line):
    """The length of the ``[A-Za-z0-9_]``-like word (``str.isalnum`` or ``_``) that starts ``line``."""
    index = 0
    while index < len(line) and (line[index].isalnum() or line[index] == "_"):
        index += 1
    return index


def assignments(text):
    """The ``name = value`` and ``name: type = value`` lines of a generated module's source, one line each, as
    ``(name, value source)`` pairs: ``"__version__ = '2.11.0'\ncuda: Optional[str] = '12.8'\n"`` ->
    ``[("__version__", "'2.11.0'"), ("cuda", "'12.8'")]``. A name starts its line; the value is the rest of it,
    stripped, and not empty. (torch's setup writes one assignment a line; not a regular expression, since the
    verify part runs this in every CT, whose python imports no ``re``.)"""
    found = []
    for line in text.split("\n"):  # not splitlines(): a form feed or a \x1c is no line break in Python source
        end = _word_end(line)
        if not end:
            continue
        rest = line[end:].lstrip()
        if rest.startswith(":"):
            _annotation, equals, value = rest[1:].partition("=")
            if not equals:
                continue
            rest = "=" + value
        if rest.startswith("=") and rest[1:].strip():
            found.append((line[:end], rest[1:].strip()))
    return found


def string_literal(source):
    """``'2.11.0'`` or ``"2.11.0"`` without a backslash or its own quote inside -> ``2.11.0``; anything else -> None."""
    quote, inner = source[:1], source[1:-1]
    if len(source) >= 2 and quote in ("'", '"') and source[-1] == quote and quote not in inner and "\\" not in inner:
        return inner
    return None


def version_py_value(source):
    """A version.py value: a quoted string (:func:`string_literal`), None, True or False; anything else is kept as
    its source text."""
    literal = string_literal(source)
    if literal is not None:
        return literal
    return {"None": None, "True": True, "False": False}.get(source, source)


def read_version_py(text, keys, value=version_py_value):
    """``{keys[name]: value(source)}`` of torch/version.py's :func:`assignments` whose name is in ``keys`` (the
    last one wins); a key it does not assign is None. ``__version__`` is read as a string literal only (None
    else): it is compared as a version, and a ``__version__ = True`` a file in the target says is no version."""
    found = dict.fromkeys(keys.values())
    for name, source in assignments(text):
        if name in keys:
            found[keys[name]] = string_literal(source) if name == "__version__" else value(source)
    return found


def canonical_name(name):
    """PEP 503 normalization (``re.sub(r"[-_.]+", "-", name).lower()``, without ``re``): ``Typing_Extensions`` ->
    ``typing-extensions``, ``zope.interface`` -> ``zope-interface``."""
    parts, separated = [], False
    for char in name:
        if char in "-_.":
            if not separated:
                parts.append("-")
            separated = True
        else:
            parts.append(char)
            separated = False
    return "".join(parts).lower()


def installed_versions(records, torch_build, pins=None):
    """``{canonical name: exact version}`` of a venv from its ``[(name, version)]`` METADATA records and the version
    its torch/version.py says (``torch_build``; None without one). The fact pass and the build script both read a
    venv through this one rule.

    torch's METADATA may say less than its build: PyPI's torch says ``2.11.0`` there and ``2.11.0+cu130`` in
    torch/version.py, so ``[("torch", "2.11.0")]`` with ``"2.11.0+cu130"`` -> ``{"torch": "2.11.0+cu130"}``. A cu128
    index wheel says ``2.11.0+cu128`` in both and stays so. Only when ``pins`` (the lock) pins exactly the plain
    version the METADATA says does the plain version stand: that pin names PyPI's wheel, which is what is installed
    (else a rebuild from that very lock would still differ). A name with several records gives their versions
    joined by ``", "``, which never equals a pin.
    """
    found = {}
    for name, version in records:
        found.setdefault(canonical_name(name), set()).add(version)
    versions = {name: ", ".join(sorted(each)) for name, each in found.items()}
    metadata = versions.get("torch")
    plain_pin = (pins or {}).get("torch") == metadata
    if torch_build and metadata and "+" not in metadata and torch_build.startswith(f"{metadata}+") and not plain_pin:
        versions["torch"] = torch_build
    return versions


def minor_of(version):
    """``3.11.2``, ``3.11.2.final.0`` or ``3.11`` -> ``3.11``; anything else -> None."""
    major, dot, rest = (version or "").strip().partition(".")
    digits = len(rest) - len(rest.lstrip("0123456789"))
    if major.isdecimal() and major.isascii() and dot and digits:
        return f"{major}.{rest[:digits]}"
    return None


def config_minor(config):
    """The python minor of a venv's ``pyvenv.cfg`` (``{key: value}``, keys lower case, as :func:`read_config`
    reads it): its ``version`` (Python's venv) or ``version_info`` (uv, virtualenv), else None."""
    return minor_of(config.get("version") or config.get("version_info"))


def read_config(text):
    """``pyvenv.cfg`` as a dict: ``home = /usr/bin`` -> ``{"home": "/usr/bin"}`` (keys lower-cased; a later line
    wins, as Python's own reading of the file)."""
    config = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and not key.lstrip().startswith("#"):
            config[key.strip().lower()] = value.strip()
    return config


def python_name_minor(name):
    """``python3.11`` -> ``3.11`` (a ``lib/pythonX.Y`` directory, an interpreter's name); anything else -> None."""
    minor = name[6:] if name.startswith("python") else ""
    return minor if minor and minor_of(minor) == minor else None


def lib_minors(venv):
    """The ``X.Y`` of each ``lib/pythonX.Y`` entry of ``venv``, sorted; [] when there is no ``lib`` to list."""
    try:
        names = os.listdir(os.path.join(venv, "lib"))
    except OSError:
        return []
    return sorted(filter(None, map(python_name_minor, names)))


def site_packages(venv, minor):
    """``(site-packages, minors, minor)`` of ``venv``: the directory ``lib/python<minor>/site-packages``, the one
    the venv's python imports from (``minor``: what its pyvenv.cfg names; when it names none, the only
    ``lib/pythonX.Y``'s), or None when there is none (another minor's is never taken: the venv's python would not
    import it); every ``lib/pythonX.Y`` found; and the minor it looked for (None: which one is not told)."""
    minors = lib_minors(venv)
    if minor is None and len(minors) == 1:
        minor = minors[0]
    chosen = os.path.join(venv, "lib", f"python{minor}", "site-packages") if minor in minors else None
    return (chosen if chosen is not None and os.path.isdir(chosen) else None), minors, minor


def read_small_text(path, limit=SMALL_FILE_LIMIT):
    """The first ``limit`` bytes of a small file the target wrote (``pyvenv.cfg``, ``torch/version.py``,
    ``top_level.txt``, ``/proc/<pid>/comm``) as text with universal newlines, bytes that are not UTF-8 replaced; None
    when it cannot be read or is not a regular file. Opened without blocking: a FIFO left in its place never hangs
    the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    chunks, left = [], limit
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        while left > 0:
            data = os.read(fd, min(left, 65536))
            if not data:
                break
            chunks.append(data)
            left -= len(data)
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")


def metadata_header(path):
    """``{"name": ..., "version": ...}`` of a METADATA / PKG-INFO file, reading only its header (up to the first
    blank line); None when the file cannot be read.

    Stops as soon as both are known: they are the second and third lines of every real METADATA, and the long
    description after the header can be megabytes. A file the target wrote is read bounded: at most
    HEADER_LINES lines of at most HEADER_LINE_CHARS characters each.
    """
    found = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            for _line_number in range(HEADER_LINES):
                line = handle.readline(HEADER_LINE_CHARS)
                if not line.strip():
                    break
                key, sep, value = line.partition(":")
                key = key.lower()
                if sep and key in ("name", "version") and key not in found:
                    found[key] = value.strip()
                    if len(found) == 2:
                        break
    except OSError:
        return None
    return found
