"""plugins/modules/training_code.py, its probe part and its reset script
(plugins/module_utils/steps/training_code/script.py).

Two layers: the module replayed on a CT target through FakeRunner (every ``pct exec`` argv and stdin asserted: one
for a converged repository, two for a reset: read, then reset + read again); and the module on a bare host, where
the probe part and the script run in-process against REAL git repositories in tmp_path: a tree dirtied the way
experiments dirty it (a monkey-patch in the model file, a staged change, an untracked file, ignored checkpoints),
a second repository as the remote. No network, no sleep.
"""

import hashlib
import inspect
import json
import os
import shutil
import socket
import stat
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest
import training_code
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import act as ct_act
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import fs as ct_fs
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git as ct_git
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git_paths as ct_git_paths
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import proc as ct_proc
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import acting as code_acting
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import (
    backups,
    git_runner,
    nofollow,
    script,
    users,
    worktree,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import probe as code_probe

from tests.conftest import other_python, unavailable
from tests.fakes import FakeRunner, run_module, run_probes_program

PINNED = "4f3c2a1b0e9d8c7b6a5f4e3d2c1b0a9f8e7d6c5b"
OTHER = "9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d"
STAMP = "20261203T101500Z"
STAMPS = [f"20261203T10{minute:02d}00Z" for minute in range(60)]
BACKUPS = "/var/backups/pve-gpu-recover/training_code"


# -- the module on a CT, replayed ------------------------------------------------------------------------------
CT_PARAMS = {"vmid": 200, "commit": PINNED}
PCT = ["pct", "exec", "200", "--keep-env", "0", "--", "timeout", "-k", "5"]
WRAPPER = ["env", "LC_ALL=C", "LANG=C", "python3", "-I", "-"]
READ_PAYLOAD = {"path": "/srv/train", "commit": PINNED, "git": "git", "timeout": 60, "backup_dir": BACKUPS}
RESET_PAYLOAD = {
    "path": "/srv/train",
    "commit": PINNED,
    "remote": None,
    "backup_dir": BACKUPS,
    "git": "git",
    "stamp": STAMP,
    "timeout": 600,
    "keep": None,
    "min_free": 1024 << 20,
    "window_check": False,
}


def ct_answer(head=PINNED, branch="main", status="", **changed):
    found = {
        "path": "/srv/train",
        "exists": True,
        "git": "/usr/bin/git",
        "git_version": "2.39.5",
        "repo": True,
        "bare": False,
        "toplevel": "/srv/train",
        "head": head,
        "branch": branch,
        "status": status,
        "operation": None,
        "commit_present": True,
        "collisions": [],
        "errors": [],
    }
    found.update(changed)
    return found


CONVERGED = ct_answer()
DIRTY = ct_answer(OTHER, status=" M model.py\0M  data.py\0?? notes.txt\0")
RESET_DONE = ct_answer(PINNED, None)
SAVED = {
    "dir": f"{BACKUPS}/{STAMP}",
    "files": [
        "HEAD",
        "RESTORE.txt",
        "changed.tar.gz",
        "changes.patch",
        "manifest.json",
        "staged.patch",
        "status.txt",
        "untracked.tar.gz",
    ],
    "changed": 2,
    "untracked": 1,
    "restore": f"{BACKUPS}/{STAMP}/RESTORE.txt",
}
DONE = {
    "head_before": OTHER,
    "branch_before": "main",
    "head": PINNED,
    "fetched": False,
    "backup": SAVED,
    "kept_ref": None,
    "removed": ["notes.txt"],
    "pruned": [],
    "seconds": 0.4,
}


def read_call(answer):
    out = json.dumps({"training_code": {"answer": answer, "seconds": 0.02}})
    return [*PCT, "60", *WRAPPER, json.dumps({"training_code": READ_PAYLOAD})], (0, out, "")


def reset_call(done, reread, **changed):
    # reset_timeout (600) + the re-read's timeout (60) + 10 s for the script to answer + the checkout's 120 s of
    # grace; one pct exec for both parts.
    payloads = {"reset": dict(RESET_PAYLOAD, **changed), "training_code": READ_PAYLOAD}
    out = json.dumps({"reset": {"answer": done, "seconds": 0.4}, "training_code": {"answer": reread, "seconds": 0.02}})
    return [*PCT, "790", *WRAPPER, json.dumps(payloads)], (0, out, "")


@pytest.fixture
def on_pve1(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "pve1")
    monkeypatch.setattr(code_acting, "utc_stamp", lambda: STAMP)


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_converged_repository_costs_one_pct_exec_and_changes_nothing(monkeypatch, capsys):
    for check_mode in (False, True):
        runner = FakeRunner(read_call(CONVERGED))
        result = run_module(training_code, CT_PARAMS, runner, monkeypatch, capsys, check_mode=check_mode)
        assert (result["changed"], result["changes"], result["backup"], result["removed"]) == (False, [], None, [])
        assert result["diff"] == {"before": f"HEAD {PINNED}\n", "after": f"HEAD {PINNED}\n"}
        assert (result["repo"], result["head"], result["branch"]) == ("/srv/train", PINNED, "main")


@pytest.mark.usefixtures("on_pve1")
def test_ct_the_reader_and_the_reset_run_on_the_cts_python_the_option_names(monkeypatch, capsys):
    # `python`: the CT's interpreter of every probe part and script, the fact pass's (the role passes
    # preflight_python); the venv's python is never it.
    python = "/usr/bin/python3.11"
    calls = [read_call(DIRTY), reset_call(DONE, RESET_DONE)]
    calls = [([python if arg == "python3" else arg for arg in argv], answer) for argv, answer in calls]
    result = run_module(training_code, dict(CT_PARAMS, python=python), FakeRunner(*calls), monkeypatch, capsys)
    assert (result["changed"], result["head"]) == (True, PINNED)


@pytest.mark.usefixtures("on_pve1")
def test_ct_check_mode_reports_the_reset_and_the_real_run_does_it_in_one_more_pct_exec(monkeypatch, capsys):
    check = run_module(training_code, CT_PARAMS, FakeRunner(read_call(DIRTY)), monkeypatch, capsys, check_mode=True)
    runner = FakeRunner(read_call(DIRTY), reset_call(DONE, RESET_DONE))
    real = run_module(training_code, CT_PARAMS, runner, monkeypatch, capsys)
    assert check["changed"] is real["changed"] is True
    assert (
        check["diff"]
        == real["diff"]
        == {"before": f"HEAD {OTHER}\n M model.py\nM  data.py\n?? notes.txt\n", "after": f"HEAD {PINNED}\n"}
    )
    assert (
        check["changes"]
        == real["changes"]
        == [
            f"save 2 changed and 1 untracked files to a backup, then check out {PINNED[:12]} "
            f"(HEAD is {OTHER[:12]} on main)"
        ]
    )
    # Check mode reports what is; the real run what is now and what it did.
    assert (check["head"], check["branch"], check["backup"]) == (OTHER, "main", None)
    assert check["dirty"] == {"staged": ["data.py"], "unstaged": ["model.py"], "untracked": ["notes.txt"]}
    assert (real["head"], real["branch"], real["head_before"], real["branch_before"]) == (PINNED, None, OTHER, "main")
    assert real["dirty"] == {"staged": [], "unstaged": [], "untracked": []}
    assert (real["backup"], real["removed"], real["fetched"]) == (SAVED, ["notes.txt"], False)
    # What travels on stdin: the shared modules once (the reset script's parts among them, each after what it
    # needs), then the reset script's and the reader's sources, run in that order in one process.
    given = json.loads(runner.stdin[1])
    shared = (ct_act, ct_fs, ct_run, ct_git_paths, ct_git, worktree, git_runner, nofollow, ct_proc, users, backups)
    assert given["shared"] == {m.__name__: inspect.getsource(m) for m in shared}
    assert list(given["shared"]) == [m.__name__ for m in shared]
    sources = {"reset": inspect.getsource(script), "training_code": inspect.getsource(code_probe)}
    assert given["sources"] == sources


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_failed_fetch_fails_with_its_command_and_leaves_the_tree(monkeypatch, capsys):
    failed = {
        "error": "fetch",
        "message": f"fetching {PINNED[:12]} from origin failed (exit 128): fatal: could not read from remote",
        "cmd": ["/usr/bin/git", "-C", "/srv/train", "fetch", "--quiet", "--no-tags", "origin", PINNED],
        "rc": 128,
        "stderr_tail": "fatal: could not read from remote",
        "backup": None,
        "touched": False,
    }
    missing = dict(DIRTY, commit_present=False)
    runner = FakeRunner(read_call(missing), reset_call(failed, missing, remote="origin"))
    result = run_module(training_code, dict(CT_PARAMS, remote="origin"), runner, monkeypatch, capsys)
    assert result["failed"] is True
    assert (result["error"], result["rc"], result["cmd"]) == ("fetch", 128, failed["cmd"])
    assert result["msg"] == (
        f"CT 200 on pve1: resetting the training code failed (fetch): fetching {PINNED[:12]} from origin failed "
        "(exit 128): fatal: could not read from remote; /srv/train was left as it was"
    )
    assert result["stderr_tail"] == "fatal: could not read from remote"
    assert "saved_in" not in result


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_checkout_that_fails_after_the_backup_names_the_backup(monkeypatch, capsys):
    failed = {
        "error": "reset",
        "message": f"checking out {PINNED[:12]} failed (exit 128): error: unable to unlink old 'model.py'",
        "cmd": None,
        "rc": 128,
        "stderr_tail": "",
        "backup": f"{BACKUPS}/{STAMP}",
        "touched": True,
    }
    runner = FakeRunner(read_call(DIRTY), reset_call(failed, DIRTY))
    result = run_module(training_code, CT_PARAMS, runner, monkeypatch, capsys)
    assert (result["error"], result["saved_in"]) == ("reset", f"{BACKUPS}/{STAMP}")
    assert result["msg"].endswith(
        f"the local changes are saved in {BACKUPS}/{STAMP} ({BACKUPS}/{STAMP}/RESTORE.txt says how to put them back)"
    )


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_tree_still_dirty_after_the_reset_fails_naming_what_is_left(monkeypatch, capsys):
    left = ct_answer(PINNED, None, status="?? run.log\0")
    runner = FakeRunner(read_call(DIRTY), reset_call(DONE, left))
    result = run_module(training_code, CT_PARAMS, runner, monkeypatch, capsys)
    assert (result["failed"], result["error"], result["saved_in"]) == (True, "verify", SAVED["dir"])
    assert result["msg"] == (
        f"CT 200 on pve1: /srv/train is not at {PINNED[:12]} and clean after the reset: save 1 untracked file to a "
        f"backup, then discard them (HEAD is {PINNED[:12]}, detached) (status: ?? run.log); the local changes are "
        f"saved in {SAVED['dir']}"
    )


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_reset_answer_of_the_wrong_shape_is_refused(monkeypatch, capsys):
    runner = FakeRunner(read_call(DIRTY), reset_call({"head": 7}, RESET_DONE))
    result = run_module(training_code, CT_PARAMS, runner, monkeypatch, capsys)
    assert (result["error"], result["msg"]) == (
        "probe",
        "CT 200 on pve1: the reset script answered no 'head' in the expected shape",
    )


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_problem_stops_before_any_reset(monkeypatch, capsys):
    missing = dict(DIRTY, commit_present=False)
    result = run_module(training_code, CT_PARAMS, FakeRunner(read_call(missing)), monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "problems")
    assert result["msg"].startswith(f"CT 200 on pve1: commit {PINNED} is not in the repository at /srv/train and no")


@pytest.mark.usefixtures("on_pve1")
@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"commit": "main"}, "commit is 'main'; expected the full sha"),
        ({"reset_timeout": 0}, "reset_timeout is 0; give the reset at least 1 second"),
        ({"backup_dir": "/srv/train/backups"}, "backup_dir /srv/train/backups lies inside the repository"),
    ],
)
def test_ct_options_that_cannot_work_fail_before_any_call(monkeypatch, capsys, changed, message):
    result = run_module(training_code, dict(CT_PARAMS, **changed), FakeRunner(), monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "invalid")
    assert result["msg"].startswith(message)
    assert result["msg"].endswith("; fix the training_code_* variable of that name")


# -- real repositories on a bare host --------------------------------------------------------------------------
MODEL_V1 = "def forward(x):\n    return x * 2\n"
MODEL_V2 = "def forward(x):\n    return x * 3  # tried a bigger factor\n"
PATCHED = MODEL_V2 + "\nimport torch\ntorch.backends.cuda.matmul.allow_tf32 = False  # monkey-patch while debugging\n"
DATA = "BATCH = 32\n"
STAGED = "BATCH = 64\n"
BINARY = bytes(range(256)) * 4


def git(repo, *args, check=True):
    """Run git in ``repo`` as a person would (an identity of its own, never the user's config: HOME is tmp)."""
    done = subprocess.run(
        ["git", "-c", "user.name=Trainer", "-c", "user.email=trainer@example.org", "-C", str(repo), *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0 or not check, done.stderr
    return done.stdout.strip()


def snapshot(root):
    """Every path under ``root``: kind, link target, size, mtime and the content's bytes for files."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            full = os.path.join(directory, name)
            info = os.lstat(full)
            link = os.readlink(full) if stat.S_ISLNK(info.st_mode) else None
            data = Path(full).read_bytes() if stat.S_ISREG(info.st_mode) else None
            found[os.path.relpath(full, root)] = (stat.S_IFMT(info.st_mode), link, info.st_size, info.st_mtime_ns, data)
    return found


def without(found, *names):
    return {name: value for name, value in found.items() if name not in names}


class Lab:
    """A training repository at ``repo`` (two commits on main: ``pinned``, then ``later``) and a backup root."""

    def __init__(self, tmp_path, monkeypatch):
        self.root = tmp_path
        self.repo = tmp_path / "train"
        self.backups = tmp_path / "backups"
        self.monkeypatch = monkeypatch
        self.repo.mkdir()
        git(self.repo, "init", "-q", "-b", "main")
        (self.repo / ".gitignore").write_text("*.pt\ncheckpoints/\n")
        (self.repo / "model.py").write_text(MODEL_V1)
        (self.repo / "data.py").write_text(DATA)
        (self.repo / "vocab.bin").write_bytes(BINARY)
        git(self.repo, "add", "-A")
        git(self.repo, "commit", "-q", "-m", "known good")
        self.pinned = git(self.repo, "rev-parse", "HEAD")
        (self.repo / "model.py").write_text(MODEL_V2)
        git(self.repo, "commit", "-q", "-am", "bigger factor")
        self.later = git(self.repo, "rev-parse", "HEAD")

    def run(self, capsys, *, check_mode=False, **params):
        args = {"path": str(self.repo), "commit": self.pinned, "backup_dir": str(self.backups), **params}
        return run_module(training_code, args, FakeRunner(), self.monkeypatch, capsys, check_mode=check_mode)

    def dirty(self):
        """What a week of experiments leaves: a monkey-patch, a staged change (and a binary one), an untracked
        file with a space in its name, ignored checkpoints. Returns the ignored files' bytes."""
        (self.repo / "model.py").write_text(PATCHED)
        (self.repo / "data.py").write_text(STAGED)
        (self.repo / "vocab.bin").write_bytes(BINARY[::-1])
        git(self.repo, "add", "data.py", "vocab.bin")
        (self.repo / "scratch notes.txt").write_text("lr 3e-4 diverged at step 1200\n")
        return self.add_ignored()

    def add_ignored(self):
        """Checkpoints, ignored by .gitignore; returns their bytes and times."""
        (self.repo / "checkpoints").mkdir()
        (self.repo / "checkpoints" / "step1000.pt").write_bytes(b"\x00weights" * 100)
        (self.repo / "model.pt").write_bytes(b"\x01weights")
        return self.ignored()

    def ignored(self):
        return {name: (self.repo / name).read_bytes() for name in ("checkpoints/step1000.pt", "model.pt")} | {
            f"{name} mtime": (self.repo / name).stat().st_mtime_ns for name in ("checkpoints/step1000.pt", "model.pt")
        }

    def status(self):
        return git(self.repo, "status", "--porcelain", "--untracked-files=all")


@pytest.fixture
def lab(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home" / ".config"))
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu1")
    stamps = iter(STAMPS)
    monkeypatch.setattr(code_acting, "utc_stamp", lambda: next(stamps))
    return Lab(tmp_path, monkeypatch)


def test_clean_at_the_commit_changes_nothing(lab, capsys):
    git(lab.repo, "checkout", "-q", lab.pinned)
    lab.add_ignored()
    before = snapshot(lab.root)
    for check_mode in (True, False):
        result = lab.run(capsys, check_mode=check_mode)
        assert (result["changed"], result["changes"], result["backup"]) == (False, [], None), result
        assert result["diff"]["before"] == result["diff"]["after"] == f"HEAD {lab.pinned}\n"
    assert snapshot(lab.root) == before


def test_a_dirty_tree_is_saved_restorably_then_reset_and_ignored_files_are_untouched(lab, capsys):
    ignored = lab.dirty()
    before = snapshot(lab.root)
    check = lab.run(capsys, check_mode=True)
    assert snapshot(lab.root) == before  # check mode changed nothing, not even the index's stat cache
    real = lab.run(capsys)
    assert check["changed"] is real["changed"] is True
    assert check["diff"] == real["diff"]
    assert real["diff"] == {
        "before": f"HEAD {lab.later}\nM  data.py\n M model.py\nM  vocab.bin\n?? scratch notes.txt\n",
        "after": f"HEAD {lab.pinned}\n",
    }
    assert (
        check["changes"]
        == real["changes"]
        == [
            f"save 3 changed and 1 untracked files to a backup, then check out {lab.pinned[:12]} "
            f"(HEAD is {lab.later[:12]} on main)"
        ]
    )
    # The repository is at the pin, detached, clean; main was not moved; the ignored files are as they were.
    assert (real["head"], real["branch"], real["head_before"], real["branch_before"]) == (
        lab.pinned,
        None,
        lab.later,
        "main",
    )
    assert git(lab.repo, "rev-parse", "HEAD") == lab.pinned and lab.status() == ""
    assert git(lab.repo, "rev-parse", "main") == lab.later
    assert lab.ignored() == ignored
    assert (lab.repo / "model.py").read_text() == MODEL_V1
    assert real["removed"] == ["scratch notes.txt"] and not (lab.repo / "scratch notes.txt").exists()
    # The backup: named in the result, every file there, readable by root only.
    saved = lab.backups / STAMPS[0]
    assert real["backup"] == {
        "dir": str(saved),
        "files": [*SAVED["files"]],
        "changed": 3,
        "untracked": 1,
        "filtered": [],
        "restore": str(saved / "RESTORE.txt"),
    }
    # The exact bytes of every changed and untracked file, each one's sha256 in the manifest.
    with tarfile.open(saved / "changed.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["data.py", "model.py", "vocab.bin"]
        assert tar.extractfile("model.py").read() == PATCHED.encode()
    manifest = json.loads((saved / "manifest.json").read_text())
    assert {r["path"]: r["sha256"] for r in manifest["changed.tar.gz"]}["model.py"] == hashlib.sha256(
        PATCHED.encode()
    ).hexdigest()
    assert stat.S_IMODE(saved.stat().st_mode) == 0o700
    assert (saved / "HEAD").read_text() == f"{lab.later}\nmain\n"
    assert (saved / "status.txt").read_text().splitlines() == [
        "M  data.py",
        " M model.py",
        "M  vocab.bin",
        '?? "scratch notes.txt"',
    ]
    with tarfile.open(saved / "untracked.tar.gz") as tar:
        assert tar.getnames() == ["scratch notes.txt"]
        assert tar.extractfile("scratch notes.txt").read() == b"lr 3e-4 diverged at step 1200\n"
    assert "git apply" in (saved / "RESTORE.txt").read_text()
    # The patch restores it: at the old HEAD in a scratch clone, as RESTORE.txt says.
    scratch = lab.root / "scratch"
    git(lab.root, "clone", "-q", lab.repo, scratch)
    git(scratch, "checkout", "-q", lab.later)
    git(scratch, "apply", saved / "changes.patch")
    git(scratch, "apply", "--cached", saved / "staged.patch")
    assert (scratch / "model.py").read_text() == PATCHED
    assert (scratch / "data.py").read_text() == STAGED
    assert (scratch / "vocab.bin").read_bytes() == BINARY[::-1]
    assert git(scratch, "show", ":data.py") + "\n" == STAGED  # staged again, the model's patch not
    assert git(scratch, "status", "--porcelain") == "M  data.py\n M model.py\nM  vocab.bin"
    # Idempotence: the next run finds nothing to do and writes no backup.
    again = lab.run(capsys)
    assert (again["changed"], again["changes"], again["backup"]) == (False, [], None)
    assert sorted(p.name for p in lab.backups.iterdir()) == [STAMPS[0]]


def test_renames_odd_names_links_and_modes_are_saved_and_restored(lab, capsys):
    (lab.repo / "big.py").write_text("".join(f"X{n} = {n}\n" for n in range(100)))
    git(lab.repo, "add", "big.py")
    git(lab.repo, "commit", "-q", "-m", "big")
    head = git(lab.repo, "rev-parse", "HEAD")
    git(lab.repo, "mv", "big.py", "renamed big.py")  # a staged rename, a space in the new name
    (lab.repo / "data.py").chmod(0o755)
    odd = ["new\nline.txt", os.fsdecode(b"\xff\xfe.bin"), "deep/er/f.txt"]
    for name in odd:
        (lab.repo / name).parent.mkdir(parents=True, exist_ok=True)
        (lab.repo / name).write_bytes(name.encode("utf-8", "surrogateescape"))
    (lab.repo / "link").symlink_to("model.py")
    facts = lab.run(capsys, check_mode=True)
    assert facts["dirty"] == {
        "staged": ["big.py -> renamed big.py"],
        "unstaged": ["data.py"],
        "untracked": ["deep/er/f.txt", "link", "new\nline.txt", "\\xff\\xfe.bin"],
    }
    assert facts["diff"]["before"].splitlines()[1:] == [
        " M data.py",
        "R  big.py -> renamed big.py",
        "?? deep/er/f.txt",
        "?? link",
        '?? "new\\nline.txt"',
        '?? "\\\\xff\\\\xfe.bin"',
    ]
    result = lab.run(capsys)
    assert (result["changed"], lab.status()) == (True, "")
    assert result["removed"] == ["deep/er/f.txt", "link", "new\nline.txt", "\\xff\\xfe.bin"]  # git's order
    assert not (lab.repo / "deep").exists()  # a directory left empty goes too
    saved = Path(result["backup"]["dir"])
    scratch = lab.root / "scratch"
    git(lab.root, "clone", "-q", lab.repo, scratch)
    git(scratch, "checkout", "-q", head)
    git(scratch, "apply", saved / "changes.patch")
    git(scratch, "apply", "--cached", saved / "staged.patch")
    with tarfile.open(saved / "untracked.tar.gz") as tar:
        # extraction filters (PEP 706) came in Python 3.11.4; Debian 12's 3.11.2 has none
        tar.extractall(scratch, **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))  # noqa: S202
    for name in odd:
        assert (scratch / name).read_bytes() == name.encode("utf-8", "surrogateescape")
    assert os.readlink(scratch / "link") == "model.py"
    assert os.access(scratch / "data.py", os.X_OK)
    assert git(scratch, "diff", "--cached", "--name-status", "-M") == "R100\tbig.py\trenamed big.py"


def test_at_the_commit_on_a_branch_the_tree_is_reset_and_the_branch_stays(lab, capsys):
    git(lab.repo, "checkout", "-q", "-b", "known-good", lab.pinned)
    (lab.repo / "model.py").write_text(PATCHED)
    result = lab.run(capsys)
    assert result["changes"] == [
        f"save 1 changed file to a backup, then discard them (HEAD is {lab.pinned[:12]} on known-good)"
    ]
    assert (result["head"], result["branch"], result["kept_ref"]) == (lab.pinned, "known-good", None)
    assert (lab.repo / "model.py").read_text() == MODEL_V1 and lab.status() == ""
    assert result["backup"]["files"] == [
        "HEAD",
        "RESTORE.txt",
        "changed.tar.gz",
        "changes.patch",
        "manifest.json",
        "staged.patch",
        "status.txt",
    ]


def test_commits_on_a_detached_head_stay_reachable_through_a_ref(lab, capsys):
    git(lab.repo, "checkout", "-q", lab.later)
    (lab.repo / "model.py").write_text(PATCHED)
    git(lab.repo, "commit", "-q", "-am", "experiment on a detached HEAD")
    orphan = git(lab.repo, "rev-parse", "HEAD")
    result = lab.run(capsys)
    assert result["backup"] is None  # nothing dirty: nothing to save
    assert result["kept_ref"] == f"refs/pve-gpu-recover/detached/{STAMPS[0]}"
    assert git(lab.repo, "rev-parse", result["kept_ref"]) == orphan
    # A detached HEAD that a branch holds needs no ref.
    git(lab.repo, "checkout", "-q", lab.later)
    assert lab.run(capsys)["kept_ref"] is None


def test_a_missing_commit_is_fetched_from_a_remote(lab, capsys):
    upstream = lab.root / "upstream"
    git(lab.root, "clone", "-q", lab.repo, upstream)
    (upstream / "model.py").write_text(MODEL_V1 + "# the fix, made upstream\n")
    git(upstream, "commit", "-q", "-am", "the fix")
    fix = git(upstream, "rev-parse", "HEAD")
    lab.dirty()
    check = lab.run(capsys, check_mode=True, commit=fix, remote=str(upstream))
    assert check["changes"][0] == f"fetch {fix[:12]} from {upstream} (not in the repository)"
    assert git(lab.repo, "cat-file", "-e", f"{fix}^{{commit}}", check=False) == ""  # still not there
    result = lab.run(capsys, commit=fix, remote=str(upstream))
    assert (result["changed"], result["fetched"], result["head"]) == (True, True, fix)
    assert result["changes"] == check["changes"]
    assert lab.status() == ""
    # A remote's name works as well.
    git(lab.repo, "remote", "add", "origin", upstream)
    (upstream / "model.py").write_text(MODEL_V1 + "# another fix\n")
    git(upstream, "commit", "-q", "-am", "another fix")
    another = git(upstream, "rev-parse", "HEAD")
    assert lab.run(capsys, commit=another, remote="origin")["head"] == another


def test_a_missing_commit_without_a_remote_is_a_clear_error_and_nothing_is_touched(lab, capsys):
    lab.dirty()
    before = snapshot(lab.root)
    result = lab.run(capsys, commit=PINNED)
    assert (result["failed"], result["error"]) == (True, "problems")
    assert result["msg"] == (
        f"host gpu1: commit {PINNED} is not in the repository at {lab.repo} and no remote is set to fetch it from; "
        f"set training_code_remote (a remote's name such as origin, or a URL), or fetch it there "
        f"(git -C {lab.repo} fetch origin {PINNED})"
    )
    assert snapshot(lab.root) == before


def test_a_fetch_that_fails_is_a_clear_error_and_nothing_is_touched(lab, capsys):
    lab.dirty()
    before = snapshot(lab.root)
    nowhere = lab.root / "nowhere"
    result = lab.run(capsys, commit=PINNED, remote=str(nowhere))
    assert (result["failed"], result["error"], result["rc"]) == (True, "fetch", 128)
    assert result["msg"].startswith(
        f"host gpu1: resetting the training code failed (fetch): fetching {PINNED[:12]} from {nowhere} failed "
        f"(exit 128): fatal: "
    )
    assert result["msg"].endswith(f"; {lab.repo} was left as it was")
    assert result["cmd"][-6:] == ["fetch", "--quiet", "--no-tags", "--no-recurse-submodules", str(nowhere), PINNED]
    assert "does not appear to be a git repository" in result["stderr_tail"]
    # No backup either (the fetch comes before it); a failed fetch leaves only an empty FETCH_HEAD behind.
    assert without(snapshot(lab.root), "train/.git", "train/.git/FETCH_HEAD") == without(before, "train/.git")


def test_a_remote_without_the_commit_is_a_clear_error(lab, capsys):
    upstream = lab.root / "upstream"
    git(lab.root, "clone", "-q", "--bare", lab.repo, upstream)
    result = lab.run(capsys, commit=PINNED, remote=str(upstream))
    assert (result["error"], result["rc"]) == ("fetch", 128)
    assert "not our ref" in result["msg"] and result["msg"].endswith("was left as it was")


def test_ignored_files_the_checkout_would_overwrite_stop_the_run(lab, capsys):
    # The pinned commit tracks config.yaml; the later one stopped tracking it and ignores it; a local one exists.
    git(lab.repo, "checkout", "-q", lab.pinned)
    (lab.repo / "config.yaml").write_text("lr: 1e-4\n")
    git(lab.repo, "add", "config.yaml")
    git(lab.repo, "commit", "-q", "-m", "config")
    pinned = git(lab.repo, "rev-parse", "HEAD")
    git(lab.repo, "rm", "-q", "--cached", "config.yaml")
    (lab.repo / ".gitignore").write_text("*.pt\ncheckpoints/\nconfig.yaml\n")
    git(lab.repo, "commit", "-q", "-am", "config is local now")
    (lab.repo / "config.yaml").write_text("lr: 3e-4  # mine, ignored\n")
    before = snapshot(lab.root)
    result = lab.run(capsys, commit=pinned)
    assert (result["failed"], result["error"]) == (True, "problems")
    assert "would overwrite ignored files that the commit tracks: config.yaml; move them out of" in result["msg"]
    assert snapshot(lab.root) == before


def test_a_file_only_the_old_gitignore_ignored_is_kept_and_named(lab, capsys):
    # The later commit ignores *.log, the pinned one does not: run.log was never saved, so it is never removed.
    (lab.repo / ".gitignore").write_text("*.pt\ncheckpoints/\n*.log\n")
    git(lab.repo, "commit", "-q", "-am", "ignore logs")
    (lab.repo / "run.log").write_text("step 1 loss 2.3\n")
    result = lab.run(capsys)
    assert (result["failed"], result["error"]) == (True, "verify")
    assert "(status: ?? run.log)" in result["msg"]
    assert (lab.repo / "run.log").read_text() == "step 1 loss 2.3\n"
    # Now it is untracked under the pinned commit's rules: the next run saves it and removes it.
    again = lab.run(capsys)
    assert (again["changed"], again["removed"], again["backup"]["untracked"]) == (True, ["run.log"], 1)
    assert lab.status() == ""


def test_a_backup_that_does_not_fit_stops_before_anything_is_written(lab, capsys, monkeypatch):
    lab.dirty()
    before = snapshot(lab.root)
    monkeypatch.setattr(backups, "free_bytes", lambda directory: 4096)
    result = lab.run(capsys)
    assert (result["failed"], result["error"]) == (True, "no_space")
    assert f"but {lab.backups} has 0 MiB free" in result["msg"]
    assert result["msg"].endswith(f"; {lab.repo} was left as it was")
    assert snapshot(lab.root) == before


def test_a_backup_that_fails_its_proof_is_removed_and_nothing_is_reset(lab, capsys, monkeypatch):
    lab.dirty()
    before = snapshot(lab.repo)

    def unreadable(self, target, untracked):
        raise ct_act.ActError("backup", f"{target} does not hold every untracked file")

    monkeypatch.setattr(script.Reset, "prove_tarball", unreadable)
    result = lab.run(capsys)
    assert (result["failed"], result["error"]) == (True, "backup")
    assert result["msg"].endswith(f"; {lab.repo} was left as it was")
    assert list(lab.backups.iterdir()) == []
    # The work tree and the index are as they were, byte for byte (git stash create only added objects).
    after = snapshot(lab.repo)
    assert {k: v for k, v in after.items() if not k.startswith(".git/objects")} == {
        k: v for k, v in before.items() if not k.startswith(".git/objects")
    }


def test_an_untracked_repository_inside_is_a_problem(lab, capsys):
    vendor = lab.repo / "vendor" / "lib"
    vendor.mkdir(parents=True)
    git(vendor, "init", "-q")
    (vendor / "x.py").write_text("x = 1\n")
    result = lab.run(capsys)
    assert (result["failed"], result["error"]) == (True, "problems")
    assert "vendor/lib/ in" in result["msg"] and "is a git repository of its own" in result["msg"]


def test_a_directory_that_is_no_repository_is_a_problem(lab, capsys):
    plain = lab.root / "plain"
    (plain / "sub").mkdir(parents=True)
    result = lab.run(capsys, path=str(plain))
    assert result["msg"] == (
        f"host gpu1: {plain} is not a git repository (no .git); clone the training code there or set "
        "training_code_path to the top of its work tree"
    )
    # A directory inside the repository is not taken for the repository (the ceiling stops git above it).
    inside = lab.repo / "sub"
    inside.mkdir()
    result = lab.run(capsys, path=str(inside))
    assert f"{inside} is not a git repository" in result["msg"]


def test_no_git_in_the_target_is_a_problem(lab, capsys):
    result = lab.run(capsys, git="/nonexistent/git")
    assert result["msg"] == (
        "host gpu1: git not found in the target (`/nonexistent/git` on the PATH of a non-login root shell); "
        "install it there (apt install git) or set training_code_git to its path"
    )


def test_an_unfinished_merge_is_a_problem(lab, capsys):
    git(lab.repo, "checkout", "-q", "-b", "side", lab.pinned)
    (lab.repo / "model.py").write_text("def forward(x):\n    return x * 4\n")
    git(lab.repo, "commit", "-q", "-am", "side")
    git(lab.repo, "merge", "-q", "main", check=False)  # conflicts in model.py
    result = lab.run(capsys)
    assert "a merge is in progress in" in result["msg"] and "git merge --abort" in result["msg"]
    assert "unmerged paths (a conflict): model.py" in result["msg"]


@pytest.fixture
def own_tmp():
    """A directory of the test's own under /tmp, mode 0755, removed after: pytest's shared temporary root is 0700
    (reset so whenever another pytest starts), which another user cannot pass."""
    top = Path(tempfile.mkdtemp(prefix="pve-gpu-recover-test-", dir="/tmp"))
    top.chmod(0o755)
    yield top
    shutil.rmtree(top)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the repository to another user")
def test_a_repository_another_user_owns_is_read_as_root_and_reset_as_its_owner(own_tmp, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(own_tmp / "home"))
    monkeypatch.setattr(code_acting, "utc_stamp", lambda: STAMP)
    lab = Lab(own_tmp, monkeypatch)
    lab.dirty()
    for directory, dirs, files in os.walk(lab.repo):
        for name in [*dirs, *files, "."]:
            os.lchown(os.path.join(directory, name), 4242, 4242)
    assert (
        "dubious ownership"
        in subprocess.run(["git", "-C", str(lab.repo), "status"], capture_output=True, text=True, check=False).stderr
    )
    result = lab.run(capsys)
    assert (result["changed"], result["head"]) == (True, lab.pinned), result.get("msg")
    assert result["backup"]["changed"] == 3
    assert (lab.repo / "model.py").stat().st_uid == 4242  # written by git running as the owner
    assert os.stat(result["backup"]["dir"]).st_uid == 0  # the backup is root's


def test_the_parts_run_as_shipped_on_python_3_9(lab):
    python = other_python("3.9")
    if python is None:
        unavailable("no python3.9 here")
    lab.dirty()
    payloads = {
        "reset": {
            "path": str(lab.repo),
            "commit": lab.pinned,
            "remote": None,
            "backup_dir": str(lab.backups),
            "git": "git",
            "stamp": STAMP,
            "timeout": 60,
        },
        "training_code": {"path": str(lab.repo), "commit": lab.pinned, "git": "git", "timeout": 60},
    }
    parts = {name: (module, payloads[name]) for name, module in (("reset", script), ("training_code", code_probe))}
    answers = run_probes_program(python, parts)
    assert answers["reset"]["answer"]["head"] == lab.pinned, answers
    assert answers["reset"]["answer"]["backup"]["dir"] == str(lab.backups / STAMP)
    read = answers["training_code"]["answer"]
    assert (read["head"], read["branch"], read["status"], read["errors"]) == (lab.pinned, None, "", [])
