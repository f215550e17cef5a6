# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The training code step's acting module, on the node: read the repository, and when it is not at the commit and
clean, run the reset script (script.py) and read again in the same ``pct exec`` (node/act_runner.py owns the
sequence). library/training_code.py is its documentation, its argument spec and ``run_step_module``.
"""

from __future__ import annotations

import re

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.act_runner import (
    ActingStep,
    leftover,
    utc_stamp,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.text import printable
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import facts as code_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import script as code_script
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code.facts import (
    MIB,
    CodeError,
    reset_answer_shape,
    short,
    window_message,
)

# The pct exec of a reset gets reset_timeout, the re-read's timeout and this much more, so that the script's own
# deadline fires first and it can still answer: 10 s, and the grace a checkout started in time gets beyond it.
GRACE = 10 + int(code_script.GRACE)
# Backups an unattended run keeps when backup_keep is unset: a timer that resets a drifting repository every night
# must not fill the disk; an attended run keeps every one unless told.
UNATTENDED_KEEP = 10
# What the reset script answers on success, and the type of each key (its answer comes from inside the CT).
ERROR_KIND = re.compile(r"[a-z_]{1,32}")
DONE_KEYS = {"head": str, "fetched": bool, "removed": list, "pruned": list, "backup": (dict, type(None))}
DONE_KEYS.update({"kept_ref": (str, type(None)), "head_before": (str, type(None)), "branch_before": (str, type(None))})


def backups_kept(params):
    """How many backups the reset keeps (None: every one): ``backup_keep`` (0: every one), else 10 unattended.

    ``{"backup_keep": None, "unattended": True}`` -> ``10``; ``{"backup_keep": None, "unattended": False}`` ->
    ``None``; ``{"backup_keep": 0, ...}`` -> ``None``; ``{"backup_keep": 3, ...}`` -> ``3``."""
    keep = params.get("backup_keep")
    if keep is None:
        return UNATTENDED_KEEP if params.get("unattended") else None
    return keep or None


def reset_payload(spec, params, stamp):
    """What the reset script needs: ``{"path", "commit", "remote", "backup_dir", "git", "stamp", "timeout",
    "keep", "min_free", "window_check"}``."""
    return {
        "path": spec["path"],
        "commit": spec["commit"].lower(),
        "remote": spec["remote"] or None,
        "backup_dir": spec["backup_dir"],
        "git": spec["git"],
        "stamp": stamp,
        "timeout": params["reset_timeout"],
        "keep": backups_kept(params),
        "min_free": spec["backup_min_free_mib"] * MIB,
        "window_check": bool(spec.get("unattended")),
    }


def failure_tail(answer, path):
    """What the failed reset left: the tree as it was, or where the saved changes are."""
    backup = answer.get("backup")
    if not answer.get("touched"):
        return f"{path} was left as it was"
    if backup:
        return f"the local changes are saved in {backup} ({backup}/RESTORE.txt says how to put them back)"
    return f"{path} had no local change to lose; run again"


def window_of(answer):
    """The users of a ``needs_window`` answer (the script found a live process just before the reset), checked
    for shape (it comes from inside the CT); a CodeError when it is not one."""
    users = answer["needs_window"].get("users") if isinstance(answer["needs_window"], dict) else None
    if not isinstance(users, list) or not users:
        raise CodeError("the reset script answered needs_window without its users", kind="probe")
    for user in users:
        if not (
            isinstance(user, dict)
            and isinstance(user.get("pid"), int)
            and isinstance(user.get("name"), str)
            and (isinstance(user.get("file"), str) if user.get("how") else isinstance(user.get("error"), str))
        ):
            raise CodeError("the reset script answered a needs_window user in another shape", kind="probe")
    return [dict(user, ns_pid=user["pid"]) for user in users]


def done_of(answer, path):
    """The reset script's answer when it reset (or found a live job just before: ``needs_window``); its structured
    error as a CodeError otherwise."""
    if isinstance(answer, dict) and "needs_window" in answer:
        return {"needs_window": window_of(answer)}
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        stderr = answer.get("stderr_tail")
        # The message names paths and branches the target chose: one printable line, never a forged second one.
        kind = answer["error"] if ERROR_KIND.fullmatch(answer["error"]) else "probe"
        raise CodeError(
            f"resetting the training code failed ({kind}): {printable(answer.get('message'))}; "
            f"{printable(failure_tail(answer, path))}",
            kind=kind,
            cmd=answer.get("cmd"),
            rc=answer.get("rc"),
            stderr=stderr if isinstance(stderr, str) else None,
            details={"saved_in": answer.get("backup")} if answer.get("backup") else {},
        )
    for key, kind in DONE_KEYS.items():
        if not isinstance(answer, dict) or not isinstance(answer.get(key), kind):
            raise CodeError(f"the reset script answered no {key!r} in the expected shape", kind="probe")
    wrong = reset_answer_shape(answer)
    if wrong:
        raise CodeError(f"the reset script's answer is not in the expected shape: {wrong}", kind="probe")
    return answer


def unproven(facts, done):
    """Why the repository is not at the commit and clean after the reset (one sentence), or ``""``."""
    reasons = leftover(facts)
    if not reasons:
        return ""
    saved = f"; the local changes are saved in {printable(done['backup']['dir'])}" if done.get("backup") else ""
    left = facts["diff"]["before"].splitlines()[1:6]
    shown = f" (status: {', '.join(left)})" if left else ""
    return (
        f"{facts['path']} is not at {short(facts['commit'])} and clean after the reset: {'; '.join(reasons[:5])}"
        f"{shown}{saved}"
    )


class TrainingCode(ActingStep):
    """Read the repository, and when it is not at the commit and clean: save, fetch, check out, read again."""

    facts = code_facts
    error = CodeError
    at_least = {
        "reset_timeout": (1, "give the reset at least 1 second"),
        "backup_keep": (0, "give how many backups to keep (0: every one)"),
    }
    script = code_script
    act_part = "reset"

    def __init__(self, argument_spec):
        self.argument_spec = argument_spec  # the module's options (library/training_code.py)

    def act_payload(self, run, before):
        timeout = run.params["reset_timeout"] + run.params["timeout"] + GRACE
        return reset_payload(run.spec, run.params, utc_stamp()), timeout

    def act(self, run, before):
        """The reset and the re-read in one pct exec; nothing to prove when the script found a live job using the
        repository just before the reset (unattended: ``done`` then holds ``needs_window``)."""
        done, after = super().act(run, before)
        return done, None if "needs_window" in done else after

    def done(self, run, answer):
        return done_of(answer, run.spec["path"])

    def prove(self, run, after, done):
        saved = {"saved_in": done["backup"]["dir"]} if done["backup"] else {}
        return unproven(after, done), saved

    def result(self, run, before, after, done):
        """The state from the last read (the first in check mode), what the reset did."""
        if done and "needs_window" in done:
            return refused(before, done["needs_window"], run.target.label)
        facts = after or before
        done = done or {}
        return {
            "needs_window": before["needs_window"],
            "in_use": before["in_use"],
            "repo": before["path"],  # not "path": exit_json would add stats of the node's file of that name
            "commit": before["commit"],
            "head": facts["head"],
            "branch": facts["branch"],
            "head_before": before["head"],
            "branch_before": before["branch"],
            "dirty": facts["dirty"],
            "fetched": done.get("fetched", False),
            "backup": done.get("backup"),
            "kept_ref": done.get("kept_ref"),
            "removed": done.get("removed", []),
            "pruned": done.get("pruned", []),
        }


def refused(before, users, label):
    """The result when the script found a live process using the repository just before the reset: nothing was
    reset (its backup removed), no change, the processes in ``needs_window``."""
    when = " (found just before the reset; its backup was removed, nothing was reset)"
    sentence = window_message(label, before["path"], before["changes"], users, when)
    stays = before["diff"]["before"]
    return {
        "changed": False,
        "changes": [],
        "diff": {"before": stays, "after": stays},
        "needs_window": [sentence],
        "in_use": users,
        "repo": before["path"],
        "commit": before["commit"],
        "head": before["head"],
        "branch": before["branch"],
        "head_before": before["head"],
        "branch_before": before["branch"],
        "dirty": before["dirty"],
        "fetched": False,
        "backup": None,
        "kept_ref": None,
        "removed": [],
        "pruned": [],
    }
