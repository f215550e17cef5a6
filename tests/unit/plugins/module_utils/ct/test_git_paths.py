"""Where the training repository lies (ct/git_paths.py): its path is opened by the compile cache's opener
(ct_fs.open_root) with root and the repository's owner trusted, so a repository that a user other than root and its
owner could have put in place (a directory above it writable by others without the sticky bit, or another user's
directory) is refused like a link on the way (issue 40, item 1: alice, who owns /home/alice, could swap
/home/alice/train for root's repository even without a link). Everything after the open works on the opened
directory (/proc/self/fd/<fd>): a path swapped for a link after the check is never followed, a read at a commit
included. Real directories and git repositories in a directory of the test's own under /tmp (other users must
reach them); no network, no sleep.
"""

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git as ct_git
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git_paths as ct_git_paths
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import probe as code_probe

from tests.unit.library.test_training_code import git

ALICE, BOB = 4242, 4343

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="gives directories to other users: needs root")


@pytest.fixture
def scratch():
    """A directory of the test's own under /tmp (root's, 0755): its parents are root's, so only what the test
    puts below it decides."""
    top = Path(tempfile.mkdtemp(prefix="pve-gpu-recover-paths-", dir="/tmp"))
    top.chmod(0o755)
    try:
        yield top
    finally:
        shutil.rmtree(top)


def repository(path, owner=0):
    """A git repository at ``path`` with one commit (train.lock: ``six==1.17.0``), every file of ``owner``."""
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    (path / "train.lock").write_text(f"six==1.17.0  # {path.name}\n")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "lock")
    commit = git(path, "rev-parse", "HEAD")
    for directory, dirs, files in os.walk(path):
        for name in [*dirs, *files, "."]:
            os.lchown(os.path.join(directory, name), owner, owner)
    return commit


def directory(path, owner, mode):
    path.mkdir()
    os.chown(path, owner, owner)
    path.chmod(mode)
    return path


def opened(path):
    """What open_top makes of ``path``: ``"opened"`` (and the fd is closed) or the Refused sentence."""
    try:
        os.close(ct_git_paths.open_top(str(path)))
    except ct_git_paths.Refused as error:
        return str(error)
    return "opened"


def test_a_repository_under_a_directory_every_user_may_write_is_refused(scratch):
    shared = directory(scratch / "shared", 0, 0o777)
    repository(shared / "train")
    said = opened(shared / "train")
    assert said == (
        f"the training repository {shared}/train cannot be trusted: it lies under {shared}, which every user may "
        "write (mode 0777, no sticky bit): any of them could put another directory in its place; a repository is "
        "used only where no user but root and its owner could have put it or anything above it: move it there, or "
        "set the owner and mode of the directory named"
    )
    # The probe (check mode and the fact pass) reads nothing there, and says why in one sentence.
    answer = code_probe.probe({"path": str(shared / "train"), "commit": "0" * 40, "git": "git", "timeout": 30})
    assert (answer["linked"], answer["exists"], answer["head"], answer["git"]) == (said, True, None, None)
    # Sticky, as /tmp is, only the entry's owner may move it: trusted.
    shared.chmod(0o1777)
    assert opened(shared / "train") == "opened"


def test_a_repository_of_roots_in_another_users_directory_is_refused_without_any_link(scratch):
    """alice owns /home/alice: she could rename train away and put any directory (or link) in its place."""
    home = directory(scratch / "alice", ALICE, 0o755)
    repository(home / "train")
    assert opened(home / "train") == (
        f"the training repository {home}/train cannot be trusted: it lies under {home}, owned by uid {ALICE}, who "
        "could put any directory in its place; a repository is used only where no user but root and its owner "
        "could have put it or anything above it: move it there, or set the owner and mode of the directory named"
    )
    # alice's own repository in her own home is hers to change anyway: opened.
    shutil.rmtree(home / "train")
    repository(home / "train", ALICE)
    assert opened(home / "train") == "opened"


def test_a_repository_another_user_put_in_a_sticky_directory_is_refused(scratch):
    """In a sticky directory (/tmp) bob's directory can hold a repository of alice's that bob may swap."""
    sticky = directory(scratch / "tmp", 0, 0o1777)
    bobs = directory(sticky / "bob", BOB, 0o777)
    repository(bobs / "train", ALICE)
    said = opened(bobs / "train")
    assert said.startswith(f"the training repository {bobs}/train cannot be trusted: {bobs} is owned by uid {BOB}, but")
    assert f"in {sticky} only root (uid 0) or uid {ALICE} can be trusted (another user may have put it there)" in said


def test_a_link_on_the_way_is_named_with_who_owns_its_directory(scratch):
    home = directory(scratch / "alice", ALICE, 0o755)
    repository(scratch / "rootrepo")
    os.symlink(scratch / "rootrepo", home / "train")
    assert opened(home / "train") == (
        f"{home}/train is a symlink (to {scratch}/rootrepo) in {home}, owned by uid {ALICE}: the training repository "
        "is never reached through a link (whoever may change that directory could point it at another repository, "
        "one of root's); set the path to the repository itself"
    )


def test_no_directory_or_a_file_is_an_os_error_not_a_refusal(scratch):
    with pytest.raises(FileNotFoundError):
        ct_git_paths.open_top(str(scratch / "none" / "train"))
    (scratch / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        ct_git_paths.open_top(str(scratch / "file"))


def test_a_read_at_a_commit_reads_the_directory_it_opened_even_when_the_path_is_swapped_after(scratch, monkeypatch):
    """The path is swapped for a link to another repository right after it was opened (a hook in open_top, the
    window between the check and git's calls): the lock read is the opened repository's, never the other's."""
    commit = repository(scratch / "train")
    repository(scratch / "other")
    opener = ct_git.open_top

    def open_then_swap(path):
        fd = opener(path)
        os.rename(scratch / "train", scratch / "train.moved")
        os.symlink(scratch / "other", scratch / "train")
        return fd

    monkeypatch.setattr(ct_git, "open_top", open_then_swap)
    found = ct_git.read_at_commit("git", str(scratch / "train"), commit, "train.lock", deadline=time.monotonic() + 30)
    assert found == {"text": "six==1.17.0  # train\n", "missing": None, "error": None}
