# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Run commands in a Proxmox VE container (``pct exec``) or on a host: the ONE place that builds those argvs.

Every module of this project that touches a container or a host goes through :class:`Target`:

* with a vmid, a command runs inside the container as
  ``pct exec <vmid> --keep-env 0 -- timeout -k 5 <secs> env LC_ALL=C LANG=C <argv...>``
  (``--keep-env 0`` so the node's environment never leaks in; ``timeout`` inside the CT so that a command that
  hangs is killed in the CT too, not only the ``pct`` client on the node);
* without a vmid, the same command runs on this host (the module already runs there).

argv is always a list and never reaches a shell, and it carries no data: anything large (probe payloads, a hashed
lock, file content) goes on stdin, since Linux refuses one argument over 128 KiB (an argv it refuses all the same
is a TargetError of kind ``too_large``). The vmid is an integer in Proxmox's range before it is ever formatted.
Failures of ``pct`` itself (container missing or stopped, ``pct`` missing, a command missing inside) become
:class:`TargetError` with one line that says what was found and what to do.
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# pylint: disable=disallowed-name

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import socket

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import progress as ct_progress
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.command import (
    C_LOCALE,
    DEFAULT_TIMEOUT,
    run_local,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.errors import RecoverError
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.probes import (
    PROBES_MAIN,
    probe_name,
    probes_argv,
    probes_input,
    run_parts_bounded,
)

VMID_MIN = 100
VMID_MAX = 999_999_999
KILL_GRACE = 5  # seconds `timeout -k` waits after SIGTERM before SIGKILL
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Messages of Proxmox's pct (pve-container: src/PVE/CLI/pct.pm, src/PVE/LXC/Config.pm) and of lxc-attach.
PCT_NOT_RUNNING = re.compile(r"container '(\d+)' not running!")
PCT_NO_CONFIG = re.compile(r"Configuration file '([^']+)' does not exist")
PCT_CONFIG_NODE = re.compile(r"(?:^|/)nodes/([^/]+)/lxc/")  # the node pct looked on, in its config path
PCT_PARAM_ERROR = re.compile(r"400 Parameter verification failed")
# pmxcfs, the cluster file system: every node of a cluster sees every node's CT configs here, as
# <node>/lxc/<vmid>.conf. Read only when pct says a CT is not on its node (a CT migrated since the inventory was
# written), never in a run that finds its CT.
PVE_NODES = "/etc/pve/nodes"
# pct before pve-container 5.0.9 (Proxmox VE 8.1, March 2024) has no --keep-env: Getopt::Long warns about it and
# the CLI handler fails with "400 unable to parse option" before anything runs in the CT.
PCT_NO_KEEP_ENV = re.compile(r"Unknown option: keep-env")
# What a cleared environment gets inside the CT (lxc-attach --clear-env's PATH).
CT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# rc 127 from lxc-attach, timeout(1) or env(1) when the command does not exist where it should run.
NOT_FOUND = (
    re.compile(r'Failed to exec "([^"]+)"'),
    re.compile(r"failed to run command [\u2018'`]([^\u2019'`]+)[\u2019'`]"),  # quotes: typographic or plain
    re.compile(r"env: [\u2018'`]([^\u2019'`]+)[\u2019'`]: No such file or directory"),
)
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
EXIT_TIMEOUT = 124
EXIT_PCT_DIED = 255


# The options of every module that reaches a target (documented once in plugins/doc_fragments/pve_target.py).
TARGET_ARGUMENT_SPEC = {
    "vmid": {"type": "int"},
    "node_name": {"type": "str"},
    "timeout": {"type": "int", "default": DEFAULT_TIMEOUT},
}
# The option of the modules that run probe parts or scripts in the target's own Python (doc fragment
# pve_target.python): the same interpreter everywhere, the fact pass's (the roles pass preflight_python).
PYTHON_ARGUMENT_SPEC = {"python": {"type": "str", "default": "python3"}}


class TargetError(RecoverError):
    """A command could not be run where it should, or failed.

    ``kind`` is stable for code (``invalid``, ``missing``, ``moved``, ``stopped``, ``no_pct``, ``not_found``,
    ``timeout``, ``failed``, ``probe``, ``too_large``); ``str(error)`` is the message for ``fail_json(msg=...)``.
    """

    @classmethod
    def of(cls, message, result, *, kind):
        """The error for a command that ran: its argv (shown_argv), exit code and output go along, apart from the
        message."""
        return cls(
            message, kind=kind, cmd=shown_argv(result.argv), rc=result.rc, stdout=result.stdout, stderr=result.stderr
        )


def shown_argv(argv):
    """``argv`` as a failure shows it: the probe program (PROBES_MAIN, some 3 KB of Python) as ``<probe program>``
    and any other program given as an argument (one with a line break) as ``<program>``, never their source (pure).

    ``shown_argv(["pct", "exec", "200", "--", "python3", "-I", "-S", "-c", PROBES_MAIN])`` ->
    ``["pct", "exec", "200", "--", "python3", "-I", "-S", "-c", "<probe program>"]``."""
    return ["<probe program>" if a == PROBES_MAIN else "<program>" if "\n" in str(a) else str(a) for a in argv]


def nodes_holding(vmid, nodes_dir=None):
    """The cluster nodes whose configuration holds CT ``vmid``, sorted: ``<nodes_dir>/<node>/lxc/<vmid>.conf``
    exists (``nodes_dir``: :data:`PVE_NODES`, which every node of a cluster sees whole). ``[]`` off a cluster.

    ``nodes_holding(200)`` -> ``["pve2"]`` once CT 200 migrated to pve2, seen from pve1 as from pve2."""
    nodes_dir = PVE_NODES if nodes_dir is None else nodes_dir
    try:
        names = os.listdir(nodes_dir)
    except OSError:
        return []
    return sorted(name for name in names if os.path.isfile(os.path.join(nodes_dir, name, "lxc", f"{vmid}.conf")))


def validate_vmid(value):
    """Return ``value`` as a Proxmox CT id (int 100..999999999) or None; raise TargetError for anything else.

    ``validate_vmid(200)`` is 200; ``validate_vmid("200; touch /tmp/x")`` raises: a vmid is formatted into a pct
    argv only after this check, so no string a user writes ever becomes part of a command.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not VMID_MIN <= value <= VMID_MAX:
        raise TargetError(
            f"vmid must be an integer from {VMID_MIN} to {VMID_MAX} (a Proxmox VE CT id), got {value!r}",
            kind="invalid",
        )
    return value


class Target:
    """A Proxmox CT seen from its node (``vmid`` given) or a bare host (``vmid`` None).

    ``runner`` executes an argv on the node and returns a CommandResult (tests inject a fake that asserts the
    exact argvs); ``node`` names the node in messages; ``python`` is the CT's interpreter that runs probe parts.
    """

    def __init__(self, vmid=None, *, node=None, runner=None, pct="pct", timeout=DEFAULT_TIMEOUT, python="python3"):
        self.vmid = validate_vmid(vmid)
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
            # timeout(1) reads 0 as "no deadline": a hung command would then hang the run.
            raise TargetError(f"timeout must be a whole number of seconds, at least 1, got {timeout!r}", kind="invalid")
        self.node = node or socket.gethostname()
        self.runner = runner or run_local
        self.pct = pct
        self.timeout = timeout
        self.python = python
        # Whether this node's pct takes --keep-env (pve-container 5.0.9+); learnt from its answer, once per Target.
        self.pct_keep_env = True

    @classmethod
    def from_params(cls, params):
        """The target a module's TARGET_ARGUMENT_SPEC (and PYTHON_ARGUMENT_SPEC) options name."""
        python = params.get("python") or "python3"
        return cls(params["vmid"], node=params["node_name"], timeout=params["timeout"], python=python)

    @property
    def is_container(self):
        return self.vmid is not None

    @property
    def label(self):
        """How messages name this target: ``CT 200 on pve1`` or ``host pve1``."""
        return f"CT {self.vmid} on {self.node}" if self.is_container else f"host {self.node}"

    # -- argv shapes ---------------------------------------------------------------------------------------
    def command_argv(self, argv, *, timeout=None, env=None):
        """The argv that runs ``argv`` in the target with a deadline (pure; unit tests assert it exactly)."""
        argv = [str(a) for a in argv]
        if not argv:
            raise TargetError(f"{self.label}: empty command", kind="invalid")
        seconds = int(timeout or self.timeout)
        guarded = ["timeout", "-k", str(KILL_GRACE), str(seconds)]
        if not self.is_container:
            return [*guarded, *argv]
        extra = []
        for name, value in sorted((env or {}).items()):
            if not ENV_NAME.match(name):
                raise TargetError(f"{self.label}: invalid environment variable name {name!r}", kind="invalid")
            extra.append(f"{name}={value}")
        if "=" in argv[0]:
            # env(1) would read it as an assignment, not as the command.
            raise TargetError(f"{self.label}: command name {argv[0]!r} contains '='", kind="invalid")
        locale = [f"{k}={v}" for k, v in C_LOCALE.items()]
        if self.pct_keep_env:
            return [self.pct, "exec", str(self.vmid), "--keep-env", "0", "--", *guarded, "env", *locale, *extra, *argv]
        # An older pct passes the node's environment on: clear it inside the CT instead.
        inner = ["env", "-i", f"PATH={CT_PATH}", *locale, *extra, *argv]
        return [self.pct, "exec", str(self.vmid), "--", *guarded, *inner]

    def pct_argv(self, *args):
        """A plain ``pct <subcommand> <vmid> ...`` call (status, push, pull)."""
        return [self.pct, args[0], str(self.vmid), *[str(a) for a in args[1:]]]

    # -- running -------------------------------------------------------------------------------------------
    def run(self, argv, *, stdin=None, timeout=None, env=None, check=True, on_output=None):
        """Run ``argv`` in the target; return CommandResult. With ``check``, a non-zero exit raises TargetError.

        ``on_output(stream, chunk)`` gets the output as it comes (see run_local); only passed on when given.
        """
        seconds = int(timeout or self.timeout)
        wrapped = self.command_argv(argv, timeout=seconds, env=env)
        result = self._execute(
            wrapped,
            argv,
            stdin=stdin,
            timeout=seconds + KILL_GRACE + 10,
            env=None if self.is_container else env,
            on_output=on_output,
        )
        if self.is_container and self.pct_keep_env and self._pct_lacks_keep_env(result):
            # Rejected before anything ran in the CT: safe to run again the old way.
            self.pct_keep_env = False
            wrapped = self.command_argv(argv, timeout=seconds, env=env)
            result = self._execute(wrapped, argv, stdin=stdin, timeout=seconds + KILL_GRACE + 10, on_output=on_output)
        self._raise_for_wrapper(result, argv, seconds)
        if check and result.rc != 0:
            raise TargetError.of(
                f"{self.label}: `{' '.join(map(str, argv))}` failed with exit code {result.rc}: "
                f"{first_line(result.stderr) or first_line(result.stdout) or 'no output'}",
                result,
                kind="failed",
            )
        return result

    def run_on_node(self, argv, *, stdin=None, timeout=None, env=None, check=True):
        """Run ``argv`` on the node itself (NVML, /proc and cgroups are only visible there), never in the CT."""
        node_target = (
            self if not self.is_container else Target(node=self.node, runner=self.runner, timeout=self.timeout)
        )
        return node_target.run(argv, stdin=stdin, timeout=timeout, env=env, check=check)

    def status(self):
        """``running`` or ``stopped`` as ``pct status`` says; TargetError when the CT does not exist."""
        argv = self.pct_argv("status")
        result = self._execute(argv, argv, timeout=self.timeout)
        self._raise_for_pct(result)
        match = re.search(r"^status: (\S+)", result.stdout, re.MULTILINE)
        if result.rc != 0 or not match:
            raise TargetError.of(
                f"{self.label}: `pct status {self.vmid}` gave no status (exit {result.rc}): "
                f"{first_line(result.stderr) or first_line(result.stdout)}",
                result,
                kind="failed",
            )
        return match.group(1)

    def run_probe(self, probe_module, payload, *, python=None, timeout=None):
        """Run ``probe_module.probe(payload)`` in the target and return its JSON-able answer (one ``pct exec``)."""
        name = probe_name(probe_module)
        part = self.run_probes({name: (probe_module, payload)}, python=python, timeout=timeout)[name]
        if "error" in part:
            raise TargetError(f"{self.label}: the {name} probe failed: {part['error']}", kind="probe")
        return part["answer"]

    def run_probes(self, parts, *, python=None, timeout=None, on_output=None):
        """Run several probe parts in the target in ONE process and return ``{name: {"answer"|"error", "seconds"}}``.

        ``parts`` maps a name to ``(probe_module, payload)``. In a CT the modules' sources and their payloads
        travel as one JSON document on stdin to the CT's python through ONE ``pct exec`` (argv holds only the
        fixed PROBES_MAIN: a payload such as a hashed lock can pass Linux's 128 KiB limit on one argument), each
        executed in a namespace of its own (so their helpers never clash) and called in order; a part that raises
        reports its error without stopping the others. On a bare host the parts run in this process, in a thread
        waited for ``timeout`` + KILL_GRACE seconds at most: a part stuck on a hung mount or in the driver is an
        error of kind ``wedged`` instead of a hung run. The answer of a CT is untrusted: anything but the expected
        JSON shape is a TargetError naming what came back. ``python``: the CT's interpreter, the target's own when
        None.

        ``on_output(stream, chunk)`` gets the parts' output as it comes: their progress lines (ct_progress),
        which an error's message then leaves out. On a bare host the parts run here, and their lines go to it
        through ``ct_progress.sink``.
        """
        python = python or self.python
        if not self.is_container:
            if on_output is None:
                return run_parts_bounded(parts, int(timeout or self.timeout) + KILL_GRACE, self.label)
            ct_progress.sink = lambda line: on_output("stderr", line + "\n")
            try:
                return run_parts_bounded(parts, int(timeout or self.timeout) + KILL_GRACE, self.label)
            finally:
                ct_progress.sink = None
        result = self.run(
            probes_argv(python), stdin=probes_input(parts), timeout=timeout, check=False, on_output=on_output
        )
        if on_output is not None:
            result = dataclasses.replace(result, stderr=ct_progress.strip(result.stderr))
        try:
            answer = json.loads(result.stdout)
        except ValueError:
            answer = None
        names = " + ".join(parts)
        if result.rc != 0 or not isinstance(answer, dict):
            raise TargetError.of(
                f"{self.label}: the {names} probe failed (exit {result.rc}): {probe_failure(result, python, self)}",
                result,
                kind="probe",
            )
        for name in parts:
            part = answer.get(name)
            if not isinstance(part, dict) or not ("answer" in part or isinstance(part.get("error"), str)):
                raise TargetError.of(
                    f"{self.label}: the {names} probe answered no {name!r} part in the expected shape; "
                    f"is something inside the CT replacing {python}?",
                    result,
                    kind="probe",
                )
        return {name: answer[name] for name in parts}

    # -- internals -----------------------------------------------------------------------------------------
    def _execute(self, wrapped, argv, *, stdin=None, timeout, env=None, on_output=None):
        try:
            extra = {} if on_output is None else {"on_output": on_output}  # runners that take no reader get none
            return self.runner(wrapped, stdin=stdin, timeout=timeout, env=env, **extra)
        except FileNotFoundError:
            if self.is_container:
                raise TargetError(
                    f"pct not found in PATH of node {self.node}: this is not a Proxmox VE node; set pve_node to "
                    f"the node that hosts CT {self.vmid}, or leave pve_vmid unset for a bare GPU host",
                    kind="no_pct",
                    cmd=shown_argv(wrapped),
                ) from None
            raise TargetError(
                f"{self.label}: `{wrapped[0]}` not found in PATH (coreutils `timeout` is needed to run "
                f"`{argv[0]}` with a deadline)",
                kind="not_found",
                cmd=shown_argv(wrapped),
            ) from None
        except OSError as error:
            if error.errno != errno.E2BIG:
                raise
            # A size limit is an error that says so, never a traceback (large data goes on stdin).
            longest = max(len(str(a).encode()) for a in wrapped)
            raise TargetError(
                f"{self.label}: the command line of `{argv[0]}` is too large for the kernel (E2BIG: "
                f"{sum(len(str(a).encode()) + 1 for a in wrapped)} bytes, the longest argument {longest} bytes; "
                f"Linux allows 128 KiB per argument): send large data on stdin",
                kind="too_large",
                cmd=[a[:200] for a in shown_argv(wrapped)],
            ) from None

    @staticmethod
    def _pct_lacks_keep_env(result):
        return result.rc == EXIT_PCT_DIED and bool(PCT_NO_KEEP_ENV.search(result.stderr))

    def _raise_for_pct(self, result):
        if not self.is_container or result.rc != EXIT_PCT_DIED:
            return
        err = result.stderr
        if PCT_NOT_RUNNING.search(err):
            raise TargetError.of(
                f"{self.label} is not running (pct: container '{self.vmid}' not running!); "
                f"start it with `pct start {self.vmid}` on {self.node} and run again",
                result,
                kind="stopped",
            )
        missing = PCT_NO_CONFIG.search(err)
        if missing:
            self._raise_if_moved(missing.group(1), result)
            raise TargetError.of(
                f"CT {self.vmid} does not exist on node {self.node} ({missing.group(1)} is missing); "
                f"check pve_vmid and pve_node in the inventory (`pct list` on the node shows its CTs)",
                result,
                kind="missing",
            )
        if PCT_PARAM_ERROR.search(err):
            raise TargetError.of(
                f"{self.label}: pct rejected the call: {' '.join(err.split())[:300]}",
                result,
                kind="invalid",
            )

    def _raise_if_moved(self, config, result):
        """A CT pct does not find on this node but another node of the cluster holds (:func:`nodes_holding`; ``config``
        is the path pct names, ``nodes/<this node>/lxc/<vmid>.conf``) has migrated: say where it lives now."""
        here = PCT_CONFIG_NODE.search(config)
        elsewhere = [node for node in nodes_holding(self.vmid) if not here or node != here.group(1)]
        if not elsewhere:
            return
        where = " and ".join(elsewhere)
        one = len(elsewhere) == 1
        raise TargetError.of(
            f"CT {self.vmid} lives on {'node' if one else 'nodes'} {where} now (moved from {self.node}): set "
            f"pve_node to {where if one else 'the one it runs on'} or use the community.proxmox.proxmox inventory "
            f"plugin",
            result,
            kind="moved",
        )

    def _raise_for_wrapper(self, result, argv, seconds):
        self._raise_for_pct(result)
        if result.timed_out or (result.rc == EXIT_TIMEOUT and result.seconds >= seconds - 0.5):
            left = (
                "; it did not exit after SIGKILL (stuck in the kernel or the driver, state D) and was left behind"
                if getattr(result, "abandoned", False)
                else ""
            )
            raise TargetError.of(
                f"{self.label}: `{' '.join(map(str, argv))}` timed out after {seconds} s and was killed{left}",
                result,
                kind="timeout",
            )
        if result.rc in (EXIT_NOT_FOUND, EXIT_NOT_EXECUTABLE):
            for pattern in NOT_FOUND:
                found = pattern.search(result.stderr)
                if found and found.group(1) == str(argv[0]):
                    where = f"inside CT {self.vmid}" if self.is_container else f"on host {self.node}"
                    raise TargetError.of(
                        f"{self.label}: `{argv[0]}` not found {where} (PATH of a non-login root shell); "
                        f"install it there or give its full path",
                        result,
                        kind="not_found",
                    )


def probe_failure(result, python, target):
    """Why the probe program gave no answer, and what to do, in one line: the cause its run shows (its last stderr
    line, a kill, output that is not the probe's) and the fix (the CT's interpreter: Python 3.9+,
    ``preflight_python``)."""
    check = f"`pct exec {target.vmid} -- {python} -V` on {target.node}"
    if result.rc in (-9, 137):
        return (
            f"{python} was killed (SIGKILL: out of memory in the CT?); look at the CT's memory ({check} to try "
            "its Python) and run again"
        )
    said = last_line(result.stderr)
    if result.rc != 0:
        cause = said or "no message on stderr"
        return (
            f"{cause}; the CT's {python} must be a Python 3.9+ that runs a standard-library program: check it "
            f"with {check}, or set preflight_python to one that is"
        )
    return (
        f"{python} printed no JSON answer ({said or 'nothing on stderr'}); is something in the CT replacing "
        f"{python}? Check it with {check}, or set preflight_python to the real interpreter"
    )


def first_line(text):
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


def last_line(text):
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""
