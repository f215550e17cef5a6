# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Preflight probe: everything preflight needs from inside a target, gathered in ONE run.

In a CT this file's source is fed to the CT's python3 on stdin by ``Target.run_probe`` (one ``pct exec``);
on a bare host ``probe()`` runs in the module's own process. So: standard library only, Python 3.9+, nothing of
ours but ct_run (the one command runner, shipped with it), and the answer is plain JSON. It only reads; the
module decides what is wrong.
"""
# Runs in the target from its source (standard library and ct_run only), where no AnsibleModule.run_command
# exists.
# pylint: disable=ansible-bad-function

import glob
import os
import stat
import sys

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run

SHARED = (ct_run,)  # container-side modules Target.run_probes ships with this part


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


def _run(argv, timeout):
    """``argv`` run in the C locale within ``timeout`` s (ct_run.run: a hung nvidia-smi is killed with its
    process group and left behind if it will not die)."""
    return ct_run.run(argv, timeout, env=dict(os.environ, LC_ALL="C", LANG="C"))


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
