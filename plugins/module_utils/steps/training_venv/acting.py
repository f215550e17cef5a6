# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The training venv step's acting logic: the module (library/training_venv.py) is its documentation, its options
and ``run_step_module(TrainingVenv(ARGUMENT_SPEC))``; here is what it does on the node.

Read the venv and compare it with the lock (facts.py), and when it is not the lock send the build script
(script.py) with what the lock means (:func:`build_payload`) in ONE ``pct exec`` that builds, checks, swaps and
reads the venv again; check the script's answer (:func:`built_of`) and the second read (:func:`unproven`); put
the uv of PyPI's wheel into the target first when the role gave one and the read did not find it there
(:func:`install_uv`).
"""

from __future__ import annotations

import re
import zipfile

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct.venv import canonical_name
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.act_runner import ActingStep, leftover, utc_stamp
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.text import printable
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import facts as venv_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import script as venv_script
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.compare import (
    TOOLING,
    ignored_tooling,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.facts import (
    NAME,
    effective_keep,
    prune_line,
    wheel_uv_path,
    wheel_uv_version,
    window_message,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.lock import (
    VenvError,
    expected_python,
    is_name,
    lock_format,
    parse_lock,
    resolve_lock,
    shown,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv.network import (
    network_payload,
    network_problem,
)

BUILD = "build"
UV_IN_WHEEL = re.compile(r"uv-([0-9][^/]*)\.data/scripts/uv")
CACHE_MAX_GIB = 20  # the module's default cache_max_gib: about four CUDA torch stacks no kept version links
# The pct exec of a build gets this much more than build_timeout, so the script's own deadline fires first and
# it can still remove what it built and answer.
CLEANUP_GRACE = 60
# What the build script answers on success, and the type of each key (its answer comes from inside the CT).
BUILT_KEYS = {"current": str, "builder": dict, "lock_file": str, "cleaned": list, "removed": list, "cache": dict}
BUILT_KEYS.update({"retention_skipped": list, "previous": (dict, type(None))})


def python_option_problem(python):
    """Why ``python`` cannot be the CT's interpreter: before 2.0.0 this module's ``python`` was the venv's version
    (now ``python_version``), and a version given there must not be run as a command. ``""`` when it can."""
    if re.fullmatch(r"\d+\.\d+", python or ""):
        return (
            f"python is {python!r}, a version: python is the CT's interpreter (python3), and the venv's Python "
            f"version is python_version since 2.0.0 (role variable training_venv_python_version)"
        )
    return ""


def build_from_source_problem(names):
    """Why ``build_from_source`` cannot name packages (one sentence), or ``""``: each entry is a package name."""
    for name in names or []:
        if not is_name(name):
            return (
                f"build_from_source holds {shown(name)!r}, which is not a package name; give the names of the lock's "
                "packages that may be built from their source distribution as root in the target "
                "(training_venv_build_from_source: [name, ...])"
            )
    return ""


def build_payload(spec, params, stamp, prune_only=False):
    """What the build script needs, the lock's meaning included (the script parses nothing of ours).

    ``build_payload({"path": "/opt/venvs/train", "lock": "six==1.17.0 --hash=sha256:ab\\n", "python_version": None,
    "tooling": "ignore", "keep": None}, {"uv": "uv", "build_timeout": 1800}, "20261203T101500Z")`` ->
    ``{"path": "/opt/venvs/train", "lock": ..., "python": None, "stamp": "20261203T101500Z", "uv": "uv", "keep":
    None, "timeout": 1800, "expected": {"six": "1.17.0"}, "ignore": ["pip", "setuptools", "wheel"],
    "drop_tooling": [], "prune_only": False}``.
    """
    lock = parse_lock(spec["lock"])
    locked = lock["distributions"]
    exact = spec["tooling"] == "exact"
    payload = {
        "path": spec["path"],
        "lock": spec["lock"],
        "python": expected_python(spec, lock),
        "stamp": stamp,
        "uv": params["uv"],
        "keep": effective_keep(spec),
        "timeout": params["build_timeout"],
        "expected": locked,
        "ignore": sorted(ignored_tooling(locked, spec["tooling"])),
        # `python3 -m venv` seeds pip/setuptools: under tooling=exact a pip build removes those the lock lacks.
        "drop_tooling": sorted(set(TOOLING) - set(locked)) if exact else [],
        "prune_only": prune_only,  # in spec: only old versions beyond keep to remove, nothing built
        # Wheels only, but for these (canonical names): building an sdist runs the package's own code as root.
        "build_from_source": sorted({canonical_name(name) for name in params.get("build_from_source") or []}),
        # The build's own package cache beside the venv is dropped after a build once it holds more than this.
        "cache_max_bytes": int(params.get("cache_max_gib", CACHE_MAX_GIB) * 2**30),
    } | ({"window_check": True} if spec.get("unattended") else {})
    payload |= {"lock_format": "pylock"} if lock_format(spec["lock"]) == "pylock" else {}
    return payload | network_payload(params)


def built_of(answer, path):
    """The build script's answer when it built and swapped; its structured error as a RecoverError otherwise."""
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        return_text = answer.get("stderr_tail")
        raise VenvError(
            # The script's sentence quotes what uv or pip printed in the target: escaped, one line.
            f"building the venv failed ({printable(answer['error'], 40)}): {printable(answer.get('message'), 1000)}; "
            f"{path} was left as it was",
            kind=printable(answer["error"], 40),
            cmd=answer.get("cmd"),
            rc=answer.get("rc"),
            stderr=return_text if isinstance(return_text, str) else None,
            details={"cleaned": answer.get("cleaned") or [], "left_behind": answer.get("left_behind")},
        )
    if isinstance(answer, dict) and answer.get("pruned") is True:
        for key in ("removed", "retention_skipped"):
            if not isinstance(answer.get(key), list):
                raise VenvError(f"the build script answered no {key!r} in the expected shape", kind="probe")
        return answer
    if isinstance(answer, dict) and "needs_window" in answer:
        window = answer["needs_window"]
        users = window.get("users") if isinstance(window, dict) else None
        if not isinstance(users, list) or not all(isinstance(u, dict) and isinstance(u.get("pid"), int) for u in users):
            raise VenvError("the build script answered a needs_window of the wrong shape", kind="probe")
        return answer
    for key, kind in BUILT_KEYS.items():
        if not isinstance(answer, dict) or not isinstance(answer.get(key), kind):
            raise VenvError(f"the build script answered no {key!r} in the expected shape", kind="probe")
    cache = answer["cache"]
    own = cache.get("own_bytes")
    if not (isinstance(cache.get("path"), str) and isinstance(cache.get("dropped"), bool)) or not (
        own is None or (isinstance(own, int) and not isinstance(own, bool))
    ):
        raise VenvError("the build script answered a 'cache' of the wrong shape", kind="probe")
    return answer


def unproven(facts):
    """Why the venv is not the lock (one sentence), or ``""``: a venv that was just built must have no changes.

    Retention's lines do not count: a version a process started to use since is kept (``retention_skipped``)."""
    reasons = leftover(facts, ignore={prune_line(path, facts["keep"]) for path in facts["prune"]})
    if not reasons:
        return ""
    more = f" (and {len(reasons) - 5} more)" if len(reasons) > 5 else ""
    return f"the venv at {facts['path']} is still not the lock after the build: {'; '.join(reasons[:5])}{more}"


def swap_refused(before, built, label):
    """The result when the build script found a live process on the current venv just before the swap: nothing
    was swapped (the new version was removed), no change, the processes in ``needs_window``."""
    users = [
        {"pid": u["pid"], "ns_pid": u["pid"], "name": str(u.get("name")), "inside": True}
        for u in built["needs_window"]["users"]
    ]
    when = " (found when the new version was ready; that version was removed, nothing swapped)"
    sentence = window_message(label, before["path"], before["changes"], users, when)
    stays = before["diff"]["before"]
    return {
        **built_result(dict(before, in_use=users, needs_window=[sentence]), None, None),
        "changed": False,
        "changes": [],
        "diff": {"before": stays, "after": stays},
        "cleaned": built.get("cleaned") or [],
    }


def built_result(before, after, built):
    """What is installed from the last read (the first in check mode), what the build did."""
    facts = after or before
    built = built or {}
    return {
        "needs_window": before["needs_window"],
        "in_use": before["in_use"],
        "venv": before["path"],  # not "path": exit_json would add stats of the node's file of that name
        "current": built.get("current"),
        "previous": built.get("previous"),
        "builder": built.get("builder"),
        "lock_file": built.get("lock_file"),
        "cache": built.get("cache"),
        "cleaned": built.get("cleaned", []),
        "removed": built.get("removed", []),
        "retention_skipped": built.get("retention_skipped", []),
        "installed": facts["installed"],
        "missing": facts["missing"],
        "extra": facts["extra"],
        "wrong": facts["wrong"],
    }


def uv_from_wheel(wheel_path):
    """``(version, executable bytes)`` of PyPI's uv wheel, whose binary is ``uv-<version>.data/scripts/uv``."""
    try:
        with zipfile.ZipFile(wheel_path) as wheel:
            names = [n for n in wheel.namelist() if UV_IN_WHEEL.fullmatch(n)]
            if not names:
                raise VenvError(
                    f"{wheel_path} holds no uv-<version>.data/scripts/uv: give PyPI's uv wheel for this platform "
                    f"(uv-<version>-py3-none-manylinux_*_x86_64.whl)",
                    kind="uv_wheel",
                )
            return UV_IN_WHEEL.fullmatch(names[0]).group(1), wheel.read(names[0])
    except (OSError, zipfile.BadZipFile) as error:
        raise VenvError(f"cannot read the uv wheel {wheel_path}: {error}", kind="uv_wheel") from None


def install_uv(target, wheel_path):
    """Put the wheel's uv into the target where its file name says (``facts.wheel_uv_path``); return that path.

    Called only when the read found no uv of root's there (``uv_installed``): root's own file takes the place of
    whatever is there (a link is replaced, never written through). The read refused a place another user could
    change. Never a ``curl | sh``: the binary comes from the wheel the controller handed to the node, over the same
    ``pct exec`` as everything else. The temporary file is mktemp's (O_EXCL, a name nobody can guess).
    """
    version, binary = uv_from_wheel(wheel_path)
    if version != wheel_uv_version(wheel_path):  # the read looked where the name says
        raise VenvError(
            f"the uv wheel {wheel_path} is named for uv {wheel_uv_version(wheel_path)} but holds "
            f"uv-{version}.data/scripts/uv: give PyPI's uv wheel under its own file name",
            kind="uv_wheel",
        )
    path = wheel_uv_path(wheel_path)
    script = (
        'set -e; mkdir -p "${1%/*}"; t=$(mktemp "$1.XXXXXX"); cat > "$t"; chmod 755 "$t"; '
        'if [ -L "$1" ]; then rm -f "$1"; elif [ -d "$1" ]; then rm -f "$t"; echo "$1 is a directory" >&2; exit 1; fi; '
        'mv -f "$t" "$1"'
    )
    target.run(["sh", "-c", script, "sh", path], stdin=binary)
    return path


class TrainingVenv(ActingStep):
    """Read the venv, and when it is not the lock: build a new version beside it, check it, swap it in, read again
    (or only remove old versions beyond keep)."""

    facts = venv_facts
    error = VenvError  # argument_spec: the module's (library/training_venv.py)
    at_least = {
        "build_timeout": (1, "give the build at least 1 second"),
        "cache_max_gib": (0, "give 0 or more GiB (0 keeps no cache after a build)"),
    }
    progress = "starting the build"  # run as an async job (the role, for a build): followed as it runs

    def check_params(self, params):
        return (
            python_option_problem(params.get("python"))
            or build_from_source_problem(params.get("build_from_source"))
            or network_problem(params)
        )

    def evaluate(self, run, answer, done=None):
        if done is None:
            # The lock's text: the option's, or the one the probe read in the training repository at the pinned
            # commit (the build and the re-read use it too).
            run.spec = resolve_lock(run.spec, answer, may_defer=run.check_mode)[0]
        return super().evaluate(run, answer, done)

    def act(self, run, before):
        """One pct exec: build and swap (in spec: only remove old versions beyond keep), then the reader part reads
        the venv again through the new symlink. ``after`` is None when the build script found a live process on the
        current venv just before the swap (unattended: ``built`` then holds ``needs_window``)."""
        rebuild = before["rebuild"]
        payload = build_payload(run.spec, run.params, utc_stamp(), prune_only=not rebuild)
        if run.params["uv_wheel"] and rebuild:  # its uv, installed unless the read found root's there
            wheel = run.params["uv_wheel"]
            payload["uv"] = wheel_uv_path(wheel) if before["uv_installed"] else install_uv(run.target, wheel)
        parts = run.act_and_reread(BUILD, venv_script, payload, run.params["build_timeout"] + CLEANUP_GRACE)
        built = built_of(run.part(parts, BUILD), run.spec["path"])
        if "needs_window" in built:
            return built, None
        return built, self.evaluate(run, run.part(parts, NAME), built)

    def prove(self, run, after, done):
        details = {key: done.get(key) for key in ("current", "previous", "builder", "lock_file")}
        details.update({key: after[key] for key in ("installed", "missing", "extra", "wrong")})
        return unproven(after), details

    def result(self, run, before, after, done):
        if done is not None and "needs_window" in done:
            return swap_refused(before, done, run.target.label)
        return built_result(before, after, done)
