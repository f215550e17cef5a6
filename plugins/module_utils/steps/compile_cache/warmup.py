# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The compile cache step's warm-up: the environment it runs with (the user's, the venv first on PATH, inductor's
cache in the first root, single-threaded compile), whether its command and that command's ``#!`` interpreter can
start (a warm-up that cannot fails the fact pass before anything is purged), and the line that announces it; pure.
"""

from __future__ import annotations

import shlex

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct.fs import clean, inside
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.text import printable

THREADS = "TORCHINDUCTOR_COMPILE_THREADS"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
WARMUP_STATES = ("ok", "missing", "not_file", "denied")
WARMUP_FIX = "or set compile_cache_warmup to [] (no warm-up)"


def warmup_problem(label, spec, found, venv_changes):
    """Why the planned warm-up cannot start (one sentence: what is missing and the fix), or None; pure.

    ``found``: the probe's ``read_warmup`` (None: no answer, or a user that does not exist, a problem of its own).
    A command or ``#!`` interpreter that the venv this run rebuilds may provide (argv[0] a bare name: the venv's
    ``bin`` comes first on the warm-up's PATH; or a path in the venv or one of its versions) is not held against
    it: that venv is not built yet."""
    if not isinstance(found, dict):
        return None
    venv = clean(spec["venv"])

    def of_venv(path):
        return (
            isinstance(path, str)
            and path.startswith("/")
            and (inside(clean(path), venv) or path.startswith(f"{venv}."))
        )

    command, file = spec["warmup"][0], found.get("file")
    if found.get("state") != "ok":
        from_venv = venv_changes and ("/" not in command or of_venv(file) or of_venv(command))
        return None if from_venv else f"{label}: {_command_unusable(spec, found)}, {WARMUP_FIX}"
    interpreter, state = found.get("interpreter"), found.get("interpreter_state")
    if interpreter is None or state == "ok" or (venv_changes and (of_venv(file) or of_venv(interpreter))):
        return None
    what = "does not exist" if state == "missing" else f"is not a program {spec['user']} may run"
    return (
        f"{label}: the warm-up command {printable(file)} starts with #!{printable(interpreter)}, which {what}; "
        f"install that interpreter, correct the script's first line, {WARMUP_FIX}"
    )


def _command_unusable(spec, found):
    """What keeps the warm-up's argv[0] from starting, and the fix (without the last alternative)."""
    command, user = spec["warmup"][0], spec["user"]
    if found.get("state") == "missing" and "/" in command:
        return f"the warm-up command {printable(command)} does not exist; install it there or correct its path"
    if found.get("state") == "missing":
        path = printable(warmup_environment(spec, None, "")["PATH"])
        return (
            f"the warm-up command {printable(command)} is not on the PATH it runs with ({path}); install it in the "
            f"target or give compile_cache_warmup its full path"
        )
    what = (
        "is not a file"
        if found["state"] == "not_file"
        else f"may not be run by {user} (mode {printable(found.get('mode'))})"
    )
    file = printable(found.get("file"))
    return f"the warm-up command {file} {what}; make it an executable file {user} may run (chmod +x)"


def warmup_line(spec):
    return (
        f"warm up with `{shlex.join(spec['warmup'])}` as {spec['user']} ({THREADS}=1, timeout "
        f"{spec['warmup_timeout']} s), then stamp the roots it fills"
    )


def warmup_environment(spec, home, first_root):
    """The warm-up's whole environment: the user's, the venv first on PATH, inductor's cache in the first root,
    single-threaded compile, then ``warmup_env``.

    ``warmup_environment({"user": "root", "venv": "/opt/venvs/train", "warmup_env": {"A": 1}}, "/root",
    "/tmp/torchinductor_root")`` -> ``{"PATH": "/opt/venvs/train/bin:/usr/local/sbin:...", "HOME": "/root",
    "USER": "root", "LOGNAME": "root", "LANG": "C.UTF-8", "VIRTUAL_ENV": "/opt/venvs/train",
    "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_root", "TORCHINDUCTOR_COMPILE_THREADS": "1", "A": "1"}``.
    """
    env = {
        "PATH": f"{spec['venv']}/bin:{SYSTEM_PATH}",
        "HOME": home or "/",
        "USER": spec["user"],
        "LOGNAME": spec["user"],
        "LANG": "C.UTF-8",
        "VIRTUAL_ENV": spec["venv"],
        "TORCHINDUCTOR_CACHE_DIR": first_root,
    }
    env.update({str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in spec["warmup_env"].items()})
    env[THREADS] = "1"
    return env
