"""The training code step never reaches the repository through a link (issue 40, item 1): a user who owns a parent
directory of training_code_path (alice owns /home/alice; the path is /home/alice/train) replaces ``train`` by a link
to a repository of root's. The probe (check mode too), the reset and a read at a commit (the venv step's lock) are
refused with one sentence naming the link and who owns its directory; root's repository is left as it was. Real git
repositories in a directory of the test's own under /tmp; the probe part and the reset script run in-process.
"""

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git as ct_git
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import script

from tests.unit.library.test_training_code import Lab, git, snapshot

ALICE = 4242

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="gives a home directory to another user: needs root")


@pytest.fixture
def linked(monkeypatch):
    """``(lab, path)``: root's repository (the Lab's, dirty) and alice's home whose ``train`` links to it."""
    top = Path(tempfile.mkdtemp(prefix="pve-gpu-recover-links-", dir="/tmp"))
    try:
        top.chmod(0o755)
        monkeypatch.setenv("HOME", str(top / "roothome"))
        lab = Lab(top, monkeypatch)
        lab.dirty()
        home = top / "alice"
        home.mkdir()
        os.chown(home, ALICE, ALICE)
        link = home / "train"
        os.symlink(lab.repo, link)
        os.lchown(link, ALICE, ALICE)
        yield lab, link
    finally:
        shutil.rmtree(top)


def test_a_repository_behind_a_link_in_a_users_directory_is_refused_in_check_mode_and_a_real_run(linked, capsys):
    lab, link = linked
    before = snapshot(lab.repo)
    for check_mode in (True, False):
        result = lab.run(capsys, check_mode=check_mode, path=str(link))
        assert result.get("failed") is True, result
        assert f"{link} is a symlink (to {lab.repo})" in result["msg"], result["msg"]
        assert f"uid {ALICE}" in result["msg"] and str(link.parent) in result["msg"], result["msg"]
        assert snapshot(lab.repo) == before
    assert not lab.backups.exists()


def test_a_link_higher_up_is_refused_too(linked, capsys):
    lab, link = linked
    os.unlink(link)
    os.symlink(lab.root, link)  # /home/alice/train -> the directory that holds the repository
    result = lab.run(capsys, path=str(link / "train"))
    assert result.get("failed") is True and f"{link} is a symlink" in result["msg"], result
    assert git(lab.repo, "rev-parse", "HEAD") == lab.later


def test_the_reset_script_refuses_a_path_that_became_a_link_since_the_fact_pass(linked):
    lab, link = linked
    before = snapshot(lab.repo)
    payload = {
        "path": str(link),
        "commit": lab.pinned,
        "remote": None,
        "backup_dir": str(lab.backups),
        "git": "git",
        "stamp": "20261203T101500Z",
        "timeout": 60,
    }
    answer = script.probe(payload)
    assert answer["error"] == "untrusted" and answer["touched"] is False, answer
    assert f"{link} is a symlink" in answer["message"]
    assert snapshot(lab.repo) == before


def test_a_read_at_a_commit_never_follows_a_link(linked):
    lab, link = linked
    found = ct_git.read_at_commit("git", str(link), lab.pinned, "data.py", deadline=time.monotonic() + 60)
    assert found["text"] is None and f"{link} is a symlink (to {lab.repo})" in found["error"], found
    assert f"uid {ALICE}" in found["error"]
    # The repository itself, named by its path, reads as ever.
    found = ct_git.read_at_commit("git", str(lab.repo), lab.pinned, "data.py", deadline=time.monotonic() + 60)
    assert found == {"text": "BATCH = 32\n", "missing": None, "error": None}
