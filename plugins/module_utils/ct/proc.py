# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Container side, shared: the target's /proc read bounded in bytes and time, and which processes use a directory.

``cmdline``, ``environ`` and ``maps`` of /proc/<pid> take the process's mmap lock, which a thread stuck in the
driver (state D) can hold for ever: a plain read of one never returns, and the probe would die at its pct exec's
timeout with nobody named. :func:`read` reads such files in one child for a whole pass (:data:`READER`: this
python, isolated), through ct_run's runner: the child prints each file as a frame once it has read it (its length
first: what a process wrote in its own command line cannot pass for a frame), each file up to its limit
(:data:`LIMITS`). When it prints nothing for ``stall`` seconds it is killed: the file it is stuck on is the one
after its last frame, named (blocked), the other files of that process are left (they wait on the same lock), and
a new reader goes on with the rest.

:func:`scan` is the one rule in the target for who uses a directory: a process uses a root when its working
directory, its executable, a file it holds open, an absolute path in its command line or a file it maps lies in
it, or when it imports from it without holding a file of it open (a ``PYTHONPATH`` entry, or the package of
``python -m``: :func:`imports_from`). The compile cache's probe part and purge, the venv build's last look before
its swap and its retention, and the code reset's last look read it. The node reads a target's processes from the
host's /proc with its own bounded reader (node/runs_from.py, node/process.py).

Shipped with the parts and scripts that import it (their ``SHARED``) and imported on a node as any module_util:
standard library only, Python 3.9+, nothing of ours but the modules of its own ``SHARED``.
"""

import errno
import os
import posixpath
import sys
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import fs as ct_fs
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run

SHARED = (ct_fs, ct_run)  # container-side modules Target.run_probes ships with this module

# Bytes of each file read: a job's environ is a few KB (the kernel allows MBs), a big torch job maps a few thousand
# files (~1 MB of maps). What lies beyond is not read.
LIMITS = {"cmdline": 64 * 1024, "environ": 256 * 1024, "maps": 4 * 1024 * 1024}
STALL = 2.0  # seconds one file may take: a process stuck in the kernel never answers
SCAN_TIMEOUT = 30.0  # seconds a scan may take when its caller gives no deadline
BATCH = 32 * 1024 * 1024  # bytes one reader prints before it ends and the next one goes on (memory, not time)
FILES = 4096  # files one reader is given (its argv stays far below the kernel's limit)
DELETED = " (deleted)"
READS = ("cmdline", "environ", "maps")  # the files of each process scan reads through the reader
ORDER = ("cwd", "exe", "open", "argv", "pythonpath", "module", "mapped")  # cheapest first; how a use is named

# The reader: ``<budget> <limit> <path> <limit> <path>...``; prints ``reader\n``, then per file ``<index> <errno>
# <length>\n`` and that many bytes (the file's, or errno's text), each frame as soon as its file is read, and ends once
# it has printed ``budget`` bytes.
READER = r"""
import os, sys
out = sys.stdout.buffer
out.write(b"reader\n")
out.flush()
budget, args, total = int(sys.argv[1]), sys.argv[2:], 0
flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
for index in range(len(args) // 2):
    limit, path = int(args[2 * index]), args[2 * index + 1]
    try:
        fd = os.open(path, flags)
        try:
            parts, size = [], 0
            while size < limit:
                chunk = os.read(fd, min(limit - size, 65536))
                if not chunk:
                    break
                parts.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
        code, data = 0, b"".join(parts)
    except OSError as error:
        code, data = error.errno or 5, (error.strerror or "error").encode()
    out.write(b"%d %d %d\n" % (index, code, len(data)) + data)
    out.flush()
    total += len(data)
    if total >= budget:
        break
"""
GONE = (errno.ENOENT, errno.ESRCH)  # the process ended while it was read
LATE = "not read: the deadline came first"


def frames(output, batch):
    """``[(errno, bytes)]`` of the files of ``batch`` (``[(path, limit)]``) whose frame ``output`` holds whole, in
    order, and whether the reader started (its first line); a frame that is not what READER prints ends the list."""
    if not output.startswith(b"reader\n"):
        return [], False
    found, at = [], len(b"reader\n")
    while len(found) < len(batch):
        end = output.find(b"\n", at, at + 64)
        fields = output[at:end].split(b" ") if end >= 0 else []
        if len(fields) != 3 or not all(f.isdigit() for f in fields):
            break
        index, code, size = map(int, fields)
        if index != len(found) or size > max(batch[index][1], 4096) or end + 1 + size > len(output):
            break
        found.append((code, output[end + 1 : end + 1 + size]))
        at = end + 1 + size
    return found, True


def _answer(path, code, data):
    """What :func:`read` says of a file its reader printed: read, gone or refused."""
    if code == 0:
        return data, None
    return None, None if code in GONE else f"could not read {path}: {data.decode(errors='replace')}"


def read(paths, deadline, stall=STALL):
    """``{path: (data, error)}`` of /proc files that can block, read by :data:`READER` children (see above), each
    up to its :data:`LIMITS` (64 KiB for another name): ``(bytes, None)`` read; ``(None, None)`` gone (its process
    ended); ``(None, sentence)`` not read: refused, blocked (``stall`` seconds without an answer; then the other
    files of the same directory, the same process, get the same sentence and are not tried), the reader failed, or
    ``deadline`` came first (:data:`LATE`)."""
    found, todo = {}, list(dict.fromkeys(paths))
    python = sys.executable or "python3"
    while todo and time.monotonic() < deadline:
        batch = [(path, LIMITS.get(posixpath.basename(path), 64 * 1024)) for path in todo[:FILES]]
        argv = [python, "-I", "-S", "-c", READER, str(BATCH)] + [str(x) for pair in batch for x in pair[::-1]]
        cap = BATCH + max(LIMITS.values()) + FILES * 128
        done = ct_run.run(argv, deadline - time.monotonic(), text=False, cap=cap, stall=stall)
        got, started = frames(done["stdout"], batch)
        found.update((path, _answer(path, *got[index])) for index, path in enumerate(todo[: len(got)]))
        todo = todo[len(got) :]
        if not todo or (done["rc"] == 0 and got):
            continue  # done, or the reader printed its budget: the next one goes on
        if done.get("stalled") and started:
            stuck = todo[0]
            said = (
                f"no answer within {stall:g} s reading {stuck} (the process is likely stuck in the kernel or the "
                "driver, state D)"
            )
            found.update((p, (None, said)) for p in todo if posixpath.dirname(p) == posixpath.dirname(stuck))
            todo = [p for p in todo if p not in found]
        elif not done.get("timed_out"):  # timed out: the deadline came first, what is left is LATE
            tail = done["stderr"].decode(errors="replace").strip().splitlines()[-1:] or [f"exit {done['rc']}"]
            found.update((p, (None, f"{p} was not read: the reader failed: {tail[0]}")) for p in todo)
            todo = []
    found.update((p, (None, LATE)) for p in todo)
    return found


# -- where a process imports from (PYTHONPATH, -m) ----------------------------------------------------------------
def pythonpath(environ):
    """The value of ``PYTHONPATH`` in an environ block (``NAME=value`` NUL-separated, bytes or text), or None."""
    if isinstance(environ, bytes):
        environ = environ.decode("utf-8", "surrogateescape") if b"PYTHONPATH=" in environ else ""
    for entry in (environ or "").split("\0"):
        if entry.startswith("PYTHONPATH="):
            return entry[len("PYTHONPATH=") :]
    return None


def module_of(argv):
    """The module a Python command line runs with ``-m`` (``python3 -u -m train.main`` -> ``train.main``), or None.
    Options are read as Python reads them: ``-c`` or the first argument that is no option ends them; ``-W`` and
    ``-X`` take a value."""
    args = iter(argv[1:])
    for arg in args:
        if arg == "-" or not arg.startswith("-"):
            return None  # a script, or stdin: no module
        if arg.startswith("--"):
            continue  # --version, -- ...: none takes -m's place
        for index, flag in enumerate(arg[1:], start=1):
            if flag == "c":
                return None
            if flag in "mWX":
                value = arg[index + 1 :] or next(args, "")
                if flag == "m":
                    return value
                break
    return None


def imports_from(argv, environ, cwd):
    """``[(how, directory)]``: where a process imports from that no open file shows: each ``PYTHONPATH`` entry
    (``pythonpath``; a relative one, or an empty one, against its working directory ``cwd``), and with ``-m`` the
    module's top package below its working directory and each of those entries (``module``)."""
    value = pythonpath(environ)
    entries = [posixpath.normpath(posixpath.join(cwd, entry)) for entry in value.split(":")] if value else []
    found = [("pythonpath", entry) for entry in entries]
    module = module_of(argv) or ""
    top = module.split(".")[0]
    if top.isidentifier():
        found += [("module", posixpath.join(base, top)) for base in dict.fromkeys([cwd, *entries])]
    return found


def using(argv, environ, cwd, roots):
    """The first ``(how, directory)`` of :func:`imports_from` that lies in one of ``roots``, or None (the node's
    read of a process, training_code/in_use.py, applies the same rule)."""
    for how, directory in imports_from(argv, environ, cwd):
        if any(ct_fs.inside(directory, root) for root in roots):
            return how, directory
    return None


# -- which processes use a directory -----------------------------------------------------------------------------
def _links(base):
    """``(cwd, exe, [open files])`` of the process at ``base``: links the kernel keeps, read without its mmap lock
    (``readlink``: a hung mount is never asked); None when it runs no program (a kernel thread, a zombie) or is
    gone. OSError when they cannot be read."""
    try:
        exe = os.readlink(f"{base}/exe")
        cwd = os.readlink(f"{base}/cwd")
        fds = os.listdir(f"{base}/fd")
    except (FileNotFoundError, ProcessLookupError):
        return None
    opened = []
    for fd in fds:
        try:
            opened.append(os.readlink(f"{base}/fd/{fd}"))
        except OSError:
            continue  # closed while we looked
    return cwd, exe, opened


def _name(base):
    """The kernel's name of the process at ``base`` (64 bytes at most), or None when it is gone."""
    try:
        with open(f"{base}/comm", "rb") as handle:
            return handle.read(64).decode("utf-8", "replace").strip() or "?"
    except OSError:
        return None


def _uses(roots, cwd, exe, opened, texts):
    """``[[how, root, path]]``: each way a process uses each of ``roots`` (the first path of each), cheapest first
    (ORDER). ``texts``: its cmdline, environ and maps as read (None when not)."""
    cmdline, environ, maps = texts
    argv = (cmdline or b"").decode("utf-8", "surrogateescape").split("\0")
    seen = [("cwd", cwd), ("exe", exe)] + [("open", path) for path in opened]
    seen += [("argv", arg) for arg in argv if arg.startswith("/")]
    if cmdline:  # a process with no command line (a zombie, an exiting one) imports nothing
        seen += imports_from(argv, environ or b"", cwd or "/")
    text = (maps or b"").decode("utf-8", "surrogateescape")
    for line in text.splitlines() if any(root in text for root in roots) else ():  # most maps name no root
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith("/"):
            seen.append(("mapped", fields[5]))
    below = tuple(root.rstrip("/") + "/" for root in roots)
    found = {}
    for how, raw in dict.fromkeys(seen):  # a mapped file has a line per mapping
        path = raw[: -len(DELETED)] if raw and raw.endswith(DELETED) else raw
        if path and (path.startswith(below) or path in roots):  # most paths lie in no root: one test for all
            for root in roots:
                if ct_fs.inside(path, root):
                    found.setdefault((how, root), path)
    return sorted(([how, root, path] for (how, root), path in found.items()), key=lambda u: ORDER.index(u[0]))


def _link_pass(pids, proc, deadline):
    """``({pid: links}, {pid: error}, [pids the deadline left])`` of :func:`_links` for each of ``pids``."""
    links, unreadable = {}, {}
    for index, pid in enumerate(pids):
        if time.monotonic() >= deadline:
            return links, unreadable, pids[index:]
        try:
            found = _links(f"{proc}/{pid}")
        except OSError as error:
            unreadable[pid] = f"could not read {proc}/{pid}: {error.strerror or error}"
            continue
        if found is not None:
            links[pid] = found
    return links, unreadable, []


def scan(roots, deadline=None, proc="/proc", exclude=(), stall=STALL):
    """Which live processes use one of ``roots`` (absolute directories, compared by their path, clean: a caller
    adds a root's real path where a link may lead to it). This process, ``exclude`` and pid 1 never count (the
    target's init, as node/runs_from.py leaves out the node's: it runs no job).

    ``{"users": [{"pid", "name", "uses": [[how, root, path]]}], "unreadable": [{"pid", "name", "error"}], "late":
    [{"pid", "name"}]}``: ``how`` one of ORDER (cheapest first), ``root`` as given; ``unreadable`` the processes that
    could not be told not to use one (refused, or blocked: :func:`read`); ``late`` those the ``deadline``
    (SCAN_TIMEOUT from now when None) left unread. OSError when ``proc`` cannot be listed.
    """
    deadline = time.monotonic() + SCAN_TIMEOUT if deadline is None else deadline
    given = {ct_fs.clean(root): root for root in roots}  # compared clean, answered as given
    skip = {os.getpid(), *exclude}
    pids = sorted(int(name) for name in os.listdir(proc) if name.isdigit() and int(name) > 1 and int(name) not in skip)
    links, unreadable, late = _link_pass(pids, proc, deadline)
    texts = read([f"{proc}/{pid}/{name}" for pid in links for name in READS], deadline, stall)
    users = []
    for pid, (cwd, exe, opened) in links.items():
        got = [texts[f"{proc}/{pid}/{name}"] for name in READS]
        uses = [
            [how, given[root], path]
            for how, root, path in _uses(list(given), cwd, exe, opened, [data for data, _error in got])
        ]
        errors = list(dict.fromkeys(error for _data, error in got if error))
        if uses:
            users.append({"pid": pid, "uses": uses})
        elif errors == [LATE]:
            late.append(pid)
        elif errors:
            unreadable[pid] = "; ".join(e for e in errors if e != LATE)
    answer = {"users": users, "unreadable": [], "late": []}
    answer["unreadable"] = [{"pid": pid, "error": error} for pid, error in sorted(unreadable.items())]
    answer["late"] = [{"pid": pid} for pid in sorted(late)]
    for key, found in answer.items():  # named by the kernel; one that ended while we looked is left out
        answer[key] = [dict({"pid": each["pid"], "name": _name(f"{proc}/{each['pid']}")}, **each) for each in found]
        answer[key] = [each for each in answer[key] if each["name"] is not None]
    return answer


def per_root(scanned, roots):
    """``{root: [{"pid", "name", "how": [hows]}]}``: the users :func:`scan` found of each of ``roots``, each with
    every way it uses that root (the compile cache's answer)."""
    found = {root: [] for root in roots}
    for user in scanned["users"]:
        for root in roots:
            hows = [how for how, used, _path in user["uses"] if used == root]
            if hows:
                found[root].append({"pid": user["pid"], "name": user["name"], "how": sorted(hows)})
    return found
