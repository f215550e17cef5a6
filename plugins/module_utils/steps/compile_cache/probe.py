# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Compile cache probe: what the cache roots hold, what they are stamped for, and what the venv's torch is.

In a CT this file's source is fed to the CT's python3 on stdin by ``Target.run_probes`` (one ``pct exec``);
on a bare host ``probe()`` runs in the module's own process. So: standard library only, Python 3.9+, nothing
of ours but the container-side modules of ``SHARED`` (shipped with it), and the answer is plain JSON.

It only reads, and never follows a symlink: each root is opened from ``/`` one component at a time
(:func:`ct_fs.open_root`: a link, or a component someone other than root and the cache user could have put
there, makes it ``unsafe``) and walked through directory fds by ``lstat`` (a link is counted and, when it leads
out of the root, named; another mount and a directory its parent's non-root owner does not own are named and not
entered), so it sees what the acting script would delete.
It reads the venv's ``torch/version.py`` as text and triton's dist-info METADATA header, never ``import torch``.
The homes of the target's users, every live process that uses a root (ct_proc.scan: its cwd, executable, an open
or mapped file, a path in its command line, a ``PYTHONPATH`` entry or ``-m`` package in it; its /proc files read
under a deadline, so one stuck in the driver is named, never waited for) and, when asked, the GPU names from
``nvidia-smi`` complete the answer. The module decides what is wrong.
"""
# Runs in the target from its source (standard library only), where no AnsibleModule.run_command exists.
# pylint: disable=ansible-bad-function

import contextlib
import errno
import json
import os
import pwd
import stat
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import fs as ct_fs
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import proc as ct_proc
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import venv as ct_venv

SHARED = (ct_fs, ct_proc, ct_run, ct_venv)  # container-side modules Target.run_probes ships with this part
# torch/version.py assigns plain literals (`cuda: Optional[str] = '12.8'`); an annotation may sit before `=`.
TORCH_VERSION_KEYS = {"__version__": "version", "cuda": "cuda", "git_version": "git_version", "hip": "hip"}
# Distributions that provide the `triton` package torch compiles with, in the order they are preferred.
TRITON_NAMES = ("triton", "pytorch-triton")
STAMP_LIMIT = 65536  # a stamp is a small JSON object; anything larger is not ours
SHOWN = 20  # links out of a root and mount points named per root (the count says how many in all)


def parse_torch_version_py(text):
    """``__version__ = '2.11.0+cu128'\\ncuda: Optional[str] = '12.8'`` -> ``{"version": "2.11.0+cu128",
    "cuda": "12.8", "git_version": None, "hip": None}`` (the same reading as the training venv's probe)."""
    return ct_venv.read_version_py(text, TORCH_VERSION_KEYS)


def _site_packages(path):
    """The venv's site-packages directory (ct_venv.site_packages: the one of pyvenv.cfg's python minor, or the
    only lib/pythonX.Y's when it names none), or None."""
    config = ct_venv.read_config(ct_venv.read_small_text(os.path.join(path, "pyvenv.cfg")) or "")
    return ct_venv.site_packages(path, ct_venv.config_minor(config))[0]


def read_venv(path):
    """``{"path", "exists", "site_packages", "torch_version_py" (or None), "triton" ({"name", "version"} or
    None)}``: torch's build from torch/version.py, triton's version from its dist-info METADATA."""
    answer = {"path": path, "exists": os.path.isdir(path), "site_packages": None, "torch_version_py": None}
    answer["triton"] = None
    site_packages = _site_packages(path) if answer["exists"] else None
    if site_packages is None:
        return answer
    answer["site_packages"] = site_packages
    text = ct_venv.read_small_text(os.path.join(site_packages, "torch", "version.py"))
    if text is not None:
        answer["torch_version_py"] = parse_torch_version_py(text)
    try:
        records = sorted(e for e in os.listdir(site_packages) if e.endswith(".dist-info"))
    except OSError:
        records = []
    found = {}
    for record in records:
        name = ct_venv.canonical_name(record[: -len(".dist-info")].rsplit("-", 1)[0])
        if name in TRITON_NAMES and name not in found:
            header = ct_venv.metadata_header(os.path.join(site_packages, record, "METADATA")) or {}
            if header.get("version"):
                found[name] = {"name": name, "version": header["version"]}
    answer["triton"] = next((found[name] for name in TRITON_NAMES if name in found), None)
    return answer


# -- the roots -------------------------------------------------------------------------------------------------
def expand(template, user, home):
    """``{home}/.triton/cache`` -> ``/root/.triton/cache``; None when it needs a home the user lacks."""
    if "{home}" in template and not home:
        return None
    return template.replace("{user}", user).replace("{home}", home or "")


def read_stamp(directory, name):
    """``{"state": "none"|"ok"|"invalid", "fingerprint", "reason", "content"}`` of the stamp in the directory open
    as ``directory``.

    Opened with O_NOFOLLOW: a stamp that is a symlink is invalid, never read through.
    """
    try:
        flags = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0)
        fd = os.open(name, flags, dir_fd=directory)
    except FileNotFoundError:
        return {"state": "none", "fingerprint": None, "reason": None, "content": None}
    except OSError as error:
        why = "it is a symlink" if error.errno == errno.ELOOP else f"it cannot be opened: {error.strerror}"
        return {"state": "invalid", "fingerprint": None, "reason": why, "content": None}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {"state": "invalid", "fingerprint": None, "reason": "it is not a file", "content": None}
        data = os.read(fd, STAMP_LIMIT + 1)
    except OSError as error:
        why = f"it cannot be read: {error.strerror}"
        return {"state": "invalid", "fingerprint": None, "reason": why, "content": None}
    finally:
        os.close(fd)
    if len(data) > STAMP_LIMIT:
        return {"state": "invalid", "fingerprint": None, "reason": "it is too large to be a stamp", "content": None}
    try:
        content = json.loads(data.decode("utf-8"))
    except ValueError:
        return {"state": "invalid", "fingerprint": None, "reason": "it is not JSON", "content": None}
    if isinstance(content, dict) and content.get("state") == "purging":
        return {"state": "invalid", "fingerprint": None, "reason": "a purge of it was interrupted", "content": content}
    fingerprint = content.get("fingerprint") if isinstance(content, dict) else None
    if not isinstance(fingerprint, dict):
        return {"state": "invalid", "fingerprint": None, "reason": "it names no fingerprint", "content": content}
    return {"state": "ok", "fingerprint": fingerprint, "reason": None, "content": content}


def walk(fd, root, stamp_name, deadline):
    """Size and content of the directory open as ``fd`` (the root ``root``), through directory fds, by lstat only:
    ``{"size_bytes", "files", "entries" (top-level entries besides the stamp), "links", "escapes" ([{"link",
    "target"}] leading out of it), "escapes_count", "mounts" (other mounts, bind mounts too: never entered),
    "left" ([{"path", "why"}] other directories not entered, :func:`ct_fs.open_inside`), "partial" (the
    deadline cut the walk short), "unreadable" (directories that could not be listed)}``. It enters what a purge
    would enter."""
    found = {"size_bytes": 0, "files": 0, "entries": 0, "links": 0, "escapes": [], "escapes_count": 0}
    found.update(mounts=[], left=[], partial=False, unreadable=[], root=root, stamp_name=stamp_name)
    _walk_dir(ct_fs.open_dir(fd, root), found, deadline)
    del found["root"], found["stamp_name"]
    return found


def _walk_dir(here, found, deadline):
    try:
        try:
            names = os.listdir(here.fd)
        except OSError as error:
            found["unreadable"].append(f"{here.path}: {error.strerror}")
            return
        for name in names:
            if time.monotonic() >= deadline:
                found["partial"] = True
                return
            if here.depth == 0:
                if name == found["stamp_name"]:
                    continue
                found["entries"] += 1
            _count(here, name, found, deadline)
    finally:
        os.close(here.fd)


def _count(here, name, found, deadline):
    """Count one entry of a walk; a directory is walked when :func:`ct_fs.open_inside` lets it, a link never
    followed."""
    full = os.path.join(here.path, name)
    try:
        entry = os.stat(name, dir_fd=here.fd, follow_symlinks=False)
    except OSError:
        return  # gone while we looked
    if stat.S_ISLNK(entry.st_mode):
        found["links"] += 1
        target = _readlink(name, here.fd)
        if target is not None and not ct_fs.inside(ct_fs.clean(os.path.join(here.path, target)), found["root"]):
            found["escapes_count"] += 1
            if len(found["escapes"]) < SHOWN:
                found["escapes"].append({"link": full, "target": target})
    elif stat.S_ISDIR(entry.st_mode):
        child, why = ct_fs.open_inside(here, name)
        if why == "mount" and len(found["mounts"]) < SHOWN:
            found["mounts"].append(full)
        elif why in ct_fs.LEFT and len(found["left"]) < SHOWN:
            found["left"].append({"path": full, "why": ct_fs.LEFT[why]})
        if child is not None:
            _walk_dir(child, found, deadline)
    else:
        found["files"] += 1
        if stat.S_ISREG(entry.st_mode):
            found["size_bytes"] += entry.st_size


def _readlink(name, fd):
    try:
        return os.readlink(name, dir_fd=fd)
    except OSError:
        return None


def read_root(template, path, stamp_name, deadline, *, homes, uid):
    """One root: where it is, whether it is a directory, its stamp and content. A root that :func:`ct_fs.refusal`
    refuses (by its path or where it resolves) is not walked: ``/`` would take the whole deadline, and it is never
    purged anyway. The others are opened by :func:`ct_fs.open_root` (``unsafe``: why it cannot be, a refusal)
    and read through that one fd; ``id`` is its ``[st_dev, st_ino]``, so the acting script knows it acts on the
    same one."""
    answer = {"template": template, "path": path, "exists": False, "is_link": False, "is_dir": False}
    answer.update(real_path=None, owner=None, stamp=None, walk=None, walked=False, unsafe=None, id=None)
    if path is None:
        return answer
    with contextlib.suppress(OSError):
        answer["is_link"] = stat.S_ISLNK(os.lstat(path).st_mode)
    answer["real_path"] = os.path.realpath(path)
    try:
        info = os.stat(answer["real_path"])
    except OSError:
        return answer  # nothing there (a dangling link is not a root either)
    answer.update(exists=True, is_dir=stat.S_ISDIR(info.st_mode), owner={"uid": info.st_uid, "gid": info.st_gid})
    if not answer["is_dir"] or ct_fs.refusal(path, homes) or ct_fs.refusal(answer["real_path"], homes):
        return answer
    try:
        fd = ct_fs.open_root(path, uid)
    except ct_fs.Unsafe as error:
        answer["unsafe"] = str(error)
        return answer
    except OSError as error:
        answer["unsafe"] = f"it cannot be opened: {error.strerror}"
        return answer
    if fd is None:
        return answer
    try:
        opened = os.fstat(fd)
        answer["id"] = [opened.st_dev, opened.st_ino]
        answer["stamp"] = read_stamp(fd, stamp_name)
        answer["walk"] = walk(fd, path, stamp_name, deadline)
        answer["walked"] = True
    except OSError as error:
        answer["unsafe"] = f"it cannot be walked safely: {error.strerror or error}"
    finally:
        os.close(fd)
    return answer


# -- processes using a root ------------------------------------------------------------------------------------
def read_users(reals, deadline, own_pid, proc="/proc"):
    """Live processes that use a root (ct_proc.scan): ``({real: [{"pid", "name", "how"}]}, [{"pid", "name",
    "error"}] of those that could not be read (refused, or stuck: likely in the driver), partial)``; partial: the
    deadline left some unread."""
    if not reals:
        return {}, [], False
    scanned = ct_proc.scan(reals, deadline, proc, exclude=(own_pid,))
    return ct_proc.per_root(scanned, reals), scanned["unreadable"], bool(scanned["late"])


# -- users and GPUs --------------------------------------------------------------------------------------------
def read_user(name):
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return {"name": name, "exists": False, "uid": None, "gid": None, "home": None}
    return {"name": name, "exists": True, "uid": entry.pw_uid, "gid": entry.pw_gid, "home": entry.pw_dir}


def read_homes():
    """``{home directory: [user names]}`` of every user in the target's passwd database."""
    homes = {}
    try:
        for entry in pwd.getpwall():
            if entry.pw_dir and entry.pw_dir.startswith("/"):
                homes.setdefault(ct_fs.clean(entry.pw_dir), []).append(entry.pw_name)
    except OSError:
        pass
    return {home: sorted(names) for home, names in homes.items()}


# -- the warm-up's command ------------------------------------------------------------------------------------------
SHEBANG = 256  # bytes of a script read for its #! line


def runnable_by(info, uid, groups):
    """Whether a user (``uid``, ``groups``: every gid of theirs) may execute a file of ``os.stat`` ``info``, by its
    mode bits: root needs any x bit, the owner the owner's, a group member the group's, anyone else the others'."""
    if not stat.S_ISREG(info.st_mode):
        return False
    if uid == 0:
        return bool(info.st_mode & 0o111)
    if info.st_uid == uid:
        return bool(info.st_mode & stat.S_IXUSR)
    if info.st_gid in groups:
        return bool(info.st_mode & stat.S_IXGRP)
    return bool(info.st_mode & stat.S_IXOTH)


def _executable(path, uid, groups):
    """``(state, mode)`` of ``path`` as the user would exec it: ``ok``, ``missing``, ``not_file`` or ``denied``."""
    try:
        info = os.stat(path)
    except OSError:
        return "missing", None
    if not stat.S_ISREG(info.st_mode):
        return "not_file", None
    if not runnable_by(info, uid, groups):
        return "denied", f"{stat.S_IMODE(info.st_mode):04o}"
    return "ok", None


def _interpreter(path):
    """The program of a script's ``#!`` line (``/usr/bin/env`` of ``#!/usr/bin/env python3``), or None."""
    try:  # O_NONBLOCK: a FIFO swapped in since the stat never blocks the probe; only a regular file is read
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        head = os.read(fd, SHEBANG) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        return None
    finally:
        os.close(fd)
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].split()
    return words[0].decode(errors="replace") if words else None


def read_warmup(warmup, user):
    """How the warm-up's command would be found and started as ``user`` (``read_user``), from files alone (it is
    never run): argv[0] looked up as the acting script's ``subprocess.Popen`` does (on the warm-up's PATH, relative
    to its working directory, the user's home), then its ``#!`` interpreter.

    ``warmup``: ``{"command": argv[0], "path": the warm-up's PATH}``. Answers ``{"command", "file" (what would run,
    or the first candidate found), "state" (``ok``, ``missing``, ``not_file``, ``denied``), "mode", "interpreter",
    "interpreter_state"}``, or None for a user that does not exist (a problem of its own)."""
    if user.get("uid") is None:
        return None
    uid, gid, name = user["uid"], user["gid"], user["name"]
    try:
        groups = set(os.getgrouplist(name, gid))
    except (OSError, KeyError):
        groups = {gid}
    command, cwd = warmup["command"], user.get("home") or "/"
    cwd = cwd if os.path.isdir(cwd) else "/"
    if "/" in command:
        candidates = [os.path.join(cwd, command)]
    else:
        candidates = [os.path.join(cwd, directory, command) for directory in warmup["path"].split(os.pathsep)]
    found = {"command": command, "file": None, "state": "missing", "mode": None}
    found.update(interpreter=None, interpreter_state=None)
    for candidate in candidates:
        state, mode = _executable(candidate, uid, groups)
        if state == "ok":
            found.update(file=candidate, state="ok", mode=None)
            break
        if state != "missing" and found["file"] is None:
            found.update(file=candidate, state=state, mode=mode)
    if found["state"] == "ok":
        interpreter = _interpreter(found["file"])
        if interpreter is not None:
            found["interpreter"] = interpreter
            found["interpreter_state"] = _executable(os.path.join(cwd, interpreter), uid, groups)[0]
    return found


def run_nvidia_smi(argv, timeout):
    """The GPU names' query in the C locale (ct_run.run: a hung nvidia-smi is killed with its group, never
    waited for without a deadline)."""
    return ct_run.run(argv, timeout, env=dict(os.environ, LC_ALL="C", LANG="C"))


def probe(payload):
    """Answer ``{"user", "venv", "roots" (templates), "stamp_name", "timeout", "nvidia_smi_argv" (or None),
    "warmup" ({"command", "path"}; only with a warm-up)}``.

    ``{"user" ({"name", "exists", "uid", "gid", "home"}), "homes" ({home: [users]}), "venv" (read_venv()),
    "roots" ([read_root()]), "users" ({real path: [{"pid", "name", "how"}]}), "unreadable_processes" ([{"pid",
    "name", "error"}]),
    "users_partial", "gpus" (nvidia-smi's answer or None), "pid", "euid", "errors", "warmup" (read_warmup(), only
    when asked)}``.
    """
    # Half the time for the walks and the process scan: other probe parts share the same pct exec.
    deadline = time.monotonic() + float(payload.get("timeout", 60)) * 0.5
    user = read_user(payload["user"])
    homes = read_homes()
    if user["home"] and user["home"].startswith("/"):
        homes.setdefault(ct_fs.clean(user["home"]), [user["name"]])
    answer = {"user": user, "homes": homes, "venv": read_venv(payload["venv"]), "roots": []}
    answer.update(pid=os.getpid(), euid=os.geteuid(), errors=[], gpus=None)
    for template in payload["roots"]:
        expanded = expand(template, user["name"], user["home"])
        path = ct_fs.clean(expanded) if expanded and expanded.startswith("/") else expanded
        root = read_root(template, path, payload["stamp_name"], deadline, homes=homes, uid=user["uid"])
        root["expanded"] = expanded
        answer["roots"].append(root)
    reals = sorted({r["real_path"] for r in answer["roots"] if r["walked"]})
    try:
        users, unreadable, partial = read_users(reals, deadline, os.getpid())
    except OSError as error:
        users, unreadable, partial = {}, [], True
        answer["errors"].append(f"could not list /proc: {error.strerror or error}")
    answer.update(users=users, unreadable_processes=unreadable, users_partial=partial)
    if payload.get("warmup"):  # whether the warm-up could start, so that one that cannot fails before any purge
        answer["warmup"] = read_warmup(payload["warmup"], user)
    if payload.get("nvidia_smi_argv"):
        answer["gpus"] = run_nvidia_smi(payload["nvidia_smi_argv"], max(1, int(deadline - time.monotonic())))
    return answer
