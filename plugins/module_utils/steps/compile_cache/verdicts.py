# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The compile cache step's verdicts: which roots are refused and why (:func:`root_refusal`, the overlap of two
roots), each root's verdict (fresh, stale, unstamped, missing, refused, unknown: :func:`judge_root`), which stale
roots live processes use (:func:`in_use`), and the lines that say so (changes, the diff, ``needs_window``,
warnings); :func:`judge` puts them together into the step's facts for the fact pass and the module; pure.
"""

from __future__ import annotations

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct.fs import clean, inside, refusal
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.text import printable
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache.fingerprint import (
    STAMP_SHOWN,
    describe,
    differences,
    normalized,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache.warmup import (
    warmup_line,
    warmup_problem,
)

VERDICTS = ("fresh", "stale", "unstamped", "missing", "refused", "unknown")
REBUILT = "for the venv as rebuilt in this run"


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


def unreadable_line(label, processes):
    """The warning of a purge that cannot vouch for ``processes`` (``[{"pid", "name", "error"}]``, the first 3
    named)."""
    named = ", ".join(f"pid {u['pid']} ({printable(u['name'])}: {printable(u['error'])})" for u in processes[:3])
    more = f" and {len(processes) - 3} more" if len(processes) > 3 else ""
    return (
        f"{label}: {len(processes)} processes could not be inspected ({named}{more}); the purge cannot vouch that none "
        "of them uses a cache root"
    )


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
        # Processes whose files could not be read (another user namespace, or stuck in the driver: ct_proc), named:
        # a purge cannot vouch for them.
        "processes_unreadable": list(answer.get("unreadable_processes") or []),
        "processes_partial": bool(answer.get("users_partial")),
        "size_bytes": sum(r["size_bytes"] for r in roots),
        "changes": changes,
        "problems": problems,
        "diff": {"before": before, "after": after},
        "pending": bool(changes) and not problems,
    }
