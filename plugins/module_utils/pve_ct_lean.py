# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Container side, shared: what the probe parts need of ``subprocess`` and ``glob``, without their imports.

Every CT's python pays the fact pass's imports on every run. ``subprocess`` imports ``signal``, ``threading``,
``locale`` (and so ``re``) and ``enum``; ``glob`` imports ``fnmatch`` (and so ``re``): together with ``json``, 13
of the 29 ms a CT's python took before its parts ran (docs/benchmarks.md, "The CT's read without imports"). This
module needs only ``os``, ``select``, ``time`` and ``_signal``, whose imports cost a CT nothing measurable.

The preflight and compile_cache parts and :mod:`pve_ct_git` (the training code's probe and reset, the venv probe's
lock read from a commit) import it (``SHARED``): ``Target.run_probes`` ships its source with theirs in the same
``pct exec``, and on a node (a bare host's probe) it is imported as usual. So: standard library only, Python 3.9+,
nothing of ours imported.

* :func:`run`: ``subprocess.run(argv, timeout=...)`` for a command that only reads and may hang (``nvidia-smi`` in
  the driver, git on a slow disk): past the deadline its whole process group is killed and it is waited for
  ``grace`` seconds at most, then left behind.
* :func:`glob`: ``glob.glob(pattern)`` for patterns of ``*``, ``?`` and plain ``[...]`` sets; any other pattern
  (a ``**``, an escape, a set with ``]``, ``[`` or ``-`` at an edge) is handed to ``glob.glob`` itself.
"""

import _signal  # signal's C half: its numbers without signal.py's enum
import os
import select
import time

# Seconds a killed command may take to exit before it is left behind (a process in state D never exits).
REAP_GRACE = 2
# Bytes of each stream kept (what the CT's commands print is untrusted: a few KB for nvidia-smi); the rest is read
# and dropped, so a command that prints without end costs the CT's python no memory.
OUTPUT_CAP = 4 * 1024 * 1024
_CHUNK = 65536


def _wait(pid, deadline):
    """The exit code of ``pid`` (negative: killed by that signal, as subprocess says), or None at ``deadline``."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.005)


def _text(data):
    """A command's output as ``text=True`` read it (universal newlines), but bytes that are not UTF-8 are replaced
    (U+FFFD) where ``text=True`` raised and failed the part."""
    return data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")


def _executable(name, env):
    """The path ``name`` runs from: ``name`` itself when it holds a ``/``, else the first executable file of that
    name on the PATH of ``env`` (subprocess's search: the child's PATH, not this process's), or None."""
    if "/" in name:
        return name
    path = env.get("PATH")  # os.get_exec_path(env), which would import warnings
    for folder in (os.defpath if path is None else path).split(os.pathsep):
        found = os.path.join(folder, name)
        if os.path.isfile(found) and os.access(found, os.X_OK):
            return found
    return None


def _spawn(argv, env):
    """``(pid, stdout fd, stderr fd)`` of ``argv`` started in a session of its own (what it starts is killed with
    it) with no stdin and SIGPIPE and SIGXFSZ at their defaults (as subprocess restores them), or None when it is
    not found. Any other failure to start it (not executable, E2BIG) is raised, as subprocess raised it."""
    env = os.environ if env is None else env
    path = _executable(argv[0], env)
    if path is None:
        return None
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        # Runs in the CT, where no AnsibleModule.run_command exists.
        pid = os.posix_spawn(  # pylint: disable=ansible-bad-function
            path,
            argv,
            env,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, null, 0),
                (os.POSIX_SPAWN_DUP2, out_write, 1),
                (os.POSIX_SPAWN_DUP2, err_write, 2),
            ],
            setsid=True,
            setsigdef=(_signal.SIGPIPE, _signal.SIGXFSZ),
        )
    except BaseException as error:
        os.close(out_read)
        os.close(err_read)
        if isinstance(error, FileNotFoundError):  # gone between the search and the start
            return None
        raise
    finally:
        for fd in (null, out_write, err_write):
            os.close(fd)
    return pid, out_read, err_read


def _read_all(fds, deadline, cap):
    """``{fd: bytes}`` read from ``fds`` until each is at its end (the first ``cap`` bytes of each kept), whether that
    came before ``deadline``, and whether any was cut."""
    output = {fd: [] for fd in fds}
    kept = dict.fromkeys(fds, 0)
    cut = False
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    reading = set(fds)
    while reading:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for fd, _events in poller.poll(left * 1000):
            data = os.read(fd, _CHUNK)
            if data:
                room = len(data) if cap is None else cap - kept[fd]
                cut = cut or len(data) > room
                if room > 0:
                    output[fd].append(data[:room])
                    kept[fd] += min(room, len(data))
            else:
                poller.unregister(fd)
                reading.discard(fd)
    return {fd: b"".join(chunks) for fd, chunks in output.items()}, not reading, cut


def _kill_group(pid):
    try:
        os.killpg(pid, _signal.SIGKILL)
    except ProcessLookupError:  # gone already
        return False
    return True


def run(argv, timeout, env=None, grace=REAP_GRACE, *, cap=OUTPUT_CAP, text=True):
    """Run ``argv`` with no stdin, its output captured, within ``timeout`` seconds.

    ``{"rc", "stdout", "stderr"}``; a command that is not found: ``rc`` 127 and ``"missing": True``; past
    ``timeout``: its process group (it is started in a session of its own, so what it starts dies with it) gets
    SIGKILL, ``rc`` 124 and ``"timed_out": True``, plus ``"abandoned": True`` when it has not exited ``grace``
    seconds later (stuck in the kernel or the driver: it is left behind instead of hanging the run). ``env``: the
    environment (this process's when None). Each stream keeps its first ``cap`` bytes (``"truncated": True`` when
    more came; None: all of it, as ``subprocess.run`` kept it, for git's listing of a repository that may be MBs).
    ``text``
    False: both streams as bytes, as they came. Started with ``posix_spawn`` (a vfork on Linux: safe in the
    module's threads on a bare host).
    """
    as_output = _text if text else bytes
    started = _spawn(argv, env)
    if started is None:
        return _said(as_output, 127, f"{argv[0]}: command not found", missing=True)
    pid, out_read, err_read = started
    deadline = time.monotonic() + timeout
    try:
        output, ended, cut = _read_all((out_read, err_read), deadline, cap)
    finally:
        os.close(out_read)
        os.close(err_read)
    rc = _wait(pid, deadline) if ended else None
    if rc is not None:
        done = {"rc": rc, "stdout": as_output(output[out_read]), "stderr": as_output(output[err_read])}
        return dict(done, truncated=True) if cut else done
    _kill_group(pid)
    said = f"{argv[0]} timed out after {timeout:g} s"
    if _wait(pid, time.monotonic() + grace) is None:
        # Left behind (a zombie until this process exits, if it ever exits); named so the report says why.
        said += f" and did not exit after SIGKILL within {grace:g} s (stuck in the kernel or the driver)"
        return _said(as_output, 124, said, timed_out=True, abandoned=True)
    return _said(as_output, 124, said, timed_out=True)


def _said(as_output, rc, message, **flags):
    """The answer of a command that gave none of its own: ``message`` as its stderr, no stdout."""
    return dict({"rc": rc, "stdout": as_output(b""), "stderr": as_output(message.encode())}, **flags)


# -- glob ------------------------------------------------------------------------------------------------------
_MAGIC = "*?["


def _has_magic(text):
    return any(char in text for char in _MAGIC)


def _set(pattern, start):
    """The plain set opening at ``pattern[start]``: ``(end, negated, ((low, high), ...))``, a lone character being
    ``(char, char)``; or None for a set this module leaves to ``glob.glob`` (no closing ``]``, an empty one, or a
    ``]``, ``[``, ``\\``, ``/``, a ``-`` that is not between two characters, or a reversed range)."""
    end = pattern.find("]", start + 1)
    if end < 0:
        return None
    body = pattern[start + 1 : end]
    negated = body.startswith("!")
    body = body[1:] if negated else body
    items, index = [], 0
    while index < len(body):
        if body[index] in "[\\/-":
            return None
        if index + 2 < len(body) and body[index + 1] == "-":
            if body[index + 2] in "[\\/-" or body[index] > body[index + 2]:
                return None  # fnmatch's reading of a reversed range is its own
            items.append((body[index], body[index + 2]))
            index += 3
        else:
            items.append((body[index], body[index]))
            index += 1
    return (end, negated, tuple(items)) if items else None


def _tokens(pattern):
    """``"nvidia[0-9]*"`` -> ``[("char", "n"), ..., ("set", False, (("0", "9"),)), ("star",)]``, or None for a
    pattern this module leaves to ``glob.glob``."""
    tokens, index = [], 0
    while index < len(pattern):
        char = pattern[index]
        if char == "*":
            if not tokens or tokens[-1] != ("star",):
                tokens.append(("star",))
            index += 1
        elif char == "?":
            tokens.append(("one",))
            index += 1
        elif char == "[":
            found = _set(pattern, index)
            if found is None:
                return None
            tokens.append(("set", found[1], found[2]))
            index = found[0] + 1
        elif char == "\\":
            return None
        else:
            tokens.append(("char", char))
            index += 1
    return tokens


def _in_set(char, items):
    return any(low <= char <= high for low, high in items)


def _match(tokens, name):
    """Whether ``name`` matches ``tokens`` whole, as ``fnmatch.fnmatchcase`` says (``*`` backtracks)."""
    position, index, star, star_position = 0, 0, -1, 0
    while position < len(name):
        token = tokens[index] if index < len(tokens) else None
        if token is not None and token[0] == "star":
            star, star_position = index, position
            index += 1
            continue
        if token is not None and (
            (token[0] == "char" and token[1] == name[position])
            or token[0] == "one"
            or (token[0] == "set" and _in_set(name[position], token[2]) != token[1])
        ):
            position += 1
            index += 1
            continue
        if star < 0:
            return False
        star_position += 1
        position, index = star_position, star + 1
    return all(token[0] == "star" for token in tokens[index:])


def _matching(directory, pattern, tokens, dirs_only):
    """The names in ``directory`` that match; hidden ones only for a pattern that starts with a dot (glob's rule)."""
    try:
        with os.scandir(directory or os.curdir) as entries:
            found = []
            for entry in entries:
                if dirs_only:
                    try:
                        if not entry.is_dir():
                            continue
                    except OSError:
                        continue
                found.append(entry.name)
    except OSError:
        return []
    hidden_too = pattern.startswith(".")
    return [name for name in found if (hidden_too or not name.startswith(".")) and _match(tokens, name)]


def _glob(pattern, dirs_only):
    directory, base = os.path.split(pattern)
    if not _has_magic(pattern):
        if base:
            return [pattern] if os.path.lexists(pattern) else []
        return [pattern] if os.path.isdir(directory) else []
    if directory and directory != pattern and _has_magic(directory):
        directories = _glob(directory, True)
        if directories is None:
            return None
    else:
        directories = [directory]
    if not _has_magic(base):
        return [
            os.path.join(found, base)
            for found in directories
            if (os.path.lexists(os.path.join(found, base)) if base else os.path.isdir(found))
        ]
    tokens = _tokens(base)
    if tokens is None:
        return None
    return [os.path.join(found, name) for found in directories for name in _matching(found, base, tokens, dirs_only)]


def glob(pattern):
    """``glob.glob(pattern)``: the existing paths that match, in directory order (sort them)."""
    found = _glob(pattern, False) if "**" not in pattern else None
    if found is None:
        import glob as stdlib_glob  # noqa: PLC0415 (a pattern this module does not read itself)

        return stdlib_glob.glob(pattern)
    return found
