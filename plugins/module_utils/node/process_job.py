# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A GPU holder's job, by pure rules on what node/process.py read: its parent (``ppid``, field 4 of stat, as the node's
pid namespace numbers it) and its cgroup path, from which :func:`systemd_unit` tells the systemd service it runs in
(a service with ``Restart=`` starts again whatever is ended). :func:`walk_stop`, :func:`is_shell`,
:func:`is_interactive_shell` and :func:`matches_launcher` are the rules the GPU step walks a holder's ancestors by.
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# pylint: disable=disallowed-name

from __future__ import annotations

import fnmatch
import os
import re

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.process import INTERPRETERS, matches_name

SHELLS = ("sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "fish", "tcsh", "csh")
# Where a walk up a holder's parents stops: what starts sessions, services or containers, never one job's part.
SESSION_MANAGERS = (
    "systemd",
    "init",
    "sshd",
    "sshd-session",
    "sshd-auth",
    "login",
    "agetty",
    "getty",
    "tmux*",
    "screen",
    "SCREEN",
    "cron",
    "crond",
    "atd",
    "lxc-start",
    "lxc-attach",
    "containerd-shim*",
    "conmon",
    "tini",
    "dumb-init",
    "docker-init",
    "supervisord",
    "runsv",
    "runsvdir",
    "s6-supervise",
)
# Shell options that take the next word as their argument (bash -o pipefail, --rcfile FILE).
SHELL_OPTIONS_WITH_ARGUMENT = ("-o", "+o", "-O", "+O", "--rcfile", "--init-file")
# A unit name that may go into advice a person copies into a root shell (a CT is untrusted: its cgroup paths
# are names it chose).
UNIT_NAME = re.compile(r"^[A-Za-z0-9:_.@-]+\.service$")
UNIT_NAME_LIMIT = 256
USER_MANAGER = re.compile(r"^user@(\d+)\.service$")
# Services that run login sessions or jobs of many people: a process in one is not that service's job.
SESSION_UNITS = (
    "ssh.service",
    "sshd.service",
    "sshd@*.service",
    "cron.service",
    "crond.service",
    "atd.service",
    "getty@*.service",
    "serial-getty@*.service",
    "console-getty.service",
    "container-getty@*.service",
)


def _argv0_base(info):
    return os.path.basename(info.cmdline[0]).lstrip("-") if info.cmdline else ""


def is_shell(info):
    """A POSIX-ish shell, by comm or argv[0] (``-bash`` is a login bash)."""
    return info.comm in SHELLS or _argv0_base(info) in SHELLS


def is_interactive_shell(info):
    """A shell a person types into: a login shell (argv[0] ``-bash``), or one with neither ``-c`` nor a script.

    A shell whose argv cannot be read counts as interactive: what cannot be told apart is never ended.

    >>> def sh(*argv): return is_interactive_shell(ProcessInfo(1, 1, "bash", "S", "host", list(argv), 1))
    >>> sh("-bash"), sh("bash"), sh("bash", "-l"), sh("bash", "-c", "x"), sh("sh", "run.sh")
    (True, True, True, False, False)
    """
    argv = info.cmdline
    if not argv or argv[0].startswith("-"):
        return True
    words = iter(argv[1:])
    for word in words:
        if word == "--":
            return next(words, None) is None
        if word in SHELL_OPTIONS_WITH_ARGUMENT:
            next(words, None)
            continue
        if word.startswith("-") and not word.startswith("--") and "c" in word[1:]:
            return False  # -c, -ec, -lc: runs a command string
        if not word.startswith(("-", "+")):
            return False  # a script
    return True


def program_names(info):
    """The names a process goes by: comm, argv[0] and its basename, and for an interpreter the module of
    ``-m`` and the script's basename.

    >>> argv = ["python3", "-u", "-m", "torch.distributed.run"]
    >>> sorted(program_names(ProcessInfo(1, 1, "python3", "S", "host", argv, 1)))
    ['python3', 'torch.distributed.run']
    """
    names = {info.comm}
    if info.cmdline:
        names.update({info.cmdline[0], os.path.basename(info.cmdline[0])})
        if any(fnmatch.fnmatchcase(os.path.basename(info.cmdline[0]), p) for p in INTERPRETERS):
            words = iter(info.cmdline[1:])
            for word in words:
                if word == "-m":
                    names.add(next(words, ""))
                    break
                if word.startswith("-m"):
                    names.add(word[2:])
                    break
                if word in ("-c", "-"):
                    break
                if word in ("-W", "-X", "-Q"):
                    next(words, None)
                    continue
                if not word.startswith("-"):
                    names.add(os.path.basename(word))
                    break
    names.discard("")
    return names


def matches_launcher(info, patterns):
    """The first of ``patterns`` (fnmatch) naming this process by :func:`program_names`; else None.

    ``torchrun``, ``python3 -m torch.distributed.run`` and ``python3 /usr/local/bin/accelerate`` all match their
    launcher's name. comm is cut to 15 characters by the kernel; patterns are compared cut the same way.
    """
    names = program_names(info)
    for pattern in patterns:
        for name in names:
            if fnmatch.fnmatchcase(name, pattern) or (name == info.comm and fnmatch.fnmatchcase(name, pattern[:15])):
                return pattern
    return None


def walk_stop(info, owner, protected=(), own=()):
    """Why a walk up a holder's parents stops at ``info`` (it is not part of the holder's job), or None.

    It stops at a process of another owner (another CT, the node), the init of a pid namespace (the CT's init,
    the host's pid 1), a process of this recover run (``own``: ``(pid, start_time)`` of the module, the controller
    and their parents, :func:`process.ancestry`), an interactive shell (a person's login or terminal: what is
    beyond it is their session, not the job), a session or service manager (sshd, tmux, cron, systemd...), and a
    protected process.
    """
    if info is None:
        return "is gone"
    # First, whatever it is named: ending the shell that runs ansible-playbook ends the run itself.
    if (info.pid, info.start_time) in own:
        return "runs this recover run"
    if info.owner != owner:
        return "belongs to another owner"
    if info.pid <= 1 or info.ns_pid == 1:
        return "is the init of its pid namespace"
    if is_shell(info) and is_interactive_shell(info):
        return "is an interactive shell"
    if matches_name(info, SESSION_MANAGERS):
        return "starts sessions or services"
    if matches_name(info, protected):
        return "is protected"
    return None


def systemd_unit(path, owner):
    """The systemd service a cgroup path lies in (its innermost ``*.service``), or None.

    Returns ``{"name", "valid", "path", "user"}``: ``name`` as the path has it (untrusted: shown only after
    ``valid`` says it is a plain unit name), ``path`` the unit's cgroup, ``user`` the uid of a user manager's
    unit (None for a system service). For a CT only the part under ``/lxc/<vmid>/ns`` counts (the CT's own
    systemd); another owner's processes have none (they are never ended). Login and job services (ssh, cron,
    getty: SESSION_UNITS) are not a job's service.

    >>> systemd_unit("/lxc/200/ns/system.slice/train.service", "ct:200")["name"]
    'train.service'
    >>> systemd_unit("/lxc/200/ns/.lxc", "ct:200") is None
    True
    """
    kind, _, vmid = owner.partition(":")
    if kind == "ct":
        prefix = f"/lxc/{vmid}/ns"
        if not path.startswith(prefix + "/"):
            return None
    elif owner == "host":
        prefix = ""
    else:
        return None
    parts = path[len(prefix) :].strip("/").split("/")
    units = [i for i, part in enumerate(parts) if part.endswith(".service")]
    if not units:
        return None
    name = parts[units[-1]]
    user = next((USER_MANAGER.match(p).group(1) for p in parts[: units[-1]] if USER_MANAGER.match(p)), None)
    if USER_MANAGER.match(name) or any(fnmatch.fnmatchcase(name, p) for p in SESSION_UNITS):
        return None
    return {
        "name": name,
        "valid": len(name) <= UNIT_NAME_LIMIT and bool(UNIT_NAME.match(name)),
        "path": "/".join([prefix, *parts[: units[-1] + 1]]) if prefix else "/" + "/".join(parts[: units[-1] + 1]),
        "user": int(user) if user is not None else None,
    }


def unit_is_job(members, job):
    """Whether a service is the job's own: its oldest process (its main one, or what started the rest) is one of
    the job's processes (``job``: the holder and its parents up to where the walk stopped); pure.

    A service whose members cannot be read counts as the job's (the step then fails naming it: nothing is ended
    that a service may start again). A holder left in a service that runs other things (a CI runner's job, a
    process that was started from a service and outlived its parent) is not the service's job.
    """
    if not members:
        return True
    oldest = min(members, key=lambda m: (m[1], m[0]))
    return any((info.pid, info.start_time) == tuple(oldest) for info in job)
