# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Compile cache purge, stamp and warm-up, in the target, in one process. It ACTS.

Unlike a probe part, ``probe(payload)`` here changes the target. It is called the same way so that it costs one
``pct exec``: ``Target.run_probes`` ships this file's source to the target's python on stdin; on a bare host
``probe()`` runs in the module's own process. So: standard library only, Python 3.9+, imports nothing of ours
(the module sends its decisions as data), the answer is plain JSON.

Safety does not rest on the module's reading alone: every root is checked again here, just before it is
touched, by the same rules (:func:`refusal`; the directory it resolves to must be the one the module judged), and
no root is purged while a live process uses it (its cwd, an open file or a mapped file in it). A purge opens the
root with O_NOFOLLOW and works through directory file descriptors: it never follows a symlink (a link is removed
itself, never its target), never enters another filesystem, and never leaves the root. Before it deletes
anything it replaces the stamp with a "purging" marker, so a purge that is cut short is never taken for a
fresh or adoptable cache: the next run purges again.

Order: check every root, check no process uses a root to purge, purge, stamp, warm up (once, alone, with a
deadline, ``TORCHINDUCTOR_COMPILE_THREADS=1``), stamp the roots the warm-up created. A root to purge that a live
process uses fails the whole act (``busy``, nothing purged), unless the payload says ``unattended``: then that
root is left as it is (neither purged nor stamped), named in the answer's ``needs_window``, no warm-up runs, and
the other roots are purged and stamped. Any failure answers
``{"error": kind, "message", "cmd", "rc", "stdout_tail", "stderr_tail", "done"}`` with what was already done.
"""

import contextlib
import errno
import json
import os
import signal
import stat
import subprocess
import time

PROTECTED = ("/", "/usr", "/etc", "/var", "/opt", "/srv")
SYSTEM_TREES = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/proc",
    "/sbin",
    "/sys",
    "/usr",
)
TAIL_LINES = 20
TAIL_CHARS = 4000
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


class ActError(Exception):
    """One failure: ``kind`` for code, the message for people, the command when one ran."""

    def __init__(self, kind, message, *, cmd=None, rc=None, stdout="", stderr=""):
        super().__init__(message)
        self.kind = kind
        self.cmd = cmd
        self.rc = rc
        self.stdout = stdout
        self.stderr = stderr


# -- the rules (the same as module_utils/pve_cache.py; a unit test keeps them equal) ---------------------------
def clean(path):
    path = os.path.normpath(path)
    return "/" + path.lstrip("/") if path.startswith("//") else path


def inside(path, directory):
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def refusal(path, homes):
    """Why ``path`` may never be a cache root that is purged, or None (see pve_cache.refusal)."""
    if not isinstance(path, str) or not path.startswith("/"):
        return "it is not an absolute path"
    if ".." in path.split("/"):
        return "it contains '..'"
    path = clean(path)
    if path == "/":
        return "it is the filesystem root /"
    if path in PROTECTED:
        return f"it is the system directory {path}"
    for home, users in sorted(homes.items()):
        if path == home:
            return f"it is the home directory of {', '.join(users)}"
    for home, users in sorted(homes.items()):
        if home != path and inside(home, path):
            return f"it contains the home directory {home} of {', '.join(users)}"
    if len([part for part in path.split("/") if part]) < 2:
        return "it has fewer than 2 path components (a cache is a directory of its own, like /tmp/torchinductor_root)"
    for tree in SYSTEM_TREES:
        if inside(path, tree):
            return f"it lies inside the system tree {tree}"
    return None


def tail(text):
    lines = (text or "").rstrip("\n").splitlines()[-TAIL_LINES:]
    return "\n".join(lines)[-TAIL_CHARS:]


def last_line(text):
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


# -- reading ---------------------------------------------------------------------------------------------------
def size_of(real, stamp_name):
    """Bytes in regular files under ``real`` (lstat walk, one filesystem, the stamp left out); 0 when it is not a
    directory."""
    try:
        device = os.lstat(real).st_dev
    except OSError:
        return 0
    total, pending = 0, [real]
    while pending:
        directory = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            if directory == real and entry.name == stamp_name:
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode) and info.st_dev == device:
                pending.append(entry.path)
            elif stat.S_ISREG(info.st_mode):
                total += info.st_size
    return total


def has_content(real, stamp_name):
    try:
        return any(name != stamp_name for name in os.listdir(real))
    except OSError:
        return False


def users_of(reals, own_pid):
    """``{real: [{"pid", "name", "how"}]}``: live processes whose cwd, open files or mapped files lie in a root."""
    found = {real: [] for real in reals}
    if not reals:
        return found
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == own_pid:
            continue
        try:
            used = _uses(int(name), reals)
        except OSError:
            continue  # gone, or not ours to read (the module's read already counted those)
        if used:
            try:
                with open(f"/proc/{name}/comm", encoding="utf-8", errors="replace") as handle:
                    comm = handle.read().strip()
            except OSError:
                comm = "?"
            for real, how in used.items():
                found[real].append({"pid": int(name), "name": comm, "how": sorted(how)})
    return found


def _uses(pid, reals):
    base = f"/proc/{pid}"
    used = {}

    def note(path, how):
        path = path[: -len(" (deleted)")] if path.endswith(" (deleted)") else path
        for real in reals:
            if inside(path, real):
                used.setdefault(real, set()).add(how)

    note(os.readlink(f"{base}/cwd"), "cwd")
    for fd in os.listdir(f"{base}/fd"):
        try:
            note(os.readlink(f"{base}/fd/{fd}"), "open")
        except FileNotFoundError:
            continue
    with open(f"{base}/maps", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/"):
                note(fields[5].rstrip("\n"), "mapped")
    return used


# -- writing ---------------------------------------------------------------------------------------------------
def write_stamp(real, name, content):
    """Write ``content`` (JSON) as the stamp in ``real``, atomically, owned like the directory; never through a
    symlink (the directory is opened with O_NOFOLLOW, the temporary file with O_EXCL)."""
    directory = os.open(real, DIRECTORY)
    try:
        owner = os.fstat(directory)
        temporary = f".{name}.{os.getpid()}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary, dir_fd=directory)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=directory)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(content, handle, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        if os.geteuid() == 0:
            os.chown(temporary, owner.st_uid, owner.st_gid, dir_fd=directory, follow_symlinks=False)
        os.rename(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
    finally:
        os.close(directory)


class Purge:
    """Empties one root through directory file descriptors: never through a symlink, never onto another
    filesystem, never outside the root. ``report`` counts what went."""

    def __init__(self, real, stamp_name):
        self.real = real
        self.stamp_name = stamp_name
        self.device = None
        self.report = {"files": 0, "bytes": 0, "links": 0, "links_out": [], "mounts_left": []}

    def run(self):
        """Empty the root (the stamp excepted, which first becomes a "purging" marker)."""
        directory = os.open(self.real, DIRECTORY)
        try:
            self.device = os.fstat(directory).st_dev
            self.clear_odd_stamp(directory)
        finally:
            os.close(directory)
        write_stamp(self.real, self.stamp_name, {"state": "purging", "fingerprint": None})
        directory = os.open(self.real, DIRECTORY)
        try:
            self.empty(directory, self.real, skip=self.stamp_name)
        finally:
            os.close(directory)
        return self.report

    def clear_odd_stamp(self, directory):
        """A directory where the stamp belongs is not a stamp of ours: it goes like any content."""
        try:
            info = os.stat(self.stamp_name, dir_fd=directory, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(info.st_mode):
            self.remove_directory(directory, self.stamp_name, os.path.join(self.real, self.stamp_name), info)

    def empty(self, directory, path, skip=None):
        """Remove everything in the directory open as ``directory`` (``path`` names it); True when it is empty."""
        emptied = True
        with os.scandir(directory) as entries:
            names = [entry.name for entry in entries]
        for name in names:
            if name == skip:
                continue
            try:
                info = os.stat(name, dir_fd=directory, follow_symlinks=False)
            except FileNotFoundError:
                continue
            full = os.path.join(path, name)
            if stat.S_ISDIR(info.st_mode):
                emptied = self.remove_directory(directory, name, full, info) and emptied
                continue
            if stat.S_ISLNK(info.st_mode):
                target = os.readlink(name, dir_fd=directory)
                self.report["links"] += 1
                if not inside(clean(os.path.join(path, target)), self.real):
                    self.report["links_out"].append({"link": full, "target": target})
            elif stat.S_ISREG(info.st_mode):
                self.report["bytes"] += info.st_size
            os.unlink(name, dir_fd=directory)  # a symlink goes itself; its target is never touched
            self.report["files"] += 1
        return emptied

    def remove_directory(self, directory, name, full, info):
        """Empty and remove a subdirectory; one on another filesystem is left alone (named in the report)."""
        if info.st_dev != self.device:
            self.report["mounts_left"].append(full)  # another filesystem mounted inside: never entered
            return False
        child = os.open(name, DIRECTORY, dir_fd=directory)
        try:
            empty = self.empty(child, full)
        finally:
            os.close(child)
        if empty:
            os.rmdir(name, dir_fd=directory)
        return empty


def stamp_content(fingerprint):
    return {
        "fingerprint": fingerprint,
        "stamped_by": "pve-gpu-recover",
        "stamped_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# -- the warm-up -----------------------------------------------------------------------------------------------
def run_warmup(warmup, deadline):
    """Run the warm-up argv once, in a session of its own, as the user; ``(rc, stdout, stderr, seconds)``."""
    argv = [str(a) for a in warmup["argv"]]
    seconds = max(1.0, min(float(warmup["timeout"]), deadline - time.monotonic()))
    extra = {}
    uid, gid = warmup.get("uid"), warmup.get("gid")
    if uid is not None and uid != os.geteuid():
        if os.geteuid() != 0:
            raise ActError(
                "warmup_user",
                f"the warm-up must run as {warmup['user']} (uid {uid}), but this runs as uid {os.geteuid()}",
                cmd=argv,
            )
        extra = {"user": uid, "group": gid, "extra_groups": os.getgrouplist(warmup["user"], gid)}
    started = time.monotonic()
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=warmup["env"],
            cwd=warmup["cwd"] if os.path.isdir(warmup["cwd"]) else "/",
            start_new_session=True,  # its whole process group is killed at the deadline
            **extra,
        )
    except OSError as error:
        raise ActError("warmup_not_found", f"cannot run the warm-up `{argv[0]}`: {error.strerror}", cmd=argv) from None
    try:
        out, err = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)
        try:
            out, err = process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            out, err = b"", b""
        raise ActError(
            "warmup_timeout",
            f"the warm-up `{' '.join(argv)}` did not finish within {seconds:g} s (warmup_timeout) and was killed",
            cmd=argv,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
        ) from None
    return process.returncode, out.decode(errors="replace"), err.decode(errors="replace"), time.monotonic() - started


class Act:
    def __init__(self, payload):
        self.roots = [dict(r) for r in payload["roots"]]
        self.fingerprint = payload["fingerprint"]
        self.stamp_name = payload["stamp_name"]
        self.homes = {clean(h): list(u) for h, u in payload["homes"].items()}
        self.warmup = payload.get("warmup")
        self.unattended = bool(payload.get("unattended"))
        self.window = []  # unattended: roots to purge left as they are, in use by a live process
        self.deadline = time.monotonic() + float(payload["timeout"])
        for root in self.roots:
            root.update(size_before=None, size_after=None, purged=None, stamped=False)
        self.warmed = None

    def done(self):
        return {"roots": self.roots, "warmup": self.warmed}

    def checked_real(self, root):
        """The directory ``root`` resolves to now, after the rules; an ActError when it may not be touched."""
        why = refusal(root["path"], self.homes)
        real = os.path.realpath(root["path"])
        if why is None and real != root["path"]:
            why = refusal(real, self.homes)
            why = f"it resolves through a symlink to {real}, and {why.removeprefix('it ')}" if why else None
        if why:
            raise ActError("refused", f"compile cache root {root['path']} refused: {why}; nothing was deleted")
        if root["real_path"] and real != root["real_path"]:
            raise ActError(
                "changed",
                f"{root['path']} resolved to {root['real_path']} when it was read, and to {real} now; run again",
            )
        return real

    def execute(self):
        started = time.monotonic()
        acting = [r for r in self.roots if r["action"]]
        reals = {id(r): self.checked_real(r) for r in acting}
        for root in acting:
            if not os.path.isdir(reals[id(root)]) or os.path.islink(reals[id(root)]):
                raise ActError("changed", f"{root['path']} is no longer a directory; run again")
        purging = [r for r in acting if r["action"] == "purge"]
        users = users_of(sorted({reals[id(r)] for r in purging}), os.getpid())
        busy = [(r, users[reals[id(r)]]) for r in purging if users[reals[id(r)]]]
        if busy and self.unattended:
            for root, found in busy:
                root["action"] = None  # left for a window: neither purged nor stamped
                self.window.append({"path": root["path"], "real_path": reals[id(root)], "users": found})
            self.warmup = None  # no compile while a live process uses the caches it would fill
            busy = []
        if busy:
            named = "; ".join(
                f"{r['path']} by " + ", ".join(f"pid {u['pid']} ({u['name']}: {', '.join(u['how'])})" for u in found)
                for r, found in busy
            )
            raise ActError("busy", f"nothing was purged: a live process uses a cache to purge: {named}")
        for root in self.roots:
            real = reals.get(id(root))
            root["size_before"] = size_of(real or root["real_path"] or root["path"], self.stamp_name)
            if root["action"] == "purge":
                root["purged"] = Purge(real, self.stamp_name).run()
            if root["action"] in ("purge", "stamp"):
                write_stamp(real, self.stamp_name, stamp_content(self.fingerprint))
                root["stamped"] = True
        if self.warmup:
            self.warm()
        for root in self.roots:
            root["size_after"] = size_of(os.path.realpath(root["path"]), self.stamp_name)
        return {
            "roots": self.roots,
            "warmup": self.warmed,
            "fingerprint": self.fingerprint,
            "needs_window": self.window,
            "seconds": round(time.monotonic() - started, 3),
        }

    def warm(self):
        paths = [os.path.realpath(r["path"]) for r in self.roots]
        before = sum(size_of(p, self.stamp_name) for p in paths)
        rc, out, err, seconds = run_warmup(self.warmup, self.deadline)
        after = sum(size_of(p, self.stamp_name) for p in paths)
        self.warmed = {
            "argv": self.warmup["argv"],
            "rc": rc,
            "seconds": round(seconds, 3),
            "size_before": before,
            "size_after": after,
            "filled": after > before,
            "stdout_tail": tail(out),
            "stderr_tail": tail(err),
        }
        if rc != 0:
            raise ActError(
                "warmup_failed",
                f"the warm-up `{' '.join(map(str, self.warmup['argv']))}` failed with exit code {rc}: "
                f"{last_line(err or out)}",
                cmd=self.warmup["argv"],
                rc=rc,
                stdout=out,
                stderr=err,
            )
        for root in self.roots:  # the roots the warm-up created get the stamp too
            if root["stamped"] or not os.path.isdir(root["path"]):
                continue
            root["real_path"] = root["real_path"] or os.path.realpath(root["path"])
            real = self.checked_real(root)
            if not os.path.exists(os.path.join(real, self.stamp_name)):
                write_stamp(real, self.stamp_name, stamp_content(self.fingerprint))
                root["stamped"] = True
        if not any(os.path.isdir(p) and has_content(p, self.stamp_name) for p in paths):
            raise ActError(
                "warmup_empty",
                f"the warm-up `{' '.join(map(str, self.warmup['argv']))}` succeeded but left every cache root "
                "empty: does it compile, and does it use TORCHINDUCTOR_CACHE_DIR (the first root)?",
                cmd=self.warmup["argv"],
                rc=rc,
                stdout=out,
                stderr=err,
            )


def probe(payload):
    """ACTS: purge, stamp and warm up as ``payload`` says; answer what was done.

    ``payload``: ``{"roots": [{"path", "real_path", "action": "purge"|"stamp"|None}], "fingerprint", "stamp_name",
    "homes" ({home: [users]}), "warmup" ({"argv", "env", "timeout", "cwd", "user", "uid", "gid"} or None),
    "timeout", "unattended" (optional: a root in use is left, not a failure)}``.

    Success: ``{"roots": [{"path", "real_path", "action", "size_before", "size_after", "purged" ({"files",
    "bytes", "links", "links_out", "mounts_left"} or None), "stamped"}], "warmup" ({"argv", "rc", "seconds",
    "size_before", "size_after", "filled", "stdout_tail", "stderr_tail"} or None), "fingerprint", "needs_window"
    ([{"path", "real_path", "users": [{"pid", "name", "how"}]}], unattended only), "seconds"}``.
    Failure: ``{"error", "message", "cmd", "rc", "stdout_tail", "stderr_tail", "done"}``.
    """
    try:
        act = Act(payload)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        return {"error": "invalid", "message": f"the compile cache payload is incomplete: {error}", "done": None}
    try:
        return act.execute()
    except ActError as error:
        failure = {"error": error.kind, "message": str(error), "cmd": error.cmd, "rc": error.rc}
        failure.update(stdout_tail=tail(error.stdout), stderr_tail=tail(error.stderr))
    except OSError as error:
        kind = "no_space" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "os_error"
        where = f" ({error.filename})" if error.filename else ""
        failure = {"error": kind, "message": f"{error.strerror or error}{where}", "cmd": None, "rc": None}
        failure.update(stdout_tail="", stderr_tail="")
    failure["done"] = act.done()
    return failure
