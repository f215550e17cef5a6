# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Compile cache purge, stamp and warm-up, in the target, in one process. It ACTS.

Unlike a probe part, ``probe(payload)`` here changes the target. It is called the same way so that it costs one
``pct exec``: ``Target.run_probes`` ships this file's source to the target's python on stdin; on a bare host
``probe()`` runs in the module's own process. So: standard library only, Python 3.9+, nothing of ours but the
container-side modules of ``SHARED`` (the module sends its decisions as data), the answer is plain JSON.

Safety does not rest on the module's reading alone: every root is checked again here, just before it is touched, by
the same rules (:func:`ct_fs.refusal`, :func:`ct_fs.open_root`) and must be the very directory the module
judged (its ``[st_dev, st_ino]``), and no root is purged while a live process uses it (the probe part's rule,
ct_proc.scan). A root is opened once, from ``/``, one component at a time with O_NOFOLLOW, refused when a
component is a symlink or could have been put there by a user other than root and the cache user; everything after
(purge, stamp, sizes) works through that fd and the directory fds below it, never by path again. A purge never
follows a symlink (a link is removed itself, never its target), never enters another mount (compared by mount id, so
a bind mount of the same filesystem too) nor a directory its parent's non-root owner could have moved in, and never
leaves the root. Before it deletes anything it replaces the stamp with a "purging" marker, so a purge that is cut
short is never taken for a fresh or adoptable cache: the next run purges again.

Order: check every root, check no process uses a root to purge, purge, stamp, warm up (once, alone, with a
deadline, ``TORCHINDUCTOR_COMPILE_THREADS=1``), stamp the roots the warm-up created. A root to purge that a live
process uses fails the whole act (``busy``, nothing purged), unless the payload says ``unattended``: then that
root is left as it is (neither purged nor stamped), named in the answer's ``needs_window``, no warm-up runs, and
the other roots are purged and stamped. Any failure answers
``{"error": kind, "message", "cmd", "rc", "stdout_tail", "stderr_tail", "done"}`` with what was already done.
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# Runs in the target from its source (standard library only), where no AnsibleModule.run_command exists.
# pylint: disable=disallowed-name,ansible-bad-function

import contextlib
import json
import os
import stat
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import act as ct_act
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import fs as ct_fs
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import proc as ct_proc
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import progress as ct_progress
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run

SHARED = (ct_act, ct_fs, ct_proc, ct_progress, ct_run)  # container-side modules Target.run_probes ships with this part
TAIL_LINES = 20


def last_line(text):
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


# -- reading ---------------------------------------------------------------------------------------------------
def size_of(fd, path, stamp_name):
    """Bytes in regular files under the directory open as ``fd`` (named ``path``; the stamp left out), entering
    only what a purge would enter (:func:`ct_fs.open_inside`)."""
    return _size(ct_fs.open_dir(fd, path), stamp_name)


def _size(here, skip):
    total = 0
    try:
        for name in os.listdir(here.fd):
            if name == skip:
                continue
            try:
                entry = os.stat(name, dir_fd=here.fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(entry.st_mode):
                child, _ = ct_fs.open_inside(here, name)
                total += _size(child, None) if child is not None else 0
            elif stat.S_ISREG(entry.st_mode):
                total += entry.st_size
    finally:
        os.close(here.fd)
    return total


def has_content(fd, stamp_name):
    return any(name != stamp_name for name in os.listdir(fd))


def users_of(reals, own_pid):
    """``{real: [{"pid", "name", "how"}]}``: live processes that use a root, by the probe part's rule
    (ct_proc.scan; one that cannot be read is not named here: the module's read already counted it)."""
    if not reals:
        return {}
    return ct_proc.per_root(ct_proc.scan(reals, exclude=(own_pid,)), reals)


# -- writing ---------------------------------------------------------------------------------------------------
def write_stamp(directory, name, content):
    """Write ``content`` (JSON) as the stamp in the directory open as ``directory``, atomically, owned like the
    directory; never through a symlink (a temporary file made with O_EXCL|O_NOFOLLOW, renamed over the stamp)."""
    owner = os.fstat(directory)
    temporary = f".{name}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary, dir_fd=directory)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(temporary, flags, 0o644, dir_fd=directory)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(content, handle, sort_keys=True)
        handle.write("\n")
        handle.flush()
        if os.geteuid() == 0:
            os.fchown(handle.fileno(), owner.st_uid, owner.st_gid)
        os.fsync(handle.fileno())
    os.rename(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)


class Purge:
    """Empties the root open as ``fd`` (named ``path``) through directory fds (:func:`ct_fs.open_inside`): never
    through a symlink, never into another mount (a bind mount of the same filesystem too), never into a directory
    its parent's non-root owner could have moved in, never outside the root. ``report`` counts what went and names
    what was left."""

    def __init__(self, fd, path, stamp_name):
        self.fd = fd
        self.path = path
        self.stamp_name = stamp_name
        self.report = {"files": 0, "bytes": 0, "links": 0, "links_out": [], "mounts_left": [], "left": []}

    def run(self):
        """Empty the root (the stamp excepted, which first becomes a "purging" marker)."""
        top = ct_fs.open_dir(self.fd, self.path)
        try:
            if ct_fs.kind_at(top.fd, self.stamp_name) == "dir":  # a directory where the stamp belongs is not ours
                self.remove(top, self.stamp_name)
            write_stamp(top.fd, self.stamp_name, {"state": "purging", "fingerprint": None})
            self.empty(top, skip=self.stamp_name)
        finally:
            os.close(top.fd)
        return self.report

    def empty(self, here, skip=None):
        """Remove everything in the :class:`ct_fs.Dir` ``here``; True when it is empty."""
        emptied = True
        for name in os.listdir(here.fd):
            if name != skip:
                emptied = self.remove(here, name) and emptied
        return emptied

    def remove(self, here, name):
        """Remove the entry ``name`` of ``here``: a directory emptied first, when :func:`ct_fs.open_inside`
        lets it in."""
        full = os.path.join(here.path, name)
        kind = ct_fs.kind_at(here.fd, name)
        if kind == "dir":
            child, why = ct_fs.open_inside(here, name)
            if why == "mount":
                self.report["mounts_left"].append(full)
                return False
            if why in ct_fs.LEFT:
                self.report["left"].append({"path": full, "why": ct_fs.LEFT[why]})
                return False
            if child is not None:
                try:
                    empty = self.empty(child)
                finally:
                    os.close(child.fd)
                if empty:
                    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                        os.rmdir(name, dir_fd=here.fd)  # only ever an empty directory
                return empty
            kind = ct_fs.kind_at(here.fd, name)  # no directory any more: a link or a file took its place
        if kind is None:
            return True
        entry = os.stat(name, dir_fd=here.fd, follow_symlinks=False)
        if stat.S_ISLNK(entry.st_mode):
            target = os.readlink(name, dir_fd=here.fd)
            self.report["links"] += 1
            if not ct_fs.inside(ct_fs.clean(os.path.join(here.path, target)), self.path):
                self.report["links_out"].append({"link": full, "target": target})
        elif stat.S_ISREG(entry.st_mode):
            self.report["bytes"] += entry.st_size
        try:
            os.unlink(name, dir_fd=here.fd)  # a symlink goes itself; its target is never touched
        except FileNotFoundError:
            return True
        except IsADirectoryError:
            return False  # a directory took its place just now: left for the next run
        self.report["files"] += 1
        return True


def stamp_content(fingerprint):
    return {
        "fingerprint": fingerprint,
        "stamped_by": "pve-gpu-recover",
        "stamped_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# -- the warm-up -----------------------------------------------------------------------------------------------
def run_warmup(warmup, deadline):
    """Run the warm-up argv once, in a session of its own, as the user; ``(rc, stdout, stderr, seconds)``.

    While it runs, its latest output line is told as progress (ct_progress): a cold compile takes minutes. Past its
    deadline it is killed with what it started (the one runner, ct_run.run).
    """
    argv = [str(a) for a in warmup["argv"]]
    seconds = max(1.0, min(float(warmup["timeout"]), deadline - time.monotonic()))
    user = None
    uid, gid = warmup.get("uid"), warmup.get("gid")
    if uid is not None and uid != os.geteuid():
        if os.geteuid() != 0:
            raise ct_act.ActError(
                "warmup_user",
                f"the warm-up must run as {warmup['user']} (uid {uid}), but this runs as uid {os.geteuid()}",
                cmd=argv,
            )
        user = (uid, gid, os.getgrouplist(warmup["user"], gid))
    started = time.monotonic()
    cwd = warmup["cwd"] if os.path.isdir(warmup["cwd"]) else "/"
    follow = ct_progress.follow_output(f"warming up the compile cache with `{' '.join(argv)}`")
    done = ct_run.run(argv, seconds, warmup["env"], user=user, cwd=cwd, on_output=follow)
    if done.get("missing"):
        why = done["stderr"].partition("cannot run it: ")[2] or "No such file or directory"
        raise ct_act.ActError("warmup_not_found", f"cannot run the warm-up `{argv[0]}`: {why}", cmd=argv)
    if done.get("timed_out"):
        raise ct_act.ActError(
            "warmup_timeout",
            f"the warm-up `{' '.join(argv)}` did not finish within {seconds:g} s (warmup_timeout) and was killed",
            cmd=argv,
            stdout=done["stdout"],
            stderr=done["stderr"],
        )
    return done["rc"], done["stdout"], done["stderr"], time.monotonic() - started


class Act:
    def __init__(self, payload):
        self.roots = [dict(r) for r in payload["roots"]]
        self.fingerprint = payload["fingerprint"]
        self.stamp_name = payload["stamp_name"]
        self.homes = {ct_fs.clean(h): list(u) for h, u in payload["homes"].items()}
        self.uid = int(payload["uid"])  # the cache user's: who may own what lies in a directory they can write
        self.warmup = payload.get("warmup")
        ct_progress.start(payload.get("progress"))  # the module has somewhere to send it (an async job)
        self.unattended = bool(payload.get("unattended"))
        self.window = []  # unattended: roots to purge left as they are, in use by a live process
        self.deadline = time.monotonic() + float(payload["timeout"])
        self.fds = {}  # root index -> its fd, opened once by open_checked and never re-opened by path
        for root in self.roots:
            root.update(size_before=None, size_after=None, purged=None, stamped=False)
        self.warmed = None

    def done(self):
        return {"roots": self.roots, "warmup": self.warmed}

    def close(self):
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    def open_checked(self, index):
        """The fd of root ``index`` after the rules (:func:`ct_fs.refusal`, :func:`ct_fs.open_root`), the very
        directory the module judged (its ``id``); None when it does not exist; an ct_act.ActError when it may not be
        touched."""
        if index in self.fds:
            return self.fds[index]
        root = self.roots[index]
        why = ct_fs.refusal(root["path"], self.homes)
        if why:
            raise ct_act.ActError("refused", f"compile cache root {root['path']} refused: {why}; nothing was deleted")
        try:
            fd = ct_fs.open_root(ct_fs.clean(root["path"]), self.uid)
        except ct_fs.Unsafe as error:
            raise ct_act.ActError(
                "unsafe", f"compile cache root {root['path']} refused: {error}; nothing was deleted"
            ) from None
        if fd is None:
            return None
        info = os.fstat(fd)
        if root.get("id") is not None and [info.st_dev, info.st_ino] != list(root["id"]):
            os.close(fd)
            raise ct_act.ActError("changed", f"{root['path']} is another directory than the one read; run again")
        self.fds[index] = fd
        return fd

    def size(self, index):
        """Bytes in root ``index``; 0 when it does not exist, None when it cannot be opened."""
        try:
            fd = self.open_checked(index)
        except ct_act.ActError:
            return None
        return size_of(fd, ct_fs.clean(self.roots[index]["path"]), self.stamp_name) if fd is not None else 0

    def execute(self):
        started = time.monotonic()
        acting = [i for i, r in enumerate(self.roots) if r["action"]]
        for index in acting:
            if self.open_checked(index) is None:
                raise ct_act.ActError("changed", f"{self.roots[index]['path']} is no longer a directory; run again")
        reals = {i: ct_fs.clean(self.roots[i]["path"]) for i in acting}  # no link on the way: the path is the real one
        purging = [i for i in acting if self.roots[i]["action"] == "purge"]
        users = users_of(sorted({reals[i] for i in purging}), os.getpid())
        busy = [(self.roots[i], users[reals[i]]) for i in purging if users[reals[i]]]
        if busy and self.unattended:
            for root, found in busy:
                root["action"] = None  # left for a window: neither purged nor stamped
                self.window.append({"path": root["path"], "real_path": ct_fs.clean(root["path"]), "users": found})
            self.warmup = None  # no compile while a live process uses the caches it would fill
            busy = []
        if busy:
            named = "; ".join(
                f"{r['path']} by " + ", ".join(f"pid {u['pid']} ({u['name']}: {', '.join(u['how'])})" for u in found)
                for r, found in busy
            )
            raise ct_act.ActError("busy", f"nothing was purged: a live process uses a cache to purge: {named}")
        for index, root in enumerate(self.roots):
            root["size_before"] = self.size(index)
            if root["action"] == "purge":
                ct_progress.phase(f"purging the stale cache {root['path']}")
                root["purged"] = Purge(self.fds[index], ct_fs.clean(root["path"]), self.stamp_name).run()
            if root["action"] in ("purge", "stamp"):
                write_stamp(self.fds[index], self.stamp_name, stamp_content(self.fingerprint))
                root["stamped"] = True
        if self.warmup:
            self.warm()
        for index, root in enumerate(self.roots):
            root["size_after"] = self.size(index)
        return {
            "roots": self.roots,
            "warmup": self.warmed,
            "fingerprint": self.fingerprint,
            "needs_window": self.window,
            "seconds": round(time.monotonic() - started, 3),
        }

    def warm(self):
        before = sum(self.size(i) or 0 for i in range(len(self.roots)))
        rc, out, err, seconds = run_warmup(self.warmup, self.deadline)
        after = sum(self.size(i) or 0 for i in range(len(self.roots)))
        self.warmed = {
            "argv": self.warmup["argv"],
            "rc": rc,
            "seconds": round(seconds, 3),
            "size_before": before,
            "size_after": after,
            "filled": after > before,
            "stdout_tail": ct_act.tail(out, TAIL_LINES),
            "stderr_tail": ct_act.tail(err, TAIL_LINES),
        }
        if rc != 0:
            raise ct_act.ActError(
                "warmup_failed",
                f"the warm-up `{' '.join(map(str, self.warmup['argv']))}` failed with exit code {rc}: "
                f"{last_line(err or out)}",
                cmd=self.warmup["argv"],
                rc=rc,
                stdout=out,
                stderr=err,
            )
        filled = False
        for index, root in enumerate(self.roots):  # the roots the warm-up created get the stamp too
            fd = self.open_checked(index)  # created by the user: opened by the same rules before root writes
            if fd is None:
                continue
            root["real_path"] = root["real_path"] or ct_fs.clean(root["path"])
            if not root["stamped"] and ct_fs.kind_at(fd, self.stamp_name) is None:
                write_stamp(fd, self.stamp_name, stamp_content(self.fingerprint))
                root["stamped"] = True
            filled = filled or has_content(fd, self.stamp_name)
        if not filled:
            raise ct_act.ActError(
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

    ``payload``: ``{"roots": [{"path", "real_path", "id" ([st_dev, st_ino] as read, or None), "action":
    "purge"|"stamp"|None}], "fingerprint", "stamp_name", "homes" ({home: [users]}), "uid" (the cache user's),
    "warmup" ({"argv", "env", "timeout", "cwd", "user", "uid", "gid"} or None), "timeout", "unattended"
    (optional: a root in use is left, not a failure)}``.

    Success: ``{"roots": [{"path", "real_path", "action", "size_before", "size_after", "purged" ({"files",
    "bytes", "links", "links_out", "mounts_left", "left" ([{"path", "why"}])} or None), "stamped"}], "warmup"
    ({"argv", "rc", "seconds", "size_before", "size_after", "filled", "stdout_tail", "stderr_tail"} or None),
    "fingerprint", "needs_window"
    ([{"path", "real_path", "users": [{"pid", "name", "how"}]}], unattended only), "seconds"}``.
    Failure: ``{"error", "message", "cmd", "rc", "stdout_tail", "stderr_tail", "done"}``.
    """
    ct_run.end_with_me()  # the warm-up runs in a session of its own: the timeout around the pct exec ends it too
    try:
        act = Act(payload)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        return {"error": "invalid", "message": f"the compile cache payload is incomplete: {error}", "done": None}
    try:
        return act.execute()
    except (ct_act.ActError, OSError) as error:
        failure = ct_act.failure(error, TAIL_LINES)
    finally:
        act.close()
    failure["done"] = act.done()
    return failure
