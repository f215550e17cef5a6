# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The training code reset's git: one repository's git run within the reset's deadline (a command past it is
killed with its process group), every call that writes the repository as the owner of its work tree, in the
owner's copy of the :mod:`pve_ct_git` view; and a commit's sha as messages show it.

Container side, shipped with the reset script: it is in the script's ``SHARED``, so ``Target.run_probes`` sends
its source in the same ``pct exec`` (registered under its own dotted name), and on a node it is imported as
usual. So: standard library only, Python 3.9+, nothing of ours but the container-side modules of its own
``SHARED``.
"""
# Runs in the target from its source (standard library only), where no AnsibleModule.run_command exists.
# pylint: disable=ansible-bad-function

import contextlib
import os
import signal
import subprocess
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_ct_act, pve_ct_git

SHARED = (pve_ct_act, pve_ct_git)  # container-side modules Target.run_probes ships with this module

KILL_WAIT = 5


def short(sha):
    return sha[:12] if sha else "(none)"


class Git:
    """git in one repository within the reset's deadline; a command past it is killed with its process group."""

    def __init__(self, git, top, deadline, budget):
        self.git = git
        self.top = top
        self.deadline = deadline
        self.budget = budget
        self.env = pve_ct_git.git_env(top)
        self.owner = None  # (uid, gid) that git's writes run as, None: root (a repository of root's)
        self.owner_env = self.env

    def run(self, *args, config=(), env=None, write=False, grace=0.0):
        """``(rc, stdout, stderr)``. ``write``: a call that writes the repository runs as its owner (not root), in
        the owner's copy of the view; ``grace``: seconds it may run past the deadline."""
        argv = pve_ct_git.git_argv(self.git, self.top, args, config)
        remaining = self.deadline - time.monotonic()
        as_owner = {}
        if write and self.owner is not None:
            as_owner = {"user": self.owner[0], "group": self.owner[1], "extra_groups": []}
        if remaining <= 0:
            raise pve_ct_act.ActError(
                "timeout", f"the reset's {self.budget:g} s (reset_timeout) ran out before `git {args[0]}`"
            )
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=dict(self.owner_env if as_owner else self.env, **(env or {})),
                cwd="/",
                start_new_session=True,  # so that a timeout kills what git started too (ssh, remote helpers)
                **as_owner,
            )
        except OSError as error:
            raise pve_ct_act.ActError("no_git", f"cannot run `{self.git}`: {error.strerror}", cmd=argv) from None
        try:
            out, err = process.communicate(timeout=remaining + grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)
            try:
                out, err = process.communicate(timeout=KILL_WAIT)
            except subprocess.TimeoutExpired:
                out, err = b"", b""
            raise pve_ct_act.ActError(
                "timeout",
                f"`git {' '.join(args)}` did not finish within the reset's {self.budget:g} s (reset_timeout) and "
                f"was killed",
                cmd=argv,
                stderr=err.decode(errors="replace"),
            ) from None
        return process.returncode, out, err.decode(errors="replace")

    def must(self, *args, what, kind="git", config=(), env=None, write=False, grace=0.0):
        rc, out, err = self.run(*args, config=config, env=env, write=write, grace=grace)
        if rc != 0:
            argv = pve_ct_git.git_argv(self.git, self.top, args, config)
            raise pve_ct_act.ActError(
                kind, f"{what} failed (exit {rc}): {pve_ct_git.first_error(err)}", cmd=argv, rc=rc, stderr=err
            )
        return out
