# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The compile cache step: is each torch.compile cache built for the torch, triton, CUDA and GPUs in use.

A cache root (TORCHINDUCTOR_CACHE_DIR, default ``/tmp/torchinductor_<user>``; TRITON_CACHE_DIR, default
``~<user>/.triton/cache``) holds a stamp, ``.pve-gpu-recover-stamp``: JSON naming the fingerprint the cache was
built for, ``{"torch": "2.11.0+cu128", "variant": "cu128", "cuda": "12.8", "triton": "3.3.0", "gpus": ["NVIDIA
H200"]}``. Per root: a stamp equal to the expected fingerprint is ``fresh`` (kept); another stamp is ``stale``
(purged, then stamped); no stamp is ``unstamped`` (adopted: stamped as it is) unless the venv is rebuilt in this
run, which makes every cache stale; an absent root is ``missing`` (nothing to do); a root that could take more
than a cache with it (:func:`refusal`), or that the probe could not open without trusting a user who could have
changed it (``unsafe``: a symlink on the way, a directory above it others may write, a root of another user in
``/tmp``), is ``refused``. A root refused by its setting stops the run before anything is deleted; one refused
for what was found at its path (``unsafe``, a file in its place, a symlink it resolves through: any user of the
target can make those) is refused alone (``alone``): left as it is, a warning (``warnings``), unattended a line of
``needs_window``, never a problem, no change, and no warm-up runs; the other roots are handled as usual.

Its probe part (``cache_probe``) reads the roots by ``lstat`` only, the stamps, the venv's
``torch/version.py`` and triton's METADATA (never ``import torch``), the users' homes and which live processes
use a root. Everything here is pure: the probe's answer and the facts of the steps before in, facts out.

A stale root that a live process uses (its cwd, an open or a mapped file in it; the GPU step's processes aside,
they are ended first) is never purged. Attended, that is a problem: the run stops before anything is deleted.
Unattended (``unattended``, the scheduled drift corrector), that root is left as it is (not purged, not stamped)
and named in ``needs_window``; the other roots are purged and stamped as usual, no warm-up runs (the caches it
would fill are in use) and the run does not fail for it.
"""

from __future__ import annotations

import re
import shlex

from ansible_collections.pve_gpu.recover.plugins.module_utils.nvidia_smi import (
    NvidiaSmiError,
    classify_failure,
    parse_gpus,
    query_gpu_argv,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_ct_fs import clean, inside, refusal
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_errors import RecoverError
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_target import ENV_NAME
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_text import printable
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_torch_build import cuda_of, variant
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import probe as cache_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.handoff import (
    ending_pids_of,  # pids the GPU step ends before this step runs
)

NAME = "compile_cache"
PROBE = cache_probe
STAMP_NAME = ".pve-gpu-recover-stamp"
# torch's and triton's own defaults, expanded inside the target for the user ({user}: its name, {home}: its home).
DEFAULT_ROOTS = ["/tmp/torchinductor_{user}", "{home}/.triton/cache"]  # noqa: S108 (torch's default, not ours)
SPEC = {
    # The user training runs as: names the default roots, and the warm-up runs as this user.
    "user": {"type": "str", "default": "root"},
    # The venv whose torch and triton the caches are for (read from its files, never imported).
    "venv": {"type": "path", "default": "/opt/venvs/train"},
    # The cache directories, `{user}`/`{home}` expanded in the target. The first is the warm-up's
    # TORCHINDUCTOR_CACHE_DIR. Only these are ever purged, and only inside them.
    "roots": {"type": "list", "elements": "str", "default": list(DEFAULT_ROOTS)},
    # The stamp's file name inside each root.
    "stamp_name": {"type": "str", "default": STAMP_NAME},
    # A command (argv) that compiles what training compiles first, run once after a purge; empty: no warm-up.
    "warmup": {"type": "list", "elements": "str", "default": []},
    "warmup_timeout": {"type": "int", "default": 900},
    # Environment of the warm-up, on top of what the step sets (it may not change TORCHINDUCTOR_COMPILE_THREADS).
    "warmup_env": {"type": "dict", "default": {}},
    # The scheduled drift corrector: a stale root in use is left for a window (needs_window), not a problem.
    "unattended": {"type": "bool", "default": False},
}
SPEC_DEFAULTS = {name: option.get("default") for name, option in SPEC.items()}
FINGERPRINT_KEYS = ("torch", "variant", "cuda", "triton", "gpus")
VERDICTS = ("fresh", "stale", "unstamped", "missing", "refused", "unknown")
THREADS = "TORCHINDUCTOR_COMPILE_THREADS"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
GPU_NAME_FIELDS = (("name", "name", "str"),)
_PLACEHOLDER = re.compile(r"\{[^{}]*\}")
_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\$?$")
REBUILT = "for the venv as rebuilt in this run"
STAMP_SHOWN = 100  # characters of one stamp value shown in a message
STAMP_GPUS = 16  # GPU models of one stamp shown in a message


class CacheError(RecoverError):
    """A cache root cannot be judged or acted on, or the probe answered something that is not its answer."""


# -- settings --------------------------------------------------------------------------------------------------
def check_spec(spec):
    """Why the step's settings cannot work (one sentence), or ``""``: called once the SPEC types are checked."""
    if not _USER.match(spec["user"]):
        return f"user is {spec['user']!r}, which is not a user name"
    if not spec["venv"].startswith("/"):
        return f"venv is {spec['venv']!r}; give the venv's absolute path inside the target"
    name = spec["stamp_name"]
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        return f"stamp_name is {name!r}; give a plain file name such as {STAMP_NAME}"
    return _check_roots(spec["roots"]) or _check_warmup(spec)


def _check_roots(roots):
    if not roots:
        return "roots is empty; give the cache directories (default: /tmp/torchinductor_{user}, {home}/.triton/cache)"
    for root in roots:
        unknown = [p for p in _PLACEHOLDER.findall(root) if p not in ("{user}", "{home}")]
        if unknown:
            return f"the root {root!r} uses {unknown[0]}; only {{user}} and {{home}} are expanded"
        if not root.startswith(("/", "{home}")) or "\0" in root:
            return f"the root {root!r} is not an absolute path (nor one that starts with {{home}})"
    return ""


def _check_warmup(spec):
    if spec["warmup"] and not spec["warmup"][0]:
        return "warmup starts with an empty command name"
    if spec["warmup_timeout"] < 1:
        return f"warmup_timeout is {spec['warmup_timeout']}; give the warm-up at least 1 second"
    for key, value in (spec["warmup_env"] or {}).items():
        if not ENV_NAME.match(str(key)):
            return f"warmup_env has {key!r}, which is not an environment variable name"
        if isinstance(value, (dict, list)) or value is None:
            return f"warmup_env's {key} is {value!r}; give a string"
        if key == THREADS:
            return f"warmup_env sets {THREADS}; the warm-up compiles single-threaded ({THREADS}=1) by design"
    return ""


# -- fingerprints ----------------------------------------------------------------------------------------------
def make_fingerprint(torch, cuda, triton, gpus):
    """``("2.11.0+cu128", "12.8", "3.3.0", ["NVIDIA H200", "NVIDIA H200"])`` -> ``{"torch": "2.11.0+cu128",
    "variant": "cu128", "cuda": "12.8", "triton": "3.3.0", "gpus": ["NVIDIA H200"]}``: the GPU models sorted,
    once each (a kernel is built for a model, not for a count)."""
    return {"torch": torch, "variant": variant(torch), "cuda": cuda, "triton": triton, "gpus": sorted(set(gpus))}


def normalized(fingerprint):
    """A stamp's fingerprint in the form :func:`make_fingerprint` gives (unknown keys dropped, GPUs sorted).

    A stamp is written by the cache user (not trusted): a value that is neither a string nor None becomes the
    name of its type (``<int>``), so what is compared and shown is always text; :func:`describe` escapes it."""
    found = {key: _stamp_value(fingerprint.get(key)) for key in FINGERPRINT_KEYS if key != "gpus"}
    gpus = fingerprint.get("gpus")
    found["gpus"] = (
        sorted(set(gpus)) if isinstance(gpus, list) and all(isinstance(g, str) for g in gpus) else _stamp_value(gpus)
    )
    return {key: found[key] for key in FINGERPRINT_KEYS}


def _stamp_value(value):
    """A stamp's value as the node keeps it: a string or None as it is, anything else its type's name."""
    return value if value is None or isinstance(value, str) else f"<{type(value).__name__}>"


def shown(value):
    """A fingerprint's value in a message: one line, at most STAMP_SHOWN characters (printable); a value that is
    no string is named by its type (``<dict>``): a stamp is the cache user's text, never the node's."""
    return printable(_stamp_value(value), STAMP_SHOWN)


def describe(fingerprint):
    """``torch 2.11.0+cu128 (CUDA 12.8), triton 3.3.0, NVIDIA H200``; ``torch 2.13.0+cpu (no CUDA), no triton,
    no GPU``. Every value passes through :func:`shown` (a stamp's ``"2.0\\n..."`` stays on its line)."""
    torch = fingerprint.get("torch")
    cuda = fingerprint.get("cuda")
    head = f"torch {shown(torch)} ({f'CUDA {shown(cuda)}' if cuda else 'no CUDA'})" if torch else "no torch"
    triton = f"triton {shown(fingerprint['triton'])}" if fingerprint.get("triton") else "no triton"
    return f"{head}, {triton}, {_gpus_shown(fingerprint.get('gpus')) or 'no GPU'}"


def _gpus_shown(gpus):
    """``NVIDIA H200, NVIDIA H100``; a value that is no list: :func:`shown`; ``""`` for none."""
    if isinstance(gpus, list):
        return ", ".join(shown(g) for g in gpus[:STAMP_GPUS]) + (" and more" if len(gpus) > STAMP_GPUS else "")
    return shown(gpus) if gpus else ""


def differences(stamped, expected):
    """What a stale stamp was built for, against now: ``stamped for torch 2.11.0+cu130, now 2.11.0+cu128``."""
    stamped, expected = normalized(stamped), normalized(expected)
    parts = []
    if stamped["torch"] != expected["torch"]:
        parts.append(f"torch {shown(stamped['torch']) or 'none'}, now {shown(expected['torch']) or 'none'}")
    elif stamped["cuda"] != expected["cuda"]:
        parts.append(f"CUDA {shown(stamped['cuda']) or 'none'}, now {shown(expected['cuda']) or 'none'}")
    if stamped["triton"] != expected["triton"]:
        parts.append(f"triton {shown(stamped['triton']) or 'none'}, now {shown(expected['triton']) or 'none'}")
    if stamped["gpus"] != expected["gpus"]:
        parts.append(f"GPUs {_gpus_shown(stamped['gpus']) or 'none'}, now {_gpus_shown(expected['gpus']) or 'none'}")
    return "stamped for " + ("; ".join(parts) if parts else f"another fingerprint ({describe(stamped)})")


def human_size(size):
    """``152000000`` -> ``152 MB``; ``0`` -> ``0 bytes`` (decimal units, like ``du --si``)."""
    if size < 1000:
        return "1 byte" if size == 1 else f"{size} bytes"
    for unit, scale in (("kB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        if size < scale * 1000 or unit == "GB":
            shown = size / scale
            return f"{shown:.1f} {unit}" if shown < 10 else f"{shown:.0f} {unit}"
    return f"{size} bytes"  # pragma: no cover


# -- safety ----------------------------------------------------------------------------------------------------
def settings_refusal(root, homes, user):
    """Why the probe's ``root`` is refused by its path alone, as the settings name it (:func:`refusal`), or None."""
    if root["path"] is None:
        return f"its template {root['template']} needs the home directory of {user}, who has none"
    why = refusal(root.get("expanded") or root["path"], homes)
    return printable(why) if why else None  # names a path and users the target chose


def root_refusal(root, homes, user):
    """Why the probe's ``root`` is refused, or None: its path, then the directory it resolves to, must pass
    :func:`refusal` (the rules live in the probe part, which walks no refused root, and again in the acting
    script, which checks them before it touches a root); it must be a directory when it exists, and the probe must
    have opened it safely (``unsafe``: a symlink on the way, or a directory another user could have put there).
    Past :func:`settings_refusal`, each reason is what was found at the path (:func:`judge_root`: ``alone``)."""
    why = settings_refusal(root, homes, user)
    if why:
        return why
    real = root["real_path"]
    if real and real != root["path"]:
        why = refusal(real, homes)
        if why:
            return printable(f"it resolves through a symlink to {real}, and {why.removeprefix('it ')}")
    if root["exists"] and not root["is_dir"]:
        return "it is not a directory"
    if root.get("unsafe"):
        return printable(root["unsafe"])  # the probe could not open it from / without trusting another user
    return None


def overlap_refusals(roots, reasons):
    """Roots that are, or lie inside, another accepted root: refused (purging the outer one purges them)."""
    accepted = [(i, r) for i, r in enumerate(roots) if reasons[i] is None and r["real_path"]]
    for i, root in accepted:
        for j, other in accepted:
            if i == j or reasons[i] is not None:
                continue
            if root["real_path"] == other["real_path"] and j < i:
                reasons[i] = f"it is the same directory as the root {printable(other['path'])}"
            elif root["real_path"] != other["real_path"] and inside(root["real_path"], other["real_path"]):
                reasons[i] = f"it lies inside the root {printable(other['path'])}; give only that one"
    return reasons


# -- the probe's answer ----------------------------------------------------------------------------------------
_ANSWER_TYPES = {"user": dict, "homes": dict, "venv": dict, "roots": list, "users": dict, "errors": list}
_ROOT_TYPES = {"exists": bool, "is_dir": bool, "is_link": bool}


def check_answer(answer, spec):
    """The probe's answer comes from inside a CT: a part that is not what the probe prints is a CacheError, named
    (``the target's answer to the compile_cache probe is not in the expected shape: ...``), never a traceback
    further on (an ``int()`` of a forged ``"12abc"``)."""
    if not isinstance(answer, dict):
        raise CacheError("the compile_cache probe answered no object", kind="probe")
    for key, kind in _ANSWER_TYPES.items():
        if not isinstance(answer.get(key), kind):
            raise CacheError(f"the compile_cache probe answered no {key!r} ({kind.__name__})", kind="probe")
    if len(answer["roots"]) != len(spec["roots"]):
        raise CacheError("the compile_cache probe answered another number of roots than it was asked", kind="probe")
    wrong = _answer_shape(answer)
    if wrong:
        raise CacheError(
            f"the target's answer to the compile_cache probe is not in the expected shape: {printable(wrong, 200)}",
            kind="probe",
        )
    for root in answer["roots"]:
        _check_root_types(root)
        wrong = _root_shape(root)
        if wrong:
            raise CacheError(
                f"the target's answer to the compile_cache probe is not in the expected shape: root "
                f"{printable(root.get('template'), 200)}: {printable(wrong, 200)}",
                kind="probe",
            )


def _check_root_types(root):
    if not isinstance(root, dict) or any(not isinstance(root.get(k), t) for k, t in _ROOT_TYPES.items()):
        raise CacheError(f"the compile_cache probe answered a root of the wrong shape: {root!r}", kind="probe")
    for key in ("path", "real_path", "unsafe"):
        if root.get(key) is not None and not isinstance(root[key], str):
            raise CacheError(f"the compile_cache probe answered a root whose {key} is no string", kind="probe")
    for key in ("stamp", "walk"):
        if root.get(key) is not None and not isinstance(root[key], dict):
            raise CacheError(f"the compile_cache probe answered a root whose {key} is no object", kind="probe")
    found = root.get("id")
    if found is not None and (not isinstance(found, list) or len(found) != 2 or not all(_is_int(n) for n in found)):
        raise CacheError("the compile_cache probe answered a root whose id is not [st_dev, st_ino]", kind="probe")


_WALK_COUNTS = ("size_bytes", "files", "entries", "escapes_count")
_STRING_LISTS = {"mounts": "a list of paths"}
_DICT_LISTS = {"escapes": ("link", "target"), "left": ("path", "why")}


def _answer_shape(answer):
    """What is wrong with the answer's users, homes and errors (``""``: nothing)."""
    user = answer["user"]
    for key in ("name", "home"):
        if user.get(key) is not None and not isinstance(user[key], str):
            return f"user {key} {user[key]!r} is no string"
    for key in ("uid", "gid"):
        if user.get(key) is not None and not _is_int(user[key]):
            return f"user {key} {user[key]!r} is no number"
    for home, names in answer["homes"].items():
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return f"homes[{home!r}] is {names!r}, not a list of user names"
    for real, users in answer["users"].items():
        if not isinstance(users, list) or not all(
            isinstance(u, dict)
            and _is_int(u.get("pid"))
            and isinstance(u.get("how"), list)
            and all(isinstance(h, str) for h in u["how"])
            for u in users
        ):
            return f"users[{real!r}] is {users!r}, not a list of processes ({{pid, name, how}})"
    if not all(isinstance(e, str) for e in answer["errors"]):
        return f"errors is {answer['errors']!r}, not a list of sentences"
    return _warmup_shape(answer.get("warmup"))


def _warmup_shape(found):
    """What is wrong with the answer's warm-up command (``""``: nothing, or no such part)."""
    if found is None:
        return ""
    if not isinstance(found, dict) or found.get("state") not in WARMUP_STATES:
        return f"warmup is {found!r}, not what read_warmup answers"
    for key in ("file", "mode", "interpreter"):
        if found.get(key) is not None and not isinstance(found[key], str):
            return f"warmup {key} is {found[key]!r}, not a string"
    if found.get("interpreter_state") not in (None, *WARMUP_STATES):
        return f"warmup interpreter_state is {found['interpreter_state']!r}"
    return ""


def _root_shape(root):
    """What is wrong with a root's walk and stamp (``""``: nothing): counts are counts, lists hold what the probe
    puts in them, a readable stamp names a fingerprint object."""
    walk = root.get("walk") or {}
    for key in _WALK_COUNTS:
        if walk.get(key) is not None and not (_is_int(walk[key]) and walk[key] >= 0):
            return f"walk {key} is {walk[key]!r}, not a count"
    for key, what in _STRING_LISTS.items():
        value = walk.get(key)
        if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
            return f"walk {key} is {value!r}, not {what}"
    for key, fields in _DICT_LISTS.items():
        value = walk.get(key)
        if value is not None and (
            not isinstance(value, list)
            or not all(isinstance(v, dict) and all(isinstance(v.get(f), str) for f in fields) for v in value)
        ):
            return f"walk {key} is {value!r}, not a list of {{{', '.join(fields)}}}"
    stamp = root.get("stamp") or {}
    if stamp and stamp.get("state") not in ("none", "ok", "invalid"):
        return f"stamp state is {stamp.get('state')!r}"
    if stamp.get("state") == "ok" and not isinstance(stamp.get("fingerprint"), dict):
        return f"stamp fingerprint is {stamp.get('fingerprint')!r}, not an object"
    if stamp.get("reason") is not None and not isinstance(stamp["reason"], str):
        return f"stamp reason is {stamp['reason']!r}, not a sentence"
    return ""


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def venv_fingerprint(answer, gpus):
    """The fingerprint of the venv the probe read, or None when it has no torch/version.py."""
    venv = answer["venv"]
    version_py = venv.get("torch_version_py") or {}
    if not isinstance(version_py, dict) or not version_py.get("version"):
        return None
    triton = venv.get("triton") if isinstance(venv.get("triton"), dict) else {}
    return make_fingerprint(str(version_py["version"]), version_py.get("cuda"), triton.get("version"), gpus)


def gpu_names_read(answer):
    """``(names, problem)`` from the nvidia-smi answer of the module's probe: none asked or no nvidia-smi (a CPU
    host) gives no GPU; a failing nvidia-smi is a problem."""
    smi = answer.get("gpus")
    if not isinstance(smi, dict) or smi.get("missing"):
        return [], None
    failure = classify_failure(smi.get("rc"), smi.get("stdout") or "", smi.get("stderr") or "")
    if failure is None:
        try:
            return [g["name"] for g in parse_gpus(smi.get("stdout") or "", GPU_NAME_FIELDS)], None
        except NvidiaSmiError as error:
            failure = error
    return [], f"the GPU names cannot be read from nvidia-smi: {failure}"


def gpu_names_of(context):
    """The GPU models preflight found (the fact pass asks nvidia-smi once, in preflight's part)."""
    preflight = context["steps"].get("preflight") or {}
    return [g.get("name") for g in preflight.get("gpus") or [] if isinstance(g.get("name"), str)]


def venv_plan_of(spec, context):
    """``(pending, lock torch)`` of the training venv step when it is in the pass for this very venv."""
    facts = context["steps"].get("training_venv")
    if not isinstance(facts, dict) or facts.get("error") or facts.get("path") != spec["venv"]:
        return False, None
    lock = facts.get("lock") or {}
    return bool(facts.get("pending")), lock.get("torch")


# -- judging ---------------------------------------------------------------------------------------------------
def judge_root(root, expected, venv_changes, reason, *, alone=False):
    """One root's facts and verdict (``reason`` is its refusal, or None). A refused root has ``alone``: refused for
    what was found at its path (a symlink on the way or one it resolves through, a directory above it others may
    write, a root squatted in ``/tmp``, a file in its place: a user of the target other than root may have put
    it there), not by the settings (:func:`settings_refusal`, an overlap of two roots); the run goes on without
    it."""
    walked = root.get("walk") or {}
    stamp = root.get("stamp") or {}
    facts = {
        "path": root["path"] or root.get("expanded") or root["template"],
        "real_path": root["real_path"],
        "exists": root["exists"],
        "size_bytes": int(walked.get("size_bytes") or 0),
        "files": int(walked.get("files") or 0),
        "entries": int(walked.get("entries") or 0),
        "stamp": normalized(stamp["fingerprint"]) if stamp.get("state") == "ok" else None,
        "stamp_error": printable(stamp.get("reason"), STAMP_SHOWN) if stamp.get("state") == "invalid" else None,
        "escapes": walked.get("escapes") or [],
        "escapes_count": int(walked.get("escapes_count") or 0),
        "mounts": walked.get("mounts") or [],
        "left": walked.get("left") or [],
        "id": root.get("id"),
        "busy": [],
    }
    if reason:
        return dict(facts, verdict="refused", reason=reason, alone=alone)
    if not root["exists"]:
        return dict(facts, verdict="missing", reason="it does not exist; nothing to do")
    if expected is None:
        return dict(facts, verdict="unknown", reason="the expected fingerprint cannot be read")
    if venv_changes:
        if facts["stamp"] is not None:
            was = f"stamped for {describe(facts['stamp'])}"
        elif facts["stamp_error"]:
            was = f"its stamp cannot be used: {facts['stamp_error']}"
        else:
            was = "unstamped"
        return dict(facts, verdict="stale", reason=f"the venv is rebuilt in this run; {was}")
    if facts["stamp"] is not None:
        if facts["stamp"] == normalized(expected):
            return dict(facts, verdict="fresh", reason=f"stamped for {describe(expected)}")
        return dict(facts, verdict="stale", reason=differences(facts["stamp"], expected))
    if facts["stamp_error"]:
        return dict(facts, verdict="stale", reason=f"its stamp cannot be used: {facts['stamp_error']}")
    return dict(facts, verdict="unstamped", reason=f"no stamp: adopted as built for {describe(expected)}")


def describe_users(users):
    """``pid 4711 (python3: cwd, open), pid 12 (sh: cwd)``."""
    return ", ".join(f"pid {u['pid']} ({printable(u.get('name'))}: {', '.join(u.get('how') or [])})" for u in users)


def purge_line(root):
    """``purge PATH (reason; size; what it leaves)``: every name the target chose passes through printable()."""
    notes = [root["reason"]]
    if root["real_path"] and root["real_path"] != root["path"]:
        notes.append(f"a symlink to {printable(root['real_path'])}")
    notes.append(human_size(root["size_bytes"]))
    if root["escapes_count"]:
        shown = ", ".join(f"{_shown(e, 'link')} -> {_shown(e, 'target')}" for e in root["escapes"][:3])
        more = f" and {root['escapes_count'] - 3} more" if root["escapes_count"] > 3 else ""
        notes.append(f"symlinks out of it removed, never followed: {shown}{more}")
    if root["mounts"]:
        notes.append(f"left alone, another mount: {', '.join(map(printable, root['mounts'][:3]))}")
    if root["left"]:
        shown = "; ".join(f"{_shown(d, 'path')} ({_shown(d, 'why')})" for d in root["left"][:3])
        notes.append(f"left alone: {shown}")
    if root["busy"]:
        notes.append(f"in use by {describe_users(root['busy'])}, which the GPU step ends first")
    return f"purge {printable(root['path'])} ({'; '.join(notes)})"


def _shown(entry, key):
    """``entry[key]`` of an answer's list, printable (the probe's answer comes from inside the target)."""
    return printable(entry.get(key) if isinstance(entry, dict) else entry)


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


def diff_lines(roots, expected, venv_changes, warmup):
    """``(before, after)``: one line per root, its stamp's fingerprint before and the expected one after."""
    before, after = [], []
    target = REBUILT if venv_changes else (describe(expected) if expected else None)
    for root in roots:
        verdict = root["verdict"]
        if verdict == "refused":
            state = f"refused ({root['reason']})"
        elif verdict == "missing":
            state = "missing"
        elif root["stamp"] is not None:
            state = describe(root["stamp"])
        elif root["stamp_error"]:
            state = f"stamp unusable ({root['stamp_error']})"
        else:
            state = "unstamped"
        if verdict in ("fresh", "stale", "unstamped") and not root.get("window"):
            new = target
        elif verdict == "missing" and warmup and target:
            new = f"{target} (if the warm-up fills it)"
        else:
            new = state
        before.append(f"{printable(root['path'])}: {state}\n")
        after.append(f"{printable(root['path'])}: {new}\n")
    return "".join(before), "".join(after)


def window_line(label, root):
    """The one sentence of a stale root an unattended run leaves because a live process uses it."""
    users = f"in use by {describe_users(root['live'])}" if root["live"] else "in use by a live process"
    return (
        f"{label}: compile cache {printable(root['path'])} is stale ({root['reason']}; "
        f"{human_size(root['size_bytes'])}) but "
        f"{users}: not purged under a live process; purging it needs a window (stop the job, or run recover.yml "
        "without recover_unattended)"
    )


def refused_line(label, root, warmup):
    """The one sentence of a root refused alone (:func:`judge_root`): shown as a warning, and unattended named in
    ``needs_window``; the run goes on with the other roots."""
    skipped = "; no warm-up runs while it is refused" if warmup else ""
    return (
        f"{label}: compile cache root {printable(root['path'])} refused: {root['reason']}; it is left as it is "
        f"(neither purged nor stamped), the other roots are handled as usual{skipped}; another user of the target may "
        "have put it there: remove it in the target, or set compile_cache_roots to a directory only root and "
        "compile_cache_user can write"
    )


def in_use(roots, users, ending, label, problems, *, unattended, window):
    """Sort the stale roots by the live processes that use them; returns the roots left for a window.

    Each stale root gets ``busy`` (users the GPU step ends first: purged after them). A root with other live
    users is a problem (appended to ``problems``), or, ``unattended``, left as it is: ``window`` true and ``live``
    its users; so is a root whose real path is in ``window`` (the acting script left it).
    """
    waiting = []
    for root in (r for r in roots if r["verdict"] == "stale"):
        found = [u for u in users.get(root["real_path"]) or [] if isinstance(u, dict)]
        root["busy"] = [u for u in found if u.get("pid") in ending]
        live = [u for u in found if u.get("pid") not in ending]
        if unattended and (live or root["real_path"] in window):
            root.update(live=live, window=True)
            waiting.append(root)
        elif live:
            problems.append(
                f"{label}: cannot purge {printable(root['path'])}: in use by {describe_users(live)}; a purge never "
                "runs under a live process (a running compile): stop it and run again"
            )
    return waiting


def judge(spec, answer, label, *, expected, expected_from, venv_changes, ending, extra_problems=(), window=()):
    """The step's facts from the probe's answer and the expected fingerprint; shared by the fact pass and the
    module. ``ending``: pids the GPU step ends first (a root they use is purged after them). ``window``: real
    paths the acting script found in use and left (unattended), judged as needing a window whoever uses them now.
    """
    user = answer["user"]
    homes = {clean(h): list(u) for h, u in answer["homes"].items() if isinstance(h, str) and h.startswith("/")}
    if user.get("home") and clean(user["home"]) not in homes:
        homes[clean(user["home"])] = [spec["user"]]
    reasons = [root_refusal(root, homes, spec["user"]) for root in answer["roots"]]
    alone = [
        bool(why) and not settings_refusal(r, homes, spec["user"])
        for r, why in zip(answer["roots"], reasons, strict=True)
    ]
    reasons = overlap_refusals(answer["roots"], reasons)
    roots = [
        judge_root(r, expected, venv_changes, why, alone=lone)
        for r, why, lone in zip(answer["roots"], reasons, alone, strict=True)
    ]
    problems = [f"{label}: the compile_cache probe could not read everything: {e}" for e in answer["errors"]]
    problems += list(extra_problems)
    if not user.get("exists"):
        problems.append(
            f"{label}: the compile cache user {spec['user']} does not exist in the target; set compile_cache_user "
            "to the user training runs as"
        )
    for root in roots:
        if root["verdict"] == "refused" and not root["alone"]:
            problems.append(
                f"{label}: compile cache root {printable(root['path'])} refused: {root['reason']}; nothing is deleted "
                "(compile_cache_roots must name the cache directories themselves, like /tmp/torchinductor_root)"
            )
    if expected is None and user.get("exists"):
        venv = answer["venv"]
        found = "no venv" if not venv.get("exists") else "a venv without torch/version.py"
        problems.append(
            f"{label}: {spec['venv']} is {found}, so the caches cannot be judged; set compile_cache_venv to the "
            "venv training runs in"
        )
    waiting = in_use(
        roots, answer["users"], set(ending), label, problems, unattended=spec.get("unattended"), window=window
    )
    purging = [r for r in roots if r["verdict"] == "stale" and not r.get("window")]
    if purging and answer.get("users_partial"):
        problems.append(
            f"{label}: cannot tell whether a live process uses a cache to purge: the process scan ran out of time; "
            "raise compile_cache_timeout"
        )
    existing = [r for r in roots if r["verdict"] != "refused"]
    cold = all(r["verdict"] in ("missing", "stale") or r["entries"] == 0 for r in existing)
    warmup = bool(spec["warmup"]) and expected is not None and bool(existing) and (bool(purging) or cold)
    warmup = warmup and not waiting  # never a compile while a live process uses the caches it would fill
    # Nor while a root is refused alone: the warm-up's first root may be it, and what it fills is stamped as root.
    alone = [r for r in roots if r["verdict"] == "refused" and r["alone"]]
    warmup = warmup and not alone
    if warmup:  # a warm-up that cannot start stops the run before anything is purged
        missing = warmup_problem(label, spec, answer.get("warmup"), venv_changes)
        if missing:
            problems.append(missing)
    refused_lines = [refused_line(label, root, bool(spec["warmup"])) for root in alone]
    changes = []
    for root in roots:
        if root["verdict"] == "stale" and not root.get("window"):
            changes.append(purge_line(root))
            changes.append(
                f"stamp {printable(root['path'])} {REBUILT if venv_changes else 'for ' + describe(expected)}"
            )
        elif root["verdict"] == "unstamped":
            changes.append(
                f"stamp {printable(root['path'])} ({root['reason'].replace('no stamp: ', 'unstamped: ')}; "
                f"{human_size(root['size_bytes'])})"
            )
    if warmup:
        changes.append(warmup_line(spec))
    before, after = diff_lines(roots, expected, venv_changes, warmup)
    return {
        "needs_window": [window_line(label, root) for root in waiting]
        + (refused_lines if spec.get("unattended") else []),
        # Roots refused alone: a warning every run (the fact pass and the module show them); not a problem.
        "warnings": refused_lines,
        "user": spec["user"],
        "home": user.get("home"),
        "venv": spec["venv"],
        "expected": expected,
        "expected_from": expected_from,
        "venv_changes": venv_changes,
        "roots": roots,
        # problem false: refused alone (judge_root), the run goes on; true: the settings are wrong, the run stops.
        "refused": [
            {"path": r["path"], "reason": r["reason"], "problem": not r["alone"]}
            for r in roots
            if r["verdict"] == "refused"
        ],
        "warmup": {"argv": spec["warmup"], "timeout": spec["warmup_timeout"], "planned": warmup}
        if spec["warmup"]
        else None,
        "ending_pids": sorted(ending),
        # Processes whose cwd/fds/maps could not be read (another user namespace): a purge cannot vouch for them.
        "processes_unreadable": int(answer.get("unreadable_processes") or 0),
        "processes_partial": bool(answer.get("users_partial")),
        "size_bytes": sum(r["size_bytes"] for r in roots),
        "changes": changes,
        "problems": problems,
        "diff": {"before": before, "after": after},
        "pending": bool(changes) and not problems,
    }


def evaluate_step(spec, answer, node, context):
    """The compile cache facts of the fact pass.

    The expected fingerprint: torch's build and CUDA from the venv's torch/version.py, triton from its METADATA
    (what the acting module reads too), the GPU models from preflight. When the training venv step is in the pass
    for this venv and will rebuild it, the lock's torch names what is expected (its CUDA from the build variant,
    triton unknown until the rebuild) and every cache is stale: none is kept or adopted.
    """
    label = context["target"]["label"]
    check_answer(answer, spec)
    gpus = gpu_names_of(context)
    venv_changes, lock_torch = venv_plan_of(spec, context)
    if venv_changes:
        expected = make_fingerprint(lock_torch, cuda_of(variant(lock_torch)), None, gpus)
        expected_from = "training_venv lock (the venv is rebuilt in this run)"
    else:
        expected = venv_fingerprint(answer, gpus)
        expected_from = "venv"
    return judge(
        spec,
        answer,
        label,
        expected=expected,
        expected_from=expected_from,
        venv_changes=venv_changes,
        ending=ending_pids_of(context),
    )


def module_facts(spec, answer, label, *, venv_pending=False, ending=(), window=()):
    """The same facts for the acting module, from its own probe read (GPU names from its own nvidia-smi);
    ``window``: real paths the acting script left in use (see :func:`judge`)."""
    check_answer(answer, spec)
    gpus, problem = gpu_names_read(answer)
    return judge(
        spec,
        answer,
        label,
        expected=venv_fingerprint(answer, gpus),
        expected_from="venv",
        venv_changes=venv_pending,
        ending=ending,
        extra_problems=[f"{label}: {problem}"] if problem else [],
        window=window,
    )


# -- the fact pass ---------------------------------------------------------------------------------------------
def probe_payload(spec, timeout=60, *, gpus=False):
    """What the probe part reads inside the target; ``gpus`` adds the nvidia-smi query of the GPU names (the
    fact pass has them from preflight)."""
    return {
        "user": spec["user"],
        "venv": spec["venv"],
        "roots": list(spec["roots"]),
        "stamp_name": spec["stamp_name"],
        "timeout": timeout,
        "nvidia_smi_argv": query_gpu_argv(GPU_NAME_FIELDS) if gpus else None,
    } | (
        # Where the warm-up's command would be found: a warm-up that cannot start fails before any purge.
        {"warmup": {"command": spec["warmup"][0], "path": warmup_environment(spec, None, "")["PATH"]}}
        if spec["warmup"]
        else {}
    )


def read_node(spec, target, answer, context):
    """Nothing on the node: the caches live inside the target."""
    return {}


# -- acting ----------------------------------------------------------------------------------------------------
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


def act_payload(spec, facts, answer, timeout):
    """What the acting script needs: each root's action, the fingerprint to stamp, the warm-up."""
    actions = {"stale": "purge", "unstamped": "stamp"}  # a root that needs a window: no action
    user = answer["user"]
    warmup = None
    if facts["warmup"] and facts["warmup"]["planned"]:
        home = user.get("home")
        warmup = {
            "argv": list(spec["warmup"]),
            "env": warmup_environment(spec, home, facts["roots"][0]["path"]),
            "timeout": spec["warmup_timeout"],
            "cwd": home or "/",
            "user": spec["user"],
            "uid": user.get("uid"),
            "gid": user.get("gid"),
        }
    return {
        "roots": [
            {
                "path": r["path"],
                "real_path": r["real_path"],
                "id": r["id"],  # the script acts only on the very directory judged here
                "action": None if r.get("window") else actions.get(r["verdict"]),
            }
            for r in facts["roots"]
        ],
        "fingerprint": facts["expected"],
        "stamp_name": spec["stamp_name"],
        "homes": answer["homes"],
        "uid": user.get("uid"),
        "warmup": warmup,
        "timeout": timeout,
    } | ({"unattended": True} if spec.get("unattended") else {})
