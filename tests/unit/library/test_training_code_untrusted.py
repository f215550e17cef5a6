"""The training code step against a repository whose owner is not trusted (issue 25): nothing the owner configured
runs as root, the backup holds the work tree's bytes, removal never follows a link, RESTORE.txt quotes names,
old backups are pruned. Real git repositories in tmp_path, the probe part and the reset script run in-process
(test_training_code.py's Lab); no network, no sleep.
"""

import hashlib
import json
import os
import shlex
import socket
import subprocess
import tarfile
from pathlib import Path

import pytest
import training_code
import yaml
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git as ct_git
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import acting as code_acting
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import nofollow

from tests.conftest import ROOT
from tests.unit.library.test_training_code import MODEL_V1, PATCHED, STAMPS, Lab, git, snapshot

NOBODY = 65534
# What a hostile owner can put in .git/config: every kind of setting that makes git run a program.
HOSTILE = {
    "filter.evil.clean": "{marker} clean",
    "filter.evil.smudge": "{marker} smudge",
    "filter.evil.process": "{marker} process",
    "filter.evil.required": "true",
    "diff.evil.textconv": "{marker} textconv",
    "diff.external": "{marker} external",
    "core.fsmonitor": "{marker} fsmonitor",
    "core.hooksPath": "{hooks}",
    "core.sshCommand": "{marker} ssh",
    "core.pager": "{marker} pager",
    "core.editor": "{marker} editor",
    "credential.helper": "!{marker} credential",
    "gpg.program": "{marker} gpg",
    "core.alternateRefsCommand": "{marker} alternate",
    "protocol.ext.allow": "always",
    "remote.evil.url": "ext::{marker} ext",
    "remote.evil.uploadpack": "{marker} uploadpack",
    "remote.sshy.url": "ssh://127.0.0.1:9/nowhere.git",  # nothing listens on port 9: ssh itself fails at once
    "include.path": "{included}",
}


@pytest.fixture
def lab(tmp_path, monkeypatch):
    """test_training_code.py's lab: a repository and a backup root in tmp_path, HOME there, stamps in order."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home" / ".config"))
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu1")
    stamps = iter(STAMPS)
    monkeypatch.setattr(code_acting, "utc_stamp", lambda: next(stamps))
    return Lab(tmp_path, monkeypatch)


def hostile(lab, tmp_path):
    """Give the Lab's repository a hostile config (and an included file, hooks, .gitattributes naming the filter)
    whose every program writes a marker file; returns the marker directory (empty)."""
    markers = tmp_path / "markers"
    markers.mkdir()
    marker = tmp_path / "mark.sh"
    marker.write_text(f'#!/bin/sh\ntouch "{markers}/$1"\ncat\n')
    marker.chmod(0o755)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for name in ("post-checkout", "pre-auto-gc", "reference-transaction", "post-index-change"):
        (hooks / name).write_text(f'#!/bin/sh\ntouch "{markers}/hook-{name}"\n')
        (hooks / name).chmod(0o755)
        (lab.repo / ".git" / "hooks" / name).write_text(f'#!/bin/sh\ntouch "{markers}/githook-{name}"\n')
        (lab.repo / ".git" / "hooks" / name).chmod(0o755)
    included = tmp_path / "included.config"
    included.write_text(f'[filter "inc"]\n\tclean = "{marker} included"\n\tsmudge = "{marker} included"\n')
    (lab.repo / ".gitattributes").write_text("*.py filter=evil diff=evil\n*.bin filter=inc\n")
    for key, value in HOSTILE.items():
        git(lab.repo, "config", key, value.format(marker=marker, hooks=hooks, included=included))
    if os.geteuid() == 0:  # the repository belongs to nobody: git would refuse it but for safe.directory
        give_to_nobody(lab.repo)
    return markers


def give_to_nobody(repo):
    """chown -R nobody the repository (git's writes then run as nobody) and let nobody reach it (pytest's tmp
    directories are root's, mode 0700)."""
    for directory, dirs, files in os.walk(repo):
        for name in [*dirs, *files, "."]:
            os.lchown(os.path.join(directory, name), NOBODY, NOBODY)
    for parent in Path(repo).parents:
        if parent == Path("/tmp"):
            break
        parent.chmod(parent.stat().st_mode | 0o111)


def test_no_setting_of_the_repository_owner_runs_in_check_mode_or_a_real_run(lab, capsys, tmp_path):
    lab.dirty()
    markers = hostile(lab, tmp_path)
    before = snapshot(lab.root)
    # The owner's filters are defined in their config and named in .gitattributes: git runs as the owner with the
    # owner's own config (issue 40, item 9), so the owner's programs run, as the owner, never as root. This "filter"
    # speaks no filter protocol: git fails, a problem, in check mode and a real run, and nothing is changed.
    for check_mode in (True, False):
        refused = lab.run(capsys, check_mode=check_mode)
        assert refused["failed"] is True and "could not read everything: `git status" in refused["msg"], refused
        assert snapshot(lab.root) == before  # nothing written
    if os.geteuid() == 0:
        ran = {os.stat(markers / name).st_uid for name in os.listdir(markers)}
        assert 0 not in ran, "the owner's config ran as root"  # (test_training_code_filters: it runs as the owner)
    for name in os.listdir(markers):
        os.unlink(markers / name)
    (lab.repo / ".gitattributes").write_text("*.py diff=evil\n")
    check = lab.run(capsys, check_mode=True)
    assert sorted(os.listdir(markers)) == [], "a probe ran the owner's config"
    assert check["changed"] is True, check.get("msg")
    assert check["dirty"]["untracked"] == [".gitattributes", "scratch notes.txt"]
    real = lab.run(capsys)
    assert sorted(os.listdir(markers)) == [], "the reset ran the owner's config"
    assert (real["changed"], real["head"]) == (True, lab.pinned), real.get("msg")
    assert (lab.repo / "model.py").read_text() == MODEL_V1  # checked out as the blob: no smudge filter
    with tarfile.open(Path(real["backup"]["dir"]) / "changed.tar.gz") as tar:
        assert tar.extractfile("model.py").read() == PATCHED.encode()  # saved as the bytes: no clean filter
    # A fetch from the owner's remotes: the ext:: transport it allowed, its upload-pack and its ssh command are not
    # run either.
    for remote in ("evil", "sshy"):
        failed = lab.run(capsys, commit="ab" * 20, remote=remote)
        assert (failed["failed"], failed["error"]) == (True, "fetch"), failed
        assert sorted(os.listdir(markers)) == []


def test_the_view_gives_git_only_allowed_keys_and_the_real_config_is_untouched(lab, tmp_path):
    git(lab.repo, "config", "remote.origin.url", '/srv/up "quoted"\\path')
    hostile(lab, tmp_path)
    before = (lab.repo / ".git" / "config").read_bytes()
    view = ct_git.View("git", str(lab.repo), str(lab.repo / ".git"), str(lab.repo / ".git"))
    try:
        listed = subprocess.run(
            ["git", "config", "--list"], env=view.env, cwd=lab.repo, capture_output=True, text=True, check=True
        ).stdout.splitlines()
        assert sorted(line for line in listed if not line.startswith("safe.directory=")) == [
            "core.filemode=true",
            "core.repositoryformatversion=0",
            "remote.evil.url=ext::" + str(tmp_path / "mark.sh") + " ext",
            'remote.origin.url=/srv/up "quoted"\\path',
            "remote.sshy.url=ssh://127.0.0.1:9/nowhere.git",
        ]
        assert not os.path.exists(os.path.join(view.dir, "hooks"))
    finally:
        view.close()
    assert not os.path.exists(view.scratch)
    assert (lab.repo / ".git" / "config").read_bytes() == before
    assert (lab.repo / ".git" / "objects").is_dir()  # the links were removed, not followed


def test_the_view_config_keeps_only_allowed_keys_each_quoted():
    entries = [("core.filemode", "false"), ("filter.x.clean", "rm -rf /"), ("remote.a.b.url", 'x"\n[core]')]
    assert ct_git.config_text(entries) == '[core]\n\tfilemode = "false"\n[remote "a.b"]\n\turl = "x\\"\\n[core]"\n'


def strip_filter(lab, tmp_path):
    """nbstripout's effect: a clean filter that drops output lines (and writes a marker when it runs), installed in
    the owner's global config (``nbstripout --install --global``): the repository's config defines no filter, so
    the reset is not refused, and git run by the step reads no global config: the filter is not applied."""
    ran = tmp_path / "stripped"
    strip = tmp_path / "strip.sh"
    strip.write_text(f'#!/bin/sh\ntouch "{ran}"\ngrep -v "^output" || true\n')
    strip.chmod(0o755)
    (tmp_path / "home").mkdir(exist_ok=True)
    git(lab.repo, "config", "--global", "filter.strip.clean", str(strip))
    git(lab.repo, "config", "--global", "filter.strip.smudge", "cat")
    (lab.repo / ".gitattributes").write_text("*.ipynb filter=strip\n")
    (lab.repo / "nb.ipynb").write_text("cell 1\n")
    git(lab.repo, "add", ".gitattributes", "nb.ipynb")
    git(lab.repo, "commit", "-q", "-m", "notebook")
    lab.pinned = git(lab.repo, "rev-parse", "HEAD")
    (lab.repo / "nb.ipynb").write_text("cell 1\ncell 2\n")
    git(lab.repo, "commit", "-q", "-am", "a second cell")
    lab.later = git(lab.repo, "rev-parse", "HEAD")
    return ran


def test_notebook_outputs_a_clean_filter_hides_are_saved_as_bytes(lab, capsys, tmp_path):
    ran = strip_filter(lab, tmp_path)
    outputs = b"cell 1\ncell 2\noutput: loss 0.93\n"
    (lab.repo / "nb.ipynb").write_bytes(outputs)  # the notebook ran: its outputs exist only in the work tree
    ran.unlink(missing_ok=True)
    result = lab.run(capsys)
    assert not ran.exists(), "the owner's clean filter ran"
    assert (result["changed"], result["head"]) == (True, lab.pinned), result.get("msg")
    assert result["dirty"] == {"staged": [], "unstaged": [], "untracked": []}
    saved = Path(result["backup"]["dir"])
    with tarfile.open(saved / "changed.tar.gz") as tar:
        assert tar.extractfile("nb.ipynb").read() == outputs
    manifest = json.loads((saved / "manifest.json").read_text())
    assert manifest["changed.tar.gz"] == [
        {"path": "nb.ipynb", "kind": "file", "sha256": hashlib.sha256(outputs).hexdigest()}
    ]
    assert b"+output: loss 0.93" in (saved / "changes.patch").read_bytes()  # the patch is of the bytes too


def test_notebook_outputs_committed_through_a_clean_filter_are_saved_before_the_checkout(lab, capsys, tmp_path):
    strip_filter(lab, tmp_path)
    outputs = b"cell 1\ncell 2\ncell 3\noutput: loss 0.91\n"
    (lab.repo / "nb.ipynb").write_bytes(outputs)
    os.utime(lab.repo / "nb.ipynb", ns=(1_700_000_000_000_000_000,) * 2)  # not racily clean: git trusts its stat
    # The owner's git strips the outputs from the blob; the work tree keeps them.
    git(lab.repo, "commit", "-q", "-am", "a third cell, run")
    assert git(lab.repo, "status", "--porcelain") == ""  # git (stat cache) calls the tree clean
    result = lab.run(capsys)
    assert (result["changed"], result["head"]) == (True, lab.pinned), result.get("msg")
    assert result["backup"]["filtered"] == ["nb.ipynb"]
    with tarfile.open(Path(result["backup"]["dir"]) / "changed.tar.gz") as tar:
        assert tar.extractfile("nb.ipynb").read() == outputs


def test_an_untracked_file_under_a_directory_that_becomes_a_link_is_never_removed_through_it(lab, capsys, tmp_path):
    # The pinned commit has data -> ../outside (a link); the later one a directory data/ with a tracked file.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "notes.txt").write_text("not the repository's\n")
    git(lab.repo, "checkout", "-q", lab.pinned)
    (lab.repo / "data").symlink_to("../outside")
    git(lab.repo, "add", "data")
    git(lab.repo, "commit", "-q", "-m", "data lives outside")
    pinned = git(lab.repo, "rev-parse", "HEAD")
    git(lab.repo, "rm", "-q", "data")
    (lab.repo / "data").mkdir()
    (lab.repo / "data" / "a.txt").write_text("a\n")
    git(lab.repo, "add", "data")
    git(lab.repo, "commit", "-q", "-m", "data in the repository")
    (lab.repo / "data" / "notes.txt").write_text("mine\n")  # untracked
    result = lab.run(capsys, commit=pinned)
    assert (result["changed"], result["head"]) == (True, pinned), result.get("msg")
    assert (outside / "notes.txt").read_text() == "not the repository's\n"
    assert "data/notes.txt" not in result["removed"]
    with tarfile.open(Path(result["backup"]["dir"]) / "untracked.tar.gz") as tar:
        assert tar.extractfile("data/notes.txt").read() == b"mine\n"


def test_an_untracked_file_changed_after_it_was_saved_is_not_removed(tmp_path):
    (tmp_path / "f").write_text("saved\n")
    want = nofollow.entry_digest(str(tmp_path), "f")
    (tmp_path / "f").write_text("written since\n")
    assert nofollow.remove_entry(str(tmp_path), "f", want) is False
    assert (tmp_path / "f").read_text() == "written since\n"
    assert nofollow.remove_entry(str(tmp_path), "f", nofollow.entry_digest(str(tmp_path), "f")) is True
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("branch", ["evil;touch${IFS}pwned", "q'uote$(id)", "a&&b|c"])
def test_restore_txt_quotes_a_branch_name_for_the_shell(lab, capsys, branch):
    git(lab.repo, "checkout", "-q", "-b", branch)
    (lab.repo / "model.py").write_text(PATCHED)
    result = lab.run(capsys)
    text = (Path(result["backup"]["dir"]) / "RESTORE.txt").read_text()
    line = next(line for line in text.splitlines() if line.strip().startswith("git checkout"))
    assert list(shlex.shlex(line, posix=True, punctuation_chars=True)) == ["git", "checkout", branch]  # as sh splits
    assert f"(branch {shlex.quote(branch)})" in text


def test_backup_keep_keeps_the_newest_backups(lab, capsys):
    for _ in range(3):
        (lab.repo / "model.py").write_text(PATCHED)
        result = lab.run(capsys, backup_keep=2)
        assert result["changed"] is True, result.get("msg")
    assert sorted(os.listdir(lab.backups)) == STAMPS[1:3]
    assert result["pruned"] == [STAMPS[0]]


def old_backups(lab, count):
    lab.backups.mkdir()
    names = [f"20250101T0000{n:02d}Z" for n in range(count)]
    for name in names:
        (lab.backups / name).mkdir()
        (lab.backups / name / "HEAD").write_text("old\n")
    (lab.backups / "notes").mkdir()  # not a backup's name: never removed
    return names


def test_unattended_runs_keep_ten_backups_the_newest_always_and_attended_runs_keep_every_one(lab, capsys):
    names = old_backups(lab, 12)
    (lab.repo / "model.py").write_text(PATCHED)
    attended = lab.run(capsys)
    assert attended["pruned"] == [] and len(os.listdir(lab.backups)) == 14
    git(lab.repo, "checkout", "-q", lab.later)
    (lab.repo / "model.py").write_text(PATCHED)
    unattended = lab.run(capsys, unattended=True)
    assert unattended["changed"] is True, unattended.get("msg")
    assert unattended["pruned"] == names[:4]
    assert sorted(os.listdir(lab.backups)) == [*names[4:], *STAMPS[:2], "notes"]
    # keep 1: only this run's backup stays.
    git(lab.repo, "checkout", "-q", lab.later)
    (lab.repo / "model.py").write_text(PATCHED)
    assert lab.run(capsys, backup_keep=1)["backup"]["dir"] == str(lab.backups / STAMPS[2])
    assert sorted(os.listdir(lab.backups)) == [STAMPS[2], "notes"]


def test_unattended_a_repository_a_live_job_works_in_is_not_reset(lab, capsys):
    lab.dirty()
    job = subprocess.Popen(["sleep", "300"], cwd=lab.repo / "checkpoints")  # a job started in the repository
    try:
        before = lab.status()
        for check_mode in (True, False):
            result = lab.run(capsys, check_mode=check_mode, unattended=True)
            assert (result["changed"], result["changes"], result["backup"]) == (False, [], None), result
            assert [u["pid"] for u in result["in_use"]] == [job.pid]
            (sentence,) = result["needs_window"]
            assert f"pid {job.pid} (sleep" in sentence and f"cwd {lab.repo}/checkpoints) uses it" in sentence
        assert lab.status() == before and not lab.backups.exists()
    finally:
        job.kill()
        job.wait()
    # Attended, or once the job is gone, the reset is done.
    assert lab.run(capsys, unattended=True)["head"] == lab.pinned


# -- the role ---------------------------------------------------------------------------------------------------
def role_file(path):
    return yaml.safe_load((ROOT / "roles" / "training_code" / path).read_text())


def test_the_role_declares_retention_and_unattended_and_passes_them_on():
    defaults = role_file("defaults/main.yml")
    options = role_file("meta/argument_specs.yml")["argument_specs"]["main"]["options"]
    assert set(defaults) == set(options) - {"pve_vmid", "pve_node"}  # every variable described, nothing else
    assert defaults["training_code_backup_keep"] is None and options["training_code_backup_keep"]["type"] == "int"
    assert defaults["training_code_unattended"] == "{{ recover_unattended | default(false) }}"
    assert options["training_code_unattended"]["type"] == "bool"
    (acting,) = role_file("tasks/main.yml")
    assert acting["pve_gpu.recover.training_code"]["unattended"] == "{{ training_code_unattended }}"
    assert acting["pve_gpu.recover.training_code"]["backup_keep"] == (
        "{{ training_code_backup_keep if training_code_backup_keep is not none else omit }}"
    )
    assert set(acting["pve_gpu.recover.training_code"]) <= set(training_code.ARGUMENT_SPEC)


def test_a_failure_naming_a_path_the_target_chose_is_one_printable_line():
    answer = {
        "error": "conflict",
        "message": "/srv/train has unmerged paths: a\nCT 200: in spec\x1b[2J; resolve them",
        "backup": None,
        "touched": False,
    }
    with pytest.raises(code_acting.CodeError) as caught:
        code_acting.done_of(answer, "/srv/train")
    assert str(caught.value) == (
        "resetting the training code failed (conflict): /srv/train has unmerged paths: a\\nCT 200: in spec\\x1b[2J; "
        "resolve them; /srv/train was left as it was"
    )
    with pytest.raises(code_acting.CodeError) as caught:
        code_acting.done_of(dict(answer, error="x\ny"), "/srv/train")
    assert caught.value.kind == "probe"


GOOD_DONE = {
    "head": "4f3c2a1b0e9d" * 3 + "abcd",
    "fetched": False,
    "removed": [],
    "pruned": [],
    "backup": {"dir": "/var/backups/pve-gpu-recover/training_code/20261203T101500Z", "files": ["HEAD"]},
    "kept_ref": None,
    "head_before": None,
    "branch_before": None,
}


@pytest.mark.parametrize(
    ("changed", "wrong"),
    [
        ({"backup": {"files": ["HEAD"]}}, "backup has no 'dir' (a path)"),
        ({"backup": {"dir": 7}}, "backup has no 'dir' (a path)"),
        ({"backup": {"dir": "/b", "files": [1]}}, "backup files is not a list of names"),
        ({"removed": [{"x": 1}]}, "removed is not a list of paths"),
        ({"pruned": [None]}, "pruned is not a list of paths"),
    ],
)
def test_a_reset_answer_in_another_shape_is_a_named_failure_not_a_traceback(changed, wrong):
    # The module reads done["backup"]["dir"] when the re-read is out of spec: a backup without it was a KeyError.
    with pytest.raises(code_acting.CodeError) as caught:
        code_acting.done_of(dict(GOOD_DONE, **changed), "/srv/train")
    assert str(caught.value) == f"the reset script's answer is not in the expected shape: {wrong}"
    assert caught.value.kind == "probe"
    assert code_acting.done_of(dict(GOOD_DONE), "/srv/train") == GOOD_DONE
