"""The backup's proof copies the repository's index (backups.py, copy_index) through the git dir's fd, never through
a link (issue 40, review items 1 and 9): for a repository with filters the copy goes to the owner's git, so an
owner who swaps ``.git/index`` for a link to a file of root's (/etc/shadow) while the backup is written would read
root's file. A real filtered repository of nobody's (test_training_code_filters.py) and a real link made right
before the proof; the reset stops ``untrusted``, nothing of root's file reaches anything of the owner's, nothing is
reset, the backup is removed.
"""

import os

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import backups, git_runner, script

from tests.unit.library.test_training_code import snapshot, without
from tests.unit.library.test_training_code_filters import filtered  # noqa: F401 (the fixture)
from tests.unit.library.test_training_code_untrusted import NOBODY

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="gives a repository to another user: needs root")

SECRET = b"root:$y$j9T$secret-hash-of-root:19700:0:99999:7:::\n"


def payload(lab):
    return {
        "path": str(lab.repo),
        "commit": lab.pinned,
        "remote": None,
        "backup_dir": str(lab.backups),
        "git": "git",
        "stamp": "20261203T101500Z",
        "timeout": 60,
    }


@pytest.mark.parametrize("swap", ["link", "roots_file"])
def test_an_index_the_owner_swaps_during_the_backup_is_never_copied_for_them(filtered, monkeypatch, swap):  # noqa: F811
    lab, _ = filtered
    private = lab.root / "root-only"
    private.mkdir(mode=0o700)
    shadow = private / "shadow"
    shadow.write_bytes(SECRET)
    shadow.chmod(0o600)
    index = lab.repo / ".git" / "index"
    given = []  # the bytes of every index file a git call was given (GIT_INDEX_FILE), and as whom

    run = git_runner.Git.run

    def recording(self, *args, env=None, **kwargs):
        path = (env or {}).get("GIT_INDEX_FILE")
        if path and os.path.exists(path):
            given.append((args[0], os.stat(path).st_uid, open(path, "rb").read()))  # noqa: SIM115
        return run(self, *args, env=env, **kwargs)

    prove = backups.Backup.prove_patches

    def swapped_first(self, directory, head):
        # The owner, while the backup is written: .git is theirs, so they may replace its index.
        os.unlink(index)
        if swap == "link":
            os.symlink(shadow, index)
            os.lchown(index, NOBODY, NOBODY)
        else:  # a file of root's with root's bytes (no link at all): never handed to the owner either
            index.write_bytes(SECRET)
        return prove(self, directory, head)

    monkeypatch.setattr(git_runner.Git, "run", recording)
    monkeypatch.setattr(backups.Backup, "prove_patches", swapped_first)
    before = snapshot(lab.repo)
    answer = script.probe(payload(lab))
    assert answer["error"] == "untrusted", answer
    found = "a symlink" if swap == "link" else "owned by uid 0"
    assert answer["message"] == (
        f"{lab.repo}/.git/index is {found}; the index is copied only as a regular file of one name, the work tree's "
        f"owner's (uid {NOBODY}), never through a link: remove it and run again; nothing was reset"
    )
    assert not any(SECRET in data for _, _, data in given), "root's file was handed to the owner's git"
    assert (answer["touched"], answer["backup"]) == (False, None)
    assert os.listdir(lab.backups) == []  # the backup is removed
    changed = {".git", ".git/index"}  # the owner's own swap
    assert without(snapshot(lab.repo), *changed) == without(before, *changed)
    assert shadow.read_bytes() == SECRET


def test_the_index_of_the_owner_is_copied_for_the_proof_and_the_reset_goes_on(filtered, monkeypatch):  # noqa: F811
    """The same run without a swap: the owner's git is given a copy of their own index, the reset completes."""
    lab, _ = filtered
    given = []
    run = git_runner.Git.run

    def recording(self, *args, env=None, **kwargs):
        path = (env or {}).get("GIT_INDEX_FILE")
        if args[0] == "stash" and path:
            given.append((os.stat(path).st_uid, open(path, "rb").read()))  # noqa: SIM115
        return run(self, *args, env=env, **kwargs)

    prove, index = backups.Backup.prove_patches, []

    def reading_first(self, directory, head):
        index.append((lab.repo / ".git" / "index").read_bytes())
        return prove(self, directory, head)

    monkeypatch.setattr(git_runner.Git, "run", recording)
    monkeypatch.setattr(backups.Backup, "prove_patches", reading_first)
    answer = script.probe(payload(lab))
    assert answer.get("error") is None and answer["head"] == lab.pinned, answer
    assert given == [(NOBODY, index[0])] and index[0].startswith(b"DIRC")
