"""Repositories with clean/smudge filters are recovered (issue 40, item 9): git runs as the repository's owner with
the owner's own filters and config (never another owner's configuration as root; root's own for a repository of
root's), reads included, so that status sees through the clean filter as the owner's git does; the backup still
holds the work tree's own bytes, read by the script from the files, never through a filter. A real filter here
(``rev``: each line reversed in the blob, self-inverse) records the uid it runs as; git-lfs itself is proven in the
lab (molecule/training_code). Real repositories in a directory of the test's own under /tmp (another user must
reach them).
"""

import os
import shutil
import tarfile
import tempfile
from pathlib import Path

import pytest

from tests.unit.library.test_training_code import Lab, git
from tests.unit.library.test_training_code_untrusted import NOBODY, give_to_nobody

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="gives a repository to another user: needs root")

TEXT = "first line\nsecond line\n"
LATER = "first line\nsecond line changed\n"
DIRTY = "first line\nsecond line, edited by hand\n"


@pytest.fixture
def filtered(monkeypatch):
    """``(lab, uids)``: the Lab's repository with a ``rev`` filter on *.dat (pinned: TEXT; later: LATER; the work
    tree dirty), owned by nobody; ``uids()`` answers the uids the filter ran as."""
    top = Path(tempfile.mkdtemp(prefix="pve-gpu-recover-filters-", dir="/tmp"))
    top.chmod(0o755)
    try:
        monkeypatch.setenv("HOME", str(top / "roothome"))
        monkeypatch.setattr(code_acting, "utc_stamp", lambda: "20261203T101500Z")
        marks = top / "marks"
        marks.mkdir(mode=0o777)
        marks.chmod(0o777)
        rev = top / "rev.sh"
        rev.write_text(f'#!/bin/sh\nid -u >> "{marks}/uids"\nexec rev\n')
        rev.chmod(0o755)
        lab = Lab(top, monkeypatch)
        git(lab.repo, "config", "filter.rev.clean", str(rev))
        git(lab.repo, "config", "filter.rev.smudge", str(rev))
        git(lab.repo, "config", "filter.rev.required", "true")
        (lab.repo / ".gitattributes").write_text("*.dat filter=rev\n")
        (lab.repo / "data.dat").write_text(TEXT)
        git(lab.repo, "add", "-A")
        git(lab.repo, "commit", "-q", "-m", "filtered data")
        lab.pinned = git(lab.repo, "rev-parse", "HEAD")
        (lab.repo / "data.dat").write_text(LATER)
        git(lab.repo, "commit", "-q", "-am", "later data")
        (lab.repo / "data.dat").write_text(DIRTY)
        (lab.repo / "notes.txt").write_text("untracked\n")
        give_to_nobody(lab.repo)
        (marks / "uids").write_text("")
        (marks / "uids").chmod(0o666)
        yield lab, lambda: set((marks / "uids").read_text().split())
    finally:
        shutil.rmtree(top)


def test_a_filtered_repository_is_reset_as_its_owner_with_its_filters_and_its_bytes_saved(filtered, capsys):
    lab, uids = filtered
    check = lab.run(capsys, check_mode=True)
    assert check.get("failed") is None and check["changed"] is True, check.get("msg")
    assert check["dirty"] == {"staged": [], "unstaged": ["data.dat"], "untracked": ["notes.txt"]}
    result = lab.run(capsys)
    assert (result["changed"], result["head"]) == (True, lab.pinned), result.get("msg")
    assert (lab.repo / "data.dat").read_text() == TEXT  # smudged through the owner's filter
    assert (lab.repo / "data.dat").stat().st_uid == NOBODY
    assert uids() == {str(NOBODY)}, "the owner's filter ran as another user"
    assert not (lab.repo / "notes.txt").exists()
    backup = Path(result["backup"]["dir"])
    with tarfile.open(backup / "changed.tar.gz") as tar:
        assert tar.extractfile("data.dat").read().decode() == DIRTY  # the work tree's bytes, not the clean side
    with tarfile.open(backup / "untracked.tar.gz") as tar:
        assert tar.extractfile("notes.txt").read() == b"untracked\n"
    # Converged: the next run reads it at the commit and clean (status through the owner's filter), changes nothing.
    assert lab.run(capsys)["changed"] is False
    assert uids() == {str(NOBODY)}


from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import acting as code_acting  # noqa: E402
