# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The training code step: is the repository at the pinned commit and clean, and what would a run change.

Its probe part (``code_probe``) reads, inside the target, the repository's HEAD and branch, its
``git status --porcelain=v1 -z --untracked-files=all`` and whether the pinned commit is there. Everything here is
pure: the probe's answer in, facts out.

Clean means what git says: no staged change, no unstaged change, no untracked file. Ignored files (checkpoints,
data, caches under .gitignore) never count and a run never touches them. A repository at the commit and clean
is converged, on a branch or detached alike; a run that has work saves every local change first, then checks the
commit out detached (see code_script for why detached).

Unattended (``unattended``, the scheduled drift corrector), a repository is not reset under a live job: a process
of the target whose working directory, an open file, its executable, a mapped file or a path in its command line
lies in the repository (``python train.py`` started there, ``python /srv/train/train.py`` from elsewhere). The
facts name those processes in ``needs_window`` and nothing is pending. They are read on the node
(:func:`read_node`, with node/process.py's bounded reads, as the venv step reads who runs from a venv), and only when a
reset is due: a converged run reads nothing more. Processes the GPU step ends first do not count.
"""

from __future__ import annotations

import posixpath
import re

from ansible_collections.pve_gpu.recover.plugins.module_utils.node import process as pp
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.errors import RecoverError
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.text import printable
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.handoff import ending_pids_of
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import in_use, worktree
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import probe as code_probe

NAME = "training_code"
PROBE = code_probe
DEFAULT_BACKUP_DIR = "/var/backups/pve-gpu-recover/training_code"
SPEC = {
    # The repository inside the target: the top of its work tree.
    "path": {"type": "path", "default": "/srv/train"},
    # The known-good commit, its full sha (40 hex digits; 64 in a SHA-256 repository).
    "commit": {"type": "str", "required": True},
    # Where to fetch the commit from when the repository lacks it: a remote's name (origin) or a URL; None: nowhere.
    "remote": {"type": "str"},
    # Local changes are saved under <backup_dir>/<UTC stamp>/ before anything is reset; outside the repository.
    "backup_dir": {"type": "path", "default": DEFAULT_BACKUP_DIR},
    # MiB a reset leaves free on the backup's file system beyond the backup, or it is refused before any change.
    "backup_min_free_mib": {"type": "int", "default": 1024},
    # git inside the target: a name on its PATH or a path.
    "git": {"type": "str", "default": "git"},
    # The scheduled drift corrector: never reset the repository under a live job of the target (needs_window).
    "unattended": {"type": "bool", "default": False},
}
SPEC_DEFAULTS = {name: option.get("default") for name, option in SPEC.items()}
SHA = re.compile(r"^(?:[0-9a-fA-F]{40}|[0-9a-fA-F]{64})$")
# Porcelain codes of a path with a conflict (git-status(1), "Short Format").
UNMERGED = {"DD", "AU", "UD", "UA", "DU", "AA", "UU"}
ABORT = {"bisect": "git bisect reset", "am": "git am --abort"}
SHOWN = 5  # paths named in one sentence
COMMAND_SHOWN = 120  # characters of a command line in a sentence
MIB = 1 << 20


class CodeError(RecoverError):
    """The step's settings cannot work, or the probe answered something that is not a training code probe's answer."""


def short(sha):
    """``0123456789abcdef...`` -> ``0123456789ab``: how sentences name a commit."""
    return sha[:12] if sha else "(none)"


def named(paths, limit=SHOWN):
    """``["a", "b c"]`` -> ``a, b c``; more than ``limit`` -> the first ones and ``(and N more)``."""
    shown = ", ".join(quote(p) for p in paths[:limit])
    return f"{shown} (and {len(paths) - limit} more)" if len(paths) > limit else shown


def quote(path):
    """A path as one readable token: as is when plain, quoted when it holds a quote, a backslash or anything not
    plainly itself on one line (``a\\nb`` -> ``"a\\\\nb"``, a bidi override as ``\\u202e``: text.printable), so
    that a name a user chose cannot forge a second line or reorder one."""
    if any(c in '"\\' or not c.isprintable() for c in path):
        return '"' + printable(path).replace('"', '\\"') + '"'
    return path


# -- settings --------------------------------------------------------------------------------------------------
def inside(path, directory):
    """Whether ``path`` is ``directory`` or lies below it (lexically, both normalized)."""
    path, directory = posixpath.normpath(path), posixpath.normpath(directory)
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def check_spec(spec):
    """Why the step's settings cannot work (one sentence), or ``""``: called once the SPEC types are checked."""
    commit, path, backup = spec["commit"], spec["path"], spec["backup_dir"]
    if not SHA.match(commit or ""):
        return (
            f"commit is {commit!r}; expected the full sha of the known-good commit, 40 hex digits "
            f"(`git rev-parse <branch or tag>` prints it): a branch or tag may move, the pin must not"
        )
    if not posixpath.isabs(path or ""):
        return f"path is {path!r}; expected the absolute path of the repository inside the target"
    if not posixpath.isabs(backup or ""):
        return f"backup_dir is {backup!r}; expected an absolute path inside the target"
    if inside(backup, path):
        return (
            f"backup_dir {backup} lies inside the repository {path}: the reset would remove the backup it just "
            f"wrote; put it outside (default {DEFAULT_BACKUP_DIR})"
        )
    if (spec.get("backup_min_free_mib") or 0) < 0:
        return f"backup_min_free_mib is {spec['backup_min_free_mib']}; expected the MiB to keep free (0: none)"
    if (spec.get("remote") or "").startswith("-"):
        return f"remote is {spec['remote']!r}; expected a remote's name (origin) or a URL, not an option"
    if not spec.get("git"):
        return "git is empty; expected git's name or path inside the target"
    return ""


# -- the probe's answer ----------------------------------------------------------------------------------------
ANSWER_TYPES = {
    "exists": (bool,),
    "repo": (bool,),
    "bare": (bool,),
    "git": (str, type(None)),
    "git_version": (str, type(None)),
    "toplevel": (str, type(None)),
    "head": (str, type(None)),
    "branch": (str, type(None)),
    "status": (str, type(None)),
    "operation": (str, type(None)),
    "commit_present": (bool, type(None)),
    "collisions": (list,),
    "errors": (list,),
}


def check_answer(answer):
    """The probe's answer comes from inside a CT: a part that is not what the probe prints is a CodeError."""
    if not isinstance(answer, dict):
        raise CodeError("the training_code probe answered no object", kind="probe")
    for key, kinds in ANSWER_TYPES.items():
        if not isinstance(answer.get(key), kinds) or (key not in answer):
            raise CodeError(f"the training_code probe answered no {key!r} of the expected type", kind="probe")
    if answer["head"] is not None and not SHA.match(answer["head"]):
        raise CodeError(f"the training_code probe answered a HEAD that is no sha: {answer['head']!r}", kind="probe")
    for key in ("collisions", "errors"):
        if not all(isinstance(item, str) for item in answer[key]):
            raise CodeError(f"the training_code probe answered {key!r} that are not all strings", kind="probe")
    # Added later: optional, so that an older probe's answer still reads.
    for key in ("untrusted", "linked"):
        if not isinstance(answer.get(key), (str, type(None))):
            raise CodeError(f"the training_code probe answered no {key!r} of the expected type", kind="probe")
    remotes = answer.get("remotes")
    if remotes is not None and not (isinstance(remotes, list) and all(isinstance(r, str) for r in remotes)):
        raise CodeError("the training_code probe answered no 'remotes' of the expected type", kind="probe")
    space = answer.get("backup_space")
    if space is not None and not (
        isinstance(space, dict)
        and isinstance(space.get("dir"), str)
        and all(isinstance(space.get(k), int) and not isinstance(space.get(k), bool) for k in ("free", "estimate"))
    ):
        raise CodeError("the training_code probe answered no 'backup_space' of the expected type", kind="probe")
    missing = answer.get("missing_filters", {})
    if not isinstance(missing, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in missing.items()):
        raise CodeError("the training_code probe answered no 'missing_filters' of the expected type", kind="probe")
    filters = answer.get("filters", {})
    if not isinstance(filters, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in filters.items()
    ):
        raise CodeError("the training_code probe answered no 'filters' of the expected type", kind="probe")


def reset_answer_shape(done):
    """What is wrong with the reset script's success answer (``""``: nothing), past the type of each key: the
    script runs inside the CT, so a backup without its ``dir`` or a list of names that are not strings is named,
    never a KeyError further on.

    ``reset_answer_shape({"backup": {"files": []}, "removed": [], "pruned": []})`` -> ``"backup has no 'dir'
    (a path)"``."""
    backup = done.get("backup")
    if backup is not None:
        if not isinstance(backup.get("dir"), str) or not backup["dir"].startswith("/"):
            return "backup has no 'dir' (a path)"
        if "files" in backup and not _strings(backup["files"]):
            return "backup files is not a list of names"
    for key in ("removed", "pruned"):
        if not _strings(done.get(key)):
            return f"{key} is not a list of paths"
    return ""


def _strings(value):
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def parse_status(text):
    """``git status --porcelain=v1 -z`` output -> ``[{"code", "path", "orig"}]`` in git's order.

    ``" M model.py\\0R  new name.py\\0old name.py\\0?? notes\\nv2.txt\\0"`` -> ``[{"code": " M", "path":
    "model.py", "orig": None}, {"code": "R ", "path": "new name.py", "orig": "old name.py"}, {"code": "??", "path":
    "notes\\nv2.txt", "orig": None}]``. With ``-z`` git quotes nothing: a field ends at NUL only, so spaces and
    newlines are part of the name; a rename or copy (R or C in either column) is followed by its original path.
    Anything else raises CodeError (the answer comes from inside a CT).
    """
    fields = text.split("\0")
    if fields and fields[-1] == "":
        fields.pop()
    entries, index = [], 0
    while index < len(fields):
        field = fields[index]
        index += 1
        if len(field) < 4 or field[2] != " ":
            raise CodeError(
                f"the training_code probe answered a status entry git never writes: {field!r}", kind="probe"
            )
        code, orig = field[:2], None
        if "R" in code or "C" in code:
            if index >= len(fields):
                raise CodeError(f"the status entry {field!r} lacks the path it was renamed from", kind="probe")
            orig = fields[index]
            index += 1
        entries.append({"code": code, "path": field[3:], "orig": orig})
    return entries


def entry_name(entry):
    """``model.py``, or ``old.py -> new.py`` for a rename or copy."""
    return f"{entry['orig']} -> {entry['path']}" if entry["orig"] is not None else entry["path"]


def dirty_of(entries):
    """``{"staged", "unstaged", "untracked"}``: the paths in each state (a rename as ``old -> new``); a path with
    changes both in the index and in the work tree is in both lists."""
    dirty = {"staged": [], "unstaged": [], "untracked": []}
    for entry in entries:
        x, y = entry["code"]
        if entry["code"] == "??":
            dirty["untracked"].append(entry["path"])
            continue
        if x not in " ?!":
            dirty["staged"].append(entry_name(entry))
        if y not in " ?!":
            dirty["unstaged"].append(entry_name(entry))
    return dirty


def status_lines(entries):
    """``["XY path", "R  old -> new", "?? x"]``, like ``git status --porcelain`` without ``-z``; a path with a
    newline, quote or backslash is JSON-quoted (see :func:`quote`)."""
    lines = []
    for entry in entries:
        name = quote(entry["path"])
        if entry["orig"] is not None:
            name = f"{quote(entry['orig'])} -> {name}"
        lines.append(f"{entry['code']} {name}")
    return lines


def count_phrase(changed, untracked):
    """``(2, 1)`` -> ``2 changed and 1 untracked files``; ``(1, 0)`` -> ``1 changed file``."""
    parts = [f"{n} {what}" for n, what in ((changed, "changed"), (untracked, "untracked")) if n]
    return f"{' and '.join(parts)} {'file' if changed + untracked == 1 else 'files'}"


def where_head(head, branch):
    """``HEAD is 0123456789ab on main``, ``HEAD is 0123456789ab, detached`` or ``the repository has no commit yet``."""
    if head is None:
        return "the repository has no commit yet"
    return f"HEAD is {short(head)} on {quote(branch)}" if branch else f"HEAD is {short(head)}, detached"


# -- the step --------------------------------------------------------------------------------------------------
def code_problems(label, spec, answer, entries):
    """Why nothing can be done safely (one sentence each): what a run would refuse, found before anything runs."""
    path, commit, git = spec["path"], spec["commit"].lower(), spec["git"]
    problems = [
        f"{label}: the training code probe could not read everything: {printable(error)}" for error in answer["errors"]
    ]
    if answer.get("linked"):
        return [f"{label}: {printable(answer['linked'])}; nothing was read or reset there"]
    if answer["git"] is None:
        return [
            f"{label}: git not found in the target (`{git}` on the PATH of a non-login root shell); install it "
            f"there (apt install git) or set training_code_git to its path"
        ]
    if not answer["exists"]:
        return [
            f"{label}: there is no directory {path}; clone the training code there first (git clone <url> {path}) "
            f"or set training_code_path to where it is"
        ]
    if answer.get("untrusted"):
        return [
            *problems,
            f"{label}: untrusted git dir: {printable(answer['untrusted'])}; nothing is reset there",
        ]
    if problems and not answer["repo"]:
        return problems  # git could not say what is there (another owner's repository, a timeout)
    if answer["bare"]:
        return [*problems, f"{label}: {path} is a bare repository (no work tree); set training_code_path to a clone"]
    if not answer["repo"] and answer["toplevel"] is not None:
        return [
            *problems,
            f"{label}: the work tree of the repository at {path} is {quote(answer['toplevel'])}; set "
            f"training_code_path to the top of the work tree",
        ]
    if not answer["repo"]:
        return [
            *problems,
            f"{label}: {path} is not a git repository (no .git); clone the training code there or set "
            f"training_code_path to the top of its work tree",
        ]
    if answer["operation"]:
        op = answer["operation"]
        problems.append(
            f"{label}: a {op} is in progress in {path}; finish it or abort it ({ABORT.get(op, f'git {op} --abort')}) "
            f"and run again: an unfinished {op} cannot be saved to a patch"
        )
    conflicts = [e["path"] for e in entries if e["code"] in UNMERGED]
    if conflicts:
        problems.append(
            f"{label}: {path} has unmerged paths (a conflict): {named(conflicts)}; resolve them (git add) or discard "
            f"them and run again"
        )
    nested = [e["path"] for e in entries if e["code"] == "??" and e["path"].endswith("/")]
    if nested:
        what = "is a git repository" if len(nested) == 1 else "are git repositories"
        problems.append(
            f"{label}: {named(nested)} in {path} {what} of its own (untracked): a reset would neither save nor remove "
            f"it; move it out of {path} or add it to .gitignore"
        )
    tracked = [e for e in entries if e["code"] != "??"]
    if answer["head"] is None and tracked:
        problems.append(
            f"{label}: {path} has no commit yet but files are staged ({named([entry_name(e) for e in tracked])}); "
            f"commit them or unstage them (git rm -r --cached .) and run again"
        )
    return problems + fetch_problems(label, spec, answer) + checkout_problems(label, path, commit, answer)


def names_a_remote(remote):
    """Whether git reads ``remote`` as the name of a configured remote rather than as a URL or a path: ``origin``,
    ``team/upstream`` yes; ``https://host/r.git``, ``git@host:r.git``, ``/srv/r.git``, ``../r``, ``~/r`` no."""
    return "://" not in remote and ":" not in remote and not remote.startswith(("/", ".", "~"))


def fetch_problems(label, spec, answer):
    """Why the commit cannot be had, found before anything runs: it is not in the repository and no remote is set,
    or the remote is given by a name the repository's config does not define (git would take the name for a path
    and fail only once the run had begun)."""
    if answer["commit_present"] is not False:
        return []
    remote, remotes, path, commit = spec.get("remote"), answer.get("remotes"), spec["path"], spec["commit"].lower()
    if not remote:
        return [
            f"{label}: commit {commit} is not in the repository at {path} and no remote is set to fetch it from; "
            f"set training_code_remote (a remote's name such as origin, or a URL), or fetch it there "
            f"(git -C {path} fetch origin {commit})"
        ]
    if remotes is None or not names_a_remote(remote) or remote in remotes:
        return []
    known = f"its remotes are {named(remotes)}" if remotes else "it has no remote"
    return [
        f"{label}: commit {commit} is not in the repository at {path} and training_code_remote {quote(remote)} is "
        f"not a remote of it ({known}); set training_code_remote to one of them or to a URL, or add it there "
        f"(git -C {path} remote add {quote(remote)} <url>)"
    ]


def checkout_problems(label, path, commit, answer):
    """Why the checkout itself would harm the work tree: ignored files it would overwrite."""
    problems = []
    if answer["collisions"]:
        problems.append(
            f"{label}: checking out {short(commit)} would overwrite ignored files that the commit tracks: "
            f"{named(answer['collisions'])}; move them out of {path} and run again (ignored files are never touched)"
        )
    return problems


def space_problems(label, spec, answer, entries):
    """Why the backup would leave its file system with less than the margin (``backup_min_free_mib``): the probe's
    ``backup_space`` (the free bytes of the backup directory's nearest existing directory, and the backup's size
    estimated from what would be saved), judged only when something would be saved."""
    space, margin = answer.get("backup_space"), spec.get("backup_min_free_mib") or 0
    if not entries or not space or space["free"] - space["estimate"] >= margin * MIB:
        return []
    return [
        f"{label}: saving the local changes of {spec['path']} needs about {mib(space['estimate'])} MiB in "
        f"{spec['backup_dir']}, whose file system ({quote(space['dir'])}) has {space['free'] // MIB} MiB free: the "
        f"reset would leave less than training_code_backup_min_free_mib ({margin} MiB); free space there, or set "
        "training_code_backup_dir to a file system with room; nothing was changed"
    ]


def mib(count):
    """Bytes as whole MiB, rounded up: ``mib(1)`` -> ``1``."""
    return -(-count // MIB)


def plan_changes(spec, answer, entries):
    """What a run changes, one line each; ``[]`` at the commit and clean.

    ``plan_changes({"commit": "ab"*20, "remote": None, ...}, {"head": "cd"*20, "branch": "main",
    "commit_present": True, ...}, [2 tracked entries, 1 untracked])`` -> ``["save 2 changed and 1 untracked files
    to a backup, then check out abababababab (HEAD is cdcdcdcdcdcd on main)"]``.
    """
    commit, head = spec["commit"].lower(), answer["head"]
    changed = sum(1 for e in entries if e["code"] != "??")
    untracked = len(entries) - changed
    if head == commit and not entries:
        return []
    changes = []
    if answer["commit_present"] is False and spec.get("remote"):
        changes.append(f"fetch {short(commit)} from {spec['remote']} (not in the repository)")
    save = f"save {count_phrase(changed, untracked)} to a backup, then " if entries else ""
    action = "discard them" if head == commit else f"check out {short(commit)}"
    changes.append(f"{save}{action} ({where_head(head, answer['branch'])})")
    return changes


def code_facts(spec, answer, label):
    """The training code facts before the window rule: where HEAD is, what is dirty, what a run would do, the diff.

    Returns ``{"path", "exists" (a git work tree at path), "commit", "head", "branch" (None: detached), "detached",
    "at_commit", "commit_present", "remote", "dirty" ({"staged", "unstaged", "untracked"}), "git_version",
    "changes", "problems", "diff": {"before": "HEAD <sha>\\n" + status lines, "after": "HEAD <commit>\\n"},
    "pending"}``. What cannot be done safely (no repository, git missing, a conflict, the commit nowhere to be
    found, ignored files in the way) is a problem: nothing is decided on half the facts.
    """
    check_answer(answer)
    commit = spec["commit"].lower()
    entries = parse_status(answer["status"]) if answer["status"] is not None else []
    problems = code_problems(label, spec, answer, entries)
    readable = answer["repo"] and answer["status"] is not None
    changes = plan_changes(spec, answer, entries) if readable else []
    if changes and not problems and answer.get("missing_filters"):  # only a reset runs the filters' programs
        problems = [f"{label}: {printable(worktree.missing_problem(spec['path'], answer['missing_filters']))}"]
    if changes and not problems:
        problems = space_problems(label, spec, answer, entries)
    head = answer["head"]
    before = f"HEAD {head or '(no commit)'}\n" + "".join(f"{line}\n" for line in status_lines(entries))
    return {
        "path": spec["path"],
        "exists": answer["repo"],
        "commit": commit,
        "head": head,
        "branch": answer["branch"],
        "detached": answer["repo"] and head is not None and answer["branch"] is None,
        "at_commit": head == commit,
        "commit_present": answer["commit_present"],
        "remote": spec.get("remote") or None,
        "dirty": dirty_of(entries),
        "git_version": answer["git_version"],
        "changes": changes,
        "problems": problems,
        "diff": {"before": before if answer["repo"] else "", "after": f"HEAD {commit}\n"},
        "pending": bool(changes) and not problems,
    }


def evaluate_step(spec, answer, node, context):
    """The training code facts of the fact pass (and of the module): :func:`code_facts`, then the window rule.

    ``node``: :func:`read_node`'s ``{"users": [...]}`` (unattended with a reset due only) and, from the module in
    check mode, ``"ending"``: pids (inside the target) the GPU step would end first. Adds ``needs_window`` (one
    sentence, or none), ``in_use`` (the processes using the repository, those the GPU step ends first left out)
    and ``ending_pids``. Unattended, a reset due while ``in_use`` is not empty is no change: ``changes`` is empty,
    the diff shows the repository as it stays, and nothing is pending.
    """
    label = context["target"]["label"]
    facts = code_facts(spec, answer, label)
    ending = sorted(set(ending_pids_of(context)) | set(node.get("ending") or []))
    users = [u for u in node.get("users") or [] if u.get("ns_pid") not in ending]
    facts.update(in_use=users, needs_window=[], ending_pids=ending)
    if spec.get("unattended") and facts["pending"] and users:
        facts["needs_window"] = [window_message(label, spec["path"], facts["changes"], users)]
        stays = facts["diff"]["before"]
        facts.update(changes=[], pending=False, diff={"before": stays, "after": stays})
    return facts


def describe_user(user):
    """``pid 516 (python3, pid 41 inside: 'python3 train.py'; cwd /srv/train)``; what the target chose (its name,
    its command line, its paths) through text.printable."""
    inside = f", pid {user['ns_pid']} inside" if user.get("ns_pid") not in (None, user["pid"]) else ""
    command = f": {printable(user['command'], COMMAND_SHOWN)!r}" if user.get("command") else ""
    how = f"; {user['how']} {printable(user['file'])}" if user.get("how") else f"; {printable(user.get('error'))}"
    return f"pid {user['pid']} ({printable(user.get('name'))}{inside}{command}{how})"


def window_message(label, path, changes, users, when=""):
    """The one sentence of a repository an unattended run does not reset: what it would do, who uses it (``when``:
    words after it, e.g. that the reset script found them just before the reset)."""
    sure = [u for u in users if not u.get("error")]
    unsure = [u for u in users if u.get("error")]
    who = []
    if sure:
        who.append(f"{', '.join(describe_user(u) for u in sure)} {'uses' if len(sure) == 1 else 'use'} it")
    if unsure:
        who.append(f"whether {', '.join(describe_user(u) for u in unsure)} uses it cannot be told")
    return (
        f"{label}: the training code at {path} needs a reset ({'; '.join(changes)}) but {' and '.join(who)}{when}: "
        "it is "
        "not reset under a live job; resetting it needs a window (stop the job, or run recover.yml without "
        "recover_unattended)"
    )


# -- the fact pass ---------------------------------------------------------------------------------------------
def probe_payload(spec, timeout=60):
    """What the probe part reads: ``{"path": "/srv/train", "commit": "<sha>", "git": "git", "timeout": 60,
    "backup_dir": "/var/backups/pve-gpu-recover/training_code"}``."""
    return {
        "path": spec["path"],
        "commit": spec["commit"].lower(),
        "git": spec["git"],
        "timeout": timeout,
        "backup_dir": spec["backup_dir"],
    }


def read_node(spec, target, answer, context, proc_root="/proc"):
    """Node-side, unattended only: ``{"users": [...]}``, the target's processes using the repository, read only
    when a reset is due (a converged repository, or an attended run, reads nothing: ``{}``).

    Each user is ``{"pid", "ns_pid", "name", "command", "how" (cwd, open, exe, argv0, mapped, argv), "file"}``,
    or, when its files could not be read in time, ``"how": None`` and ``"error"``: an unattended run resets
    nothing under a process it cannot vouch for.
    """
    if not spec.get("unattended") or answer is None:
        return {}
    try:
        facts = code_facts(spec, answer, context["target"]["label"])
    except CodeError:
        return {}  # evaluate_step says why
    if not facts["pending"]:
        return {}
    roots = sorted({spec["path"], answer["toplevel"] or spec["path"]})
    found, unreadable = in_use.processes_in_repository(pp.owner_of(context["target"]), roots, proc_root)
    users = [dict(in_use.user_of(info), how=how, file=path) for info, how, path in found]
    users += [dict(in_use.user_of(info), how=None, error=error) for info, error in unreadable]
    return {"users": sorted(users, key=lambda u: u["pid"])}
