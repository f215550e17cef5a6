"""The training code step against a repository owner who plants links and names in .git, or whose parent's owner
swaps the repository for a link (review of the git view): root's git never writes through the owner's links (git's
writes run as the owner), a .git file naming another user's git dir is refused, removal works from the fd opened at
the start, the checkout is never started without time left, and a repository whose config defines clean/smudge
filters (git-lfs) is never reset without them. Real git repositories in tmp_path, owned by nobody where ownership
matters; the probe part and the reset script run in-process.
"""

import os
import shutil
import tarfile
import time
from types import SimpleNamespace

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import script

from tests.unit.library.test_training_code import MODEL_V1, git, snapshot
from tests.unit.library.test_training_code_untrusted import give_to_nobody
from tests.unit.library.test_training_code_untrusted import lab as untrusted_lab

lab = untrusted_lab  # the fixture, under the name the tests ask for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chowns a repository to nobody: needs root")


def victim(tmp_path):
    """A file of root's outside the repository (in bare mode: /etc/sudoers)."""
    path = tmp_path / "victim"
    path.write_bytes(b"root's own bytes\n")
    return path


def test_a_reflog_link_the_owner_plants_is_never_written_through_by_root(lab, capsys, tmp_path):
    target = victim(tmp_path)
    (lab.repo / "model.py").write_text("debug hack\n")
    logs = lab.repo / ".git" / "logs" / "HEAD"
    logs.unlink()
    logs.symlink_to(target)
    give_to_nobody(lab.repo)
    result = lab.run(capsys)
    assert target.read_bytes() == b"root's own bytes\n", "root's git appended a reflog line through the link"
    # git, run as nobody, may not write root's file: the owner's link breaks only the owner's reset (after the
    # backup: their changes are saved).
    assert result["failed"] is True and "unable to append" in result["msg"], result
    (backup,) = lab.backups.iterdir()
    assert os.stat(backup).st_uid == 0 and (backup / "changes.patch").read_bytes()


def test_a_fetch_head_link_the_owner_plants_is_never_written_through_by_root(lab, capsys, tmp_path):
    target = victim(tmp_path)
    upstream = tmp_path / "upstream.git"
    git(tmp_path, "clone", "-q", "--bare", lab.repo, upstream)
    git(lab.repo, "reset", "-q", "--hard", lab.pinned)
    git(lab.repo, "reflog", "expire", "--expire=now", "--all")
    git(lab.repo, "gc", "-q", "--prune=now")
    assert git(lab.repo, "cat-file", "-t", lab.later, check=False) == ""  # the pin is missing locally
    (lab.repo / ".git" / "FETCH_HEAD").symlink_to(target)
    give_to_nobody(lab.repo)
    for parent in upstream.parents:
        parent.chmod(parent.stat().st_mode | 0o111)
    upstream.chmod(0o755)
    result = lab.run(capsys, commit=lab.later, remote=str(upstream))
    assert target.read_bytes() == b"root's own bytes\n", "root's fetch rewrote the victim through FETCH_HEAD"
    assert result.get("fetched") is True or result.get("failed"), result


def test_a_shallow_clone_of_the_owners_is_deepened_by_a_fetch_run_as_the_owner(lab, capsys, tmp_path):
    target = victim(tmp_path)
    upstream = tmp_path / "upstream.git"
    git(tmp_path, "clone", "-q", "--bare", lab.repo, upstream)
    git(upstream, "config", "uploadpack.allowAnySHA1InWant", "true")
    shallow = tmp_path / "shallow"
    git(tmp_path, "clone", "-q", "--depth=1", f"file://{upstream}", shallow)
    assert (shallow / ".git" / "shallow").exists()
    (shallow / ".git" / "shallow.pve-gpu-recover").symlink_to(target)
    give_to_nobody(shallow)
    give_to_nobody(upstream)  # git as nobody reads upstream (upload-pack checks its owner)
    result = lab.run(capsys, path=str(shallow), commit=lab.pinned, remote=f"file://{upstream}")
    assert target.read_bytes() == b"root's own bytes\n", "settle copied the shallow file through the link"
    assert (result.get("head"), result.get("fetched")) == (lab.pinned, True), result


def test_settle_writes_the_new_shallow_file_under_a_fresh_name_never_through_a_planted_link(tmp_path):
    target = victim(tmp_path)
    view, common = tmp_path / "view", tmp_path / "common"
    view.mkdir()
    common.mkdir()
    (view / "shallow").write_bytes(b"deepened\n")  # what git wrote in the view's common dir
    (common / "shallow").write_bytes(b"old\n")
    (common / "shallow.pve-gpu-recover").symlink_to(target)  # planted by the owner
    reset = SimpleNamespace(view=SimpleNamespace(dir=str(view), owned=None, owner=None, common=str(common)))
    script.Reset.settle(reset)
    assert target.read_bytes() == b"root's own bytes\n"
    assert (common / "shallow").read_bytes() == b"deepened\n"
    assert not (common / "shallow.pve-gpu-recover").exists()


def test_a_git_file_naming_another_users_git_dir_is_refused(lab, capsys, tmp_path):
    # bob: the Lab's repository, root's here (etckeeper's /etc/.git would do); alice: nobody, a .git file naming it.
    git(lab.repo, "checkout", "-q", "main")
    before = snapshot(lab.repo / ".git")
    alice = tmp_path / "alice"
    alice.mkdir()
    (alice / "model.py").write_text(MODEL_V1)
    (alice / ".git").write_text(f"gitdir: {lab.repo / '.git'}\n")
    give_to_nobody(alice)
    for check_mode in (True, False):
        result = lab.run(capsys, check_mode=check_mode, path=str(alice))
        assert result["failed"] is True and "untrusted git dir" in result["msg"], result
        assert "not by the work tree's owner" in result["msg"]
    assert snapshot(lab.repo / ".git") == before, "bob's HEAD or index was written"
    refused = script.probe(
        {"path": str(alice), "commit": lab.pinned, "backup_dir": str(lab.backups), "stamp": "s", "timeout": 60}
    )
    assert refused["error"] == "untrusted" and refused["touched"] is False, refused
    assert snapshot(lab.repo / ".git") == before


def test_a_repository_swapped_for_a_link_after_the_checkout_is_never_removed_through(
    lab, capsys, tmp_path, monkeypatch
):
    # The owner of the repository's parent renames it after the checkout and puts a link at its path, to a directory
    # whose file has the bytes of an untracked file the reset saved (and will remove).
    (lab.repo / "notes.txt").write_text("same bytes\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "notes.txt").write_text("same bytes\n")
    moved = tmp_path / "moved"
    (outside / ".git").symlink_to(moved / ".git")  # so that git calls by path still find the repository
    reset = script.Reset.reset

    def swapped(self, head):
        reset(self, head)
        os.rename(lab.repo, moved)
        os.symlink(outside, lab.repo)

    monkeypatch.setattr(script.Reset, "reset", swapped)
    result = lab.run(capsys)
    assert (outside / "notes.txt").read_text() == "same bytes\n", "root removed a file through the link"
    assert not (moved / "notes.txt").exists() or result.get("failed"), result  # removed from the one opened
    (backup,) = lab.backups.iterdir()
    with tarfile.open(backup / "untracked.tar.gz") as tar:
        assert tar.extractfile("notes.txt").read() == b"same bytes\n"


def test_the_checkout_is_not_started_without_time_left_and_the_backup_stays_complete(lab, capsys, monkeypatch):
    (lab.repo / "model.py").write_text("debug hack\n")
    before = lab.status()
    save = script.Reset.save

    def slow_save(self, *args):
        done = save(self, *args)
        self.deadline = self.git.deadline = time.monotonic() + 1.0  # saving used all but one second
        return done

    monkeypatch.setattr(script.Reset, "save", slow_save)
    result = lab.run(capsys)
    assert result["failed"] is True and "resetting the training code failed (timeout)" in result["msg"], result
    assert lab.status() == before and git(lab.repo, "rev-parse", "HEAD") == lab.later  # nothing reset
    (backup,) = lab.backups.iterdir()
    assert sorted(os.listdir(backup)) == [
        "HEAD",
        "RESTORE.txt",
        "changed.tar.gz",
        "changes.patch",
        "manifest.json",
        "staged.patch",
        "status.txt",
    ]
    assert not (lab.repo / ".git" / "index.lock").exists()


def test_saving_stops_at_the_deadline_and_nothing_is_reset(lab, capsys, monkeypatch):
    (lab.repo / "model.py").write_text("debug hack\n")
    (lab.repo / "big.txt").write_text("untracked\n")
    before = lab.status()
    write = script.Reset.write_tarball

    def late(self, target, paths):
        deadline, self.deadline = self.deadline, time.monotonic() - 1.0  # the time runs out while saving
        try:
            return write(self, target, paths)
        finally:
            self.deadline = deadline

    monkeypatch.setattr(script.Reset, "write_tarball", late)
    result = lab.run(capsys)
    assert result["failed"] is True and "(timeout)" in result["msg"], result
    assert lab.status() == before and git(lab.repo, "rev-parse", "HEAD") == lab.later
    assert list(lab.backups.iterdir()) == []  # an incomplete backup is removed


def lfs(lab):
    """git-lfs as `git lfs install --local` leaves it: filter.lfs.* in the repository's config (git-lfs itself is
    not installed here)."""
    for key, value in (
        ("filter.lfs.clean", "git-lfs clean -- %f"),
        ("filter.lfs.smudge", "git-lfs smudge -- %f"),
        ("filter.lfs.process", "git-lfs filter-process"),
        ("filter.lfs.required", "true"),
    ):
        git(lab.repo, "config", key, value)


@pytest.mark.skipif(shutil.which("git-lfs") is not None, reason="git-lfs is installed here")
def test_a_repository_using_lfs_without_git_lfs_is_refused_when_a_reset_is_due_and_left_as_it_was(lab, capsys):
    (lab.repo / ".gitattributes").write_text("*.bin filter=lfs diff=lfs merge=lfs -text\n")
    git(lab.repo, "add", ".gitattributes")
    git(lab.repo, "commit", "-q", "-m", "lfs")
    pinned = git(lab.repo, "rev-parse", "HEAD")
    git(lab.repo, "checkout", "-q", lab.pinned)
    lfs(lab)
    before = snapshot(lab.root)
    for check_mode in (True, False):
        result = lab.run(capsys, check_mode=check_mode, commit=pinned)
        assert result["failed"] is True, result
        assert "clean/smudge filters whose programs are not in the target (lfs runs `git-lfs`)" in result["msg"], result
        assert "apt install git-lfs" in result["msg"]
        assert snapshot(lab.root) == before
    # At the commit and clean: nothing is due, nothing refused.
    git(lab.repo, "-c", "filter.lfs.process=cat", "-c", "filter.lfs.smudge=cat", "checkout", "-q", pinned)
    assert lab.run(capsys, commit=pinned)["changed"] is False
