# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Container side, shared: who could change a venv whose python runs as root (verify, the venv build's checks).

The training venv and verify probe parts import it (``SHARED``): ``Target.run_probes`` ships its source with
theirs in the same ``pct exec``, and on a node it is imported as usual. So: standard library only, Python 3.9+,
nothing of ours imported.
"""

import os
import re
import stat

_VERSION_NAME = r"\.\d{8}T\d{6}Z"  # <path>.<UTC stamp>: a version the training venv step built
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


def _above(parts):
    """Why a directory above the venv could be changed by another user than root, or None."""
    for depth in range(len(parts)):
        here = "/" + "/".join(parts[:depth])
        info = _lstat(here)
        if stat.S_ISLNK(info.st_mode):
            return f"{here} is a symlink (to {os.readlink(here)}): a venv's path must be real directories from /"
        why = _writers(here, info, sticky_ok=True) if stat.S_ISDIR(info.st_mode) else f"{here} is not a directory"
        if why:
            return why
    return None


def _version_of(path):
    """``(real, None)``: the directory the venv at ``path`` is (itself, or the version its link names);
    ``(None, why)`` when the link is not the step's own (root's, to a sibling ``<path>.<stamp>``)."""
    info = _lstat(path)
    if not stat.S_ISLNK(info.st_mode):
        return path, None
    parent, base = os.path.split(path)
    target = os.readlink(path)
    real = os.path.normpath(os.path.join(parent, target))
    if os.path.dirname(real) != parent or not re.match(rf"^{re.escape(base)}{_VERSION_NAME}$", os.path.basename(real)):
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
