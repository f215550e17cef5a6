# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Preflight probe: everything preflight needs from inside a target, gathered in ONE run.

In a CT this file's source is fed to the CT's python3 on stdin by ``Target.run_probe`` (one ``pct exec``);
on a bare host ``probe()`` runs in the module's own process. So: standard library only, Python 3.9+, no
imports from ansible, and the answer is plain JSON. It only reads; the module decides what is wrong.
"""
# Runs in the target from its source (standard library only), where no AnsibleModule.run_command exists.
# pylint: disable=ansible-bad-function

import contextlib
import glob
import os
import signal
import stat
import subprocess
import sys


def _device(path):
    try:
        info = os.stat(path)
    except OSError:
        return None
    return {
        "path": path,
        "char": stat.S_ISCHR(info.st_mode),
        "major": os.major(info.st_rdev),
        "minor": os.minor(info.st_rdev),
        "mode": oct(stat.S_IMODE(info.st_mode)),
    }


def _read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def _space(path):
    """Free and total bytes of the filesystem that would hold ``path`` (its first existing ancestor)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    usage = os.statvfs(existing)
    return {
        "path": path,
        "existing": existing,
        "free_bytes": usage.f_bavail * usage.f_frsize,
        "total_bytes": usage.f_blocks * usage.f_frsize,
    }


# Seconds a killed command may take to exit before it is left behind (a process in state D never exits).
REAP_GRACE = 2


def _run(argv, timeout):
    """Run ``argv`` within ``timeout`` s; past it, kill its whole process group and wait REAP_GRACE s at most.

    Not subprocess.run: after killing the child it waits without a deadline, and an nvidia-smi stuck in the
    driver (a GPU fallen off the bus) survives SIGKILL: on a bare host that wait would hang the run.
    """
    env = dict(os.environ, LC_ALL="C", LANG="C")
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # its own group: what it starts is killed with it
        )
    except FileNotFoundError:
        return {"rc": 127, "stdout": "", "stderr": f"{argv[0]}: command not found", "missing": True}
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):  # gone already
            os.killpg(process.pid, signal.SIGKILL)
        said = f"{argv[0]} timed out after {timeout} s"
        try:
            process.communicate(timeout=REAP_GRACE)
        except subprocess.TimeoutExpired:
            # Left behind (Popen reaps it later if it ever exits); named so the report says why.
            said += f" and did not exit after SIGKILL within {REAP_GRACE} s (stuck in the kernel or the driver)"
            return {"rc": 124, "stdout": "", "stderr": said, "timed_out": True, "abandoned": True}
        return {"rc": 124, "stdout": "", "stderr": said, "timed_out": True}
    return {"rc": process.returncode, "stdout": out, "stderr": err}


def _nvidia_smi(payload):
    """The GPU query; asked once more without the optional fields when this driver rejects one (exit 2)."""
    timeout = payload.get("timeout", 30)
    done = _run(payload["nvidia_smi_argv"], timeout)
    fallback = payload.get("nvidia_smi_fallback_argv")
    if fallback and done["rc"] == 2 and "is not a valid field to query" in done["stdout"] + done["stderr"]:
        done = dict(_run(fallback, timeout), fallback=True)
    return done


def probe(payload):
    """Answer ``payload`` (device globs, version file, library globs, nvidia-smi argv, space path) as a dict."""
    devices = []
    for pattern in payload["device_globs"]:
        for path in sorted(glob.glob(pattern)):
            found = _device(path)
            if found:
                devices.append(found)
    libraries = []
    for pattern in payload["library_globs"]:
        libraries.extend(sorted(glob.glob(pattern)))
    return {
        # What socket.gethostname() and platform.python_version() say, without importing either in every CT.
        "hostname": os.uname().nodename,
        "python": sys.version.split()[0],
        "devices": devices,
        "kernel_version_text": _read(payload["kernel_version_file"]),
        "nvml_libraries": libraries,
        "nvidia_smi": _nvidia_smi(payload),
        "space": _space(payload["space_path"]),
    }
