"""The reset script and the probe part work on the repository they opened, never on its path again (issue 40,
review item 2): the top is opened from / without following a link (ct_git.open_top), and then ``git -C``,
``GIT_WORK_TREE``, the git dir and every read name the opened directory (/proc/self/fd/<fd>). Here the path is
swapped for a link to another repository (root's) right after the open, the window between the check and git's
calls (a hook in open_top): the reset saves and resets the opened repository and leaves the other one as it was;
the probe reports the opened one. Real repositories in tmp_path; no network, no sleep.
"""

import os

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git as ct_git
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import probe as code_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import script

from tests.unit.library.test_training_code import git, snapshot
from tests.unit.library.test_training_code import lab as code_lab

lab = code_lab  # the fixture, under the name the fixture below asks for


@pytest.fixture
def swapped(lab, monkeypatch):
    """``(lab, moved, other)``: the Lab's repository, dirty; ``other``, root's clone of it one commit further and
    dirty too; the first open_top of the Lab's path is followed by the swap: ``train`` renamed to ``moved`` and a
    link ``train`` -> ``other`` put in its place."""
    lab.dirty()
    other = lab.root / "other"
    git(lab.root, "clone", "-q", "--no-local", str(lab.repo), str(other))  # objects of its own, no hard links
    (other / "model.py").write_text("root's own work\n")
    git(other, "commit", "-q", "-am", "root's commit")
    (other / "model.py").write_text("root's own work, not committed yet\n")
    (other / "notes.txt").write_text("root's untracked notes\n")
    moved = lab.root / "moved"
    opener = ct_git.open_top
    done = []

    def open_then_swap(path):
        fd = opener(path)
        if path == str(lab.repo) and not done:
            done.append(path)
            os.rename(lab.repo, moved)
            os.symlink(other, lab.repo)
        return fd

    monkeypatch.setattr(ct_git, "open_top", open_then_swap)
    return lab, moved, other


def test_the_reset_works_on_the_directory_it_opened_never_on_what_the_path_became(swapped):
    repo, moved, other = swapped
    theirs = snapshot(other)
    answer = script.probe(
        {
            "path": str(repo.repo),
            "commit": repo.pinned,
            "remote": None,
            "backup_dir": str(repo.backups),
            "git": "git",
            "stamp": "20261203T101500Z",
            "timeout": 60,
        }
    )
    assert answer.get("error") is None, answer
    assert snapshot(other) == theirs, "the reset followed the path swapped for a link"
    # The repository it opened is at the pin and clean, its changes saved.
    assert (answer["head_before"], answer["head"]) == (repo.later, repo.pinned)
    assert git(moved, "rev-parse", "HEAD") == repo.pinned
    assert git(moved, "status", "--porcelain", "--untracked-files=all") == ""
    assert answer["backup"]["changed"] == 3 and answer["removed"] == ["scratch notes.txt"]
    assert (repo.backups / "20261203T101500Z" / "changes.patch").read_text().count("monkey-patch while debugging") == 1


def test_the_probe_reports_the_directory_it_opened_never_what_the_path_became(swapped):
    repo, _, other = swapped
    theirs = snapshot(other)
    answer = code_probe.probe({"path": str(repo.repo), "commit": repo.pinned, "git": "git", "timeout": 60})
    assert answer["errors"] == [] and answer["toplevel"] == str(repo.repo)
    assert answer["head"] == repo.later != git(other, "rev-parse", "HEAD")
    assert answer["status"] == "M  data.py\0 M model.py\0M  vocab.bin\0?? scratch notes.txt\0"
    assert snapshot(other) == theirs
