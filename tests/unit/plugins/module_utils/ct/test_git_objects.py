"""A file read from the training repository at a commit is what that commit holds, and the code step's "at its
commit and clean" is decided on the commit's own objects (issue 40, item 2): a replace ref (`git replace <pinned>
<other>`) is not followed, and an object whose bytes were overwritten (a loose object file of the commit, a tree or
the lock's blob) does not hash to its id and is named, never read as the pinned commit's. Real git repositories in
tmp_path; the probe part and ct_git.read_at_commit run in-process.
"""

import hashlib
import time
import zlib

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git as ct_git
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import acting as code_acting
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import probe as code_probe

from tests.unit.library.test_training_code import Lab, git, snapshot

GOOD = "six==1.17.0 --hash=sha256:" + "a" * 64 + "\n"
EVIL = "evil==6.6.6 --hash=sha256:" + "b" * 64 + "\n"


@pytest.fixture
def lab(tmp_path, monkeypatch):
    """The Lab's repository with a lock: pinned holds the good one, ``evil`` (a side commit) another."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    lab = Lab(tmp_path, monkeypatch)
    (lab.repo / "env").mkdir()
    (lab.repo / "env" / "train.lock").write_text(GOOD)
    git(lab.repo, "add", "-A")
    git(lab.repo, "commit", "-q", "-m", "lock")
    lab.pinned = git(lab.repo, "rev-parse", "HEAD")
    git(lab.repo, "checkout", "-q", "-b", "side")
    (lab.repo / "env" / "train.lock").write_text(EVIL)
    git(lab.repo, "commit", "-q", "-am", "evil lock")
    lab.evil = git(lab.repo, "rev-parse", "HEAD")
    git(lab.repo, "checkout", "-q", "--detach", lab.pinned)
    return lab


def read(lab, path="env/train.lock"):
    return ct_git.read_at_commit("git", str(lab.repo), lab.pinned, path, deadline=time.monotonic() + 60)


def overwrite(repo, object_id, kind, content):
    """Put ``<kind> <len>\\0<content>`` in the loose object file of ``object_id`` (a valid object, another id)."""
    path = repo / ".git" / "objects" / object_id[:2] / object_id[2:]
    path.chmod(0o644)
    path.write_bytes(zlib.compress(b"%s %d\0" % (kind, len(content)) + content))


def probe(lab):
    return code_probe.probe({"path": str(lab.repo), "commit": lab.pinned, "git": "git", "timeout": 60})


def test_a_replace_ref_is_not_followed_by_a_read_at_the_commit(lab):
    git(lab.repo, "replace", lab.pinned, lab.evil)
    assert git(lab.repo, "show", f"{lab.pinned}:env/train.lock") + "\n" == EVIL  # what git shows everyone else
    assert read(lab) == {"text": GOOD, "missing": None, "error": None}


def test_a_lock_blob_overwritten_in_the_object_database_is_named_not_read(lab):
    blob = git(lab.repo, "rev-parse", f"{lab.pinned}:env/train.lock")
    overwrite(lab.repo, blob, b"blob", EVIL.encode())
    assert git(lab.repo, "show", f"{lab.pinned}:env/train.lock") + "\n" == EVIL
    found = read(lab)
    assert found["text"] is None, found
    assert f"object {blob} does not hash to its id" in found["error"], found


def test_a_tree_on_the_way_overwritten_is_named_not_read(lab):
    tree = git(lab.repo, "rev-parse", f"{lab.pinned}:env")
    evil_tree = git(lab.repo, "rev-parse", f"{lab.evil}:env")
    raw = (lab.repo / ".git" / "objects" / evil_tree[:2] / evil_tree[2:]).read_bytes()
    content = zlib.decompress(raw).split(b"\0", 1)[1]
    overwrite(lab.repo, tree, b"tree", content)
    found = read(lab)
    assert found["text"] is None and f"object {tree} does not hash to its id" in found["error"], found


def test_a_clean_tree_at_a_replaced_commit_is_not_at_the_commit(lab):
    # HEAD is the pinned commit by its ref, the work tree holds the other commit's files: with the replace ref git
    # would call it clean.
    git(lab.repo, "checkout", "-q", "--detach", lab.evil)
    git(lab.repo, "replace", lab.pinned, lab.evil)
    git(lab.repo, "update-ref", "--no-deref", "HEAD", lab.pinned)
    assert git(lab.repo, "status", "--porcelain") == ""  # what git says with the replace ref
    answer = probe(lab)
    assert answer["head"] == lab.pinned and answer["errors"] == [], answer
    assert answer["status"] == "M  env/train.lock\0", answer


def test_a_commit_object_overwritten_is_a_problem_of_the_probe(lab):
    raw = zlib.decompress((lab.repo / ".git" / "objects" / lab.evil[:2] / lab.evil[2:]).read_bytes())
    git(lab.repo, "checkout", "-q", "--detach", lab.evil)
    overwrite(lab.repo, lab.pinned, b"commit", raw.split(b"\0", 1)[1])  # the pinned id, the other commit's tree
    (lab.repo / ".git" / "HEAD").write_text(lab.pinned + "\n")
    answer = probe(lab)
    # git 2.39 itself refuses the object here (HEAD reads as no commit); never "at the commit and clean".
    at_commit = answer["head"] == lab.pinned and answer["commit_present"]
    assert not (at_commit and answer["status"] == "" and not answer["errors"]), answer
    if at_commit:
        assert any(f"object {lab.pinned} does not hash to its id" in error for error in answer["errors"]), answer


def test_a_converged_repository_reads_as_ever(lab):
    answer = probe(lab)
    assert (answer["head"], answer["status"], answer["errors"]) == (lab.pinned, "", [])


def test_object_ids_are_hashed_per_the_repositorys_format():
    assert ct_git.object_id("sha1", "blob", b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
    assert ct_git.object_id("sha256", "blob", b"") == hashlib.sha256(b"blob 0\0").hexdigest()


def test_a_reset_to_a_commit_whose_blob_was_overwritten_is_refused_before_anything_changes(lab, capsys, monkeypatch):
    monkeypatch.setattr(code_acting, "utc_stamp", lambda: "20261203T101500Z")
    git(lab.repo, "checkout", "-q", "--detach", lab.evil)
    (lab.repo / "model.py").write_text("debug hack\n")
    blob = git(lab.repo, "rev-parse", f"{lab.pinned}:env/train.lock")
    overwrite(lab.repo, blob, b"blob", EVIL.encode())
    before = snapshot(lab.repo)
    result = lab.run(capsys)
    assert result.get("failed") is True and "(tampered)" in result["msg"], result
    assert f"object {blob} does not hash to its id" in result["msg"]
    assert snapshot(lab.repo) == before and not lab.backups.exists()
