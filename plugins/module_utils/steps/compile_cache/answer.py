# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The compile cache probe's answer checked: it comes from inside a CT, so a part that is not what the probe
prints is a CacheError (the step's error) naming what is wrong, never a traceback further on; pure.
"""

from __future__ import annotations

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.errors import RecoverError
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.text import printable
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache.warmup import WARMUP_STATES


class CacheError(RecoverError):
    """A cache root cannot be judged or acted on, or the probe answered something that is not its answer."""


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
    unreadable = answer.get("unreadable_processes", [])
    if not isinstance(unreadable, list) or not all(
        isinstance(u, dict)
        and _is_int(u.get("pid"))
        and isinstance(u.get("name"), str)
        and isinstance(u.get("error"), str)
        for u in unreadable
    ):
        return f"unreadable_processes is {unreadable!r}, not a list of processes ({{pid, name, error}})"
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
