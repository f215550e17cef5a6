# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The compile cache step's acting half (library/compile_cache.py wires it): read every root and, when one is stale
or unstamped, purge it, stamp it and warm up, then read every root again in the same pct exec; the script's answer
is checked for shape before use (it comes from the target)."""

from __future__ import annotations

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.act_runner import ActingStep, leftover
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.text import printable
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import facts as cache_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import script as cache_script
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache.answer import CacheError
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache.facts import (
    act_payload,
    module_facts,
    probe_payload,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache.verdicts import (
    unreadable_line,
    window_line,
)

# The pct exec that acts gets this much more than its script's own deadline, so the script answers first.
GRACE = 60
DONE_KEYS = {"roots": list, "fingerprint": (dict, type(None))}
WINDOW_KEYS = {"path": str, "real_path": str, "users": list}
DONE_ROOT_KEYS = {"path": str, "stamped": bool, "size_before": (int, type(None)), "size_after": (int, type(None))}


def done_of(answer):
    """The script's answer when it acted; its structured error as a CacheError otherwise."""
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        stdout, stderr = answer.get("stdout_tail"), answer.get("stderr_tail")
        raise CacheError(
            printable(answer.get("message")),  # written in the target, about names the target chose
            kind=printable(answer["error"]),
            cmd=answer.get("cmd") if isinstance(answer.get("cmd"), list) else None,
            rc=answer.get("rc") if isinstance(answer.get("rc"), int) else None,
            stdout=stdout if isinstance(stdout, str) else None,
            stderr=stderr if isinstance(stderr, str) else None,
            details={"done": answer.get("done") if isinstance(answer.get("done"), dict) else None},
        )
    for key, kind in DONE_KEYS.items():
        if not isinstance(answer, dict) or not isinstance(answer.get(key), kind):
            raise CacheError(f"the compile cache script answered no {key!r} in the expected shape", kind="probe")
    for root in answer["roots"]:
        if not isinstance(root, dict) or any(not isinstance(root.get(k), t) for k, t in DONE_ROOT_KEYS.items()):
            raise CacheError("the compile cache script answered a root of the wrong shape", kind="probe")
    if answer.get("warmup") is not None and not isinstance(answer["warmup"], dict):
        raise CacheError("the compile cache script answered a warmup that is not an object", kind="probe")
    window = answer.get("needs_window", [])
    if not isinstance(window, list) or any(
        not isinstance(w, dict) or any(not isinstance(w.get(k), t) for k, t in WINDOW_KEYS.items()) for w in window
    ):
        raise CacheError("the compile cache script answered a needs_window of the wrong shape", kind="probe")
    return answer


def script_windows(before, done, label):
    """The sentences of the roots the acting script left in use (unattended), which the module's read had planned
    to purge: the script looked again just before the purge."""
    planned = {root["path"]: root for root in before["roots"]}
    lines = []
    for window in (done or {}).get("needs_window") or []:
        root = planned.get(window["path"]) or {"path": window["path"], "reason": "stale", "size_bytes": 0}
        users = [u for u in window["users"] if isinstance(u, dict)]
        lines.append(window_line(label, dict(root, live=users)) + " (found just before the purge)")
    return lines


def unproven(facts):
    """Why the caches are not fresh after acting (one sentence), or ``""``."""
    reasons = leftover(facts)
    if not reasons:
        return ""
    return f"the compile caches are still not in spec after the purge: {'; '.join(reasons[:5])}"


def roots_result(before, done):
    """The facts of each root, with what the script did to it."""
    did = {r["path"]: r for r in (done or {}).get("roots", [])}
    keys = ("size_before", "size_after", "purged", "stamped")
    return [
        dict(root, **{k: did[root["path"]].get(k) for k in keys}) if root["path"] in did else root
        for root in before["roots"]
    ]


def warmup_result(before, done):
    if before["warmup"] is None:
        return None
    ran = (done or {}).get("warmup")
    return dict(before["warmup"], ran=ran is not None, **(ran or {}))


class CompileCache(ActingStep):
    """Read every root, and when one is stale or unstamped: purge, stamp, warm up, read every root again."""

    facts = cache_facts
    error = CacheError
    script = cache_script
    progress = "starting the purge and warm-up"  # run as an async job (the role, for a warm-up): followed as it runs

    def payload(self, run):
        return probe_payload(run.spec, run.params["timeout"], gpus=True)

    def read(self, run):
        before = super().read(run)
        for warning in before["warnings"]:  # roots refused alone: the run goes on without them
            run.warn(warning)
        purging = any(root["verdict"] == "stale" for root in before["roots"])
        if purging and before["processes_unreadable"] and not before["problems"]:
            run.warn(unreadable_line(run.target.label, before["processes_unreadable"]))
        return before

    def evaluate(self, run, answer, done=None):
        if done is None:
            return module_facts(
                run.spec,
                answer,
                run.target.label,
                venv_pending=run.params["venv_pending"],
                planned_torch=run.params["venv_pending_torch"],
                check_mode=run.check_mode,
                ending=run.ending_pids(),
            )
        # Roots the script found in use and left (unattended) stay stale: no reason to fail the check after.
        left = [window["real_path"] for window in done.get("needs_window") or []]
        return module_facts(run.spec, answer, run.target.label, window=left)

    def problem_details(self, before):
        return {"cache_roots": before["roots"], "refused": before["refused"]}

    def act_payload(self, run, before):
        # One pct exec: purge, stamp, warm up, then the reader part reads every root again.
        budget = run.params["warmup_timeout"] + run.params["timeout"]
        return act_payload(run.spec, before, run.answer, budget), budget + GRACE

    def done(self, run, answer):
        return done_of(answer)

    def prove(self, run, after, done):
        return unproven(after), {"cache_roots": roots_result(after, done)}

    def result(self, run, before, after, done):
        """The sizes after from the last read; ``needs_window`` from the first read and from the acting script."""
        return {
            "needs_window": before["needs_window"] + script_windows(before, done, run.target.label),
            "cache_roots": roots_result(before, done),
            "expected": before["expected"],
            "venv": before["venv"],
            "user": before["user"],
            "refused": before["refused"],
            "warmup": warmup_result(before, done),
            "size_before": before["size_bytes"],
            "size_after": after["size_bytes"] if after else None,
        }
