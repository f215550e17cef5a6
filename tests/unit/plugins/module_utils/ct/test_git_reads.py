"""git's reads in the target end at their deadline with everything git started: the training code probe's calls,
the view's config read and a lock read from a commit (ct_git.read, through ct_run.run). A git that hangs
is a real process tree here: a wrapper around the real git that, for one subcommand, starts a child and sleeps;
both must be gone when the read answers, and the answer must come near the deadline, not after the sleep."""

import os
import shutil
import stat
import time

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git as ct_git
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import probe as code_probe

from tests.unit.library.test_training_code import Lab
from tests.unit.library.test_training_code import git as run_git

REAL_GIT = shutil.which("git")


def hanging_git(tmp_path, subcommand):
    """A git that runs the real one, except for ``subcommand``: then it starts a child that sleeps (its pid written
    to ``children``) and sleeps itself. Returns (its path, the file of the pids it started)."""
    pids = tmp_path / "children"
    wrapper = tmp_path / "bin" / "git"
    wrapper.parent.mkdir()
    wrapper.write_text(
        "#!/bin/sh\n"
        f'for arg in "$@"; do if [ "$arg" = {subcommand} ]; then\n'
        f"  sleep 300 & echo $! >> {pids}; echo $$ >> {pids}; exec sleep 300\n"
        "fi; done\n"
        f'exec {REAL_GIT} "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper), pids


def gone(pids):
    """Whether every pid in ``pids`` has exited (a zombie of this process counts as gone: it runs nothing)."""
    for pid in map(int, pids.read_text().split()):
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]  # noqa: SIM115
        except FileNotFoundError:
            continue
        if state != "Z":
            return False
    return True


@pytest.fixture
def lab(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return Lab(tmp_path, monkeypatch)


@pytest.mark.parametrize("subcommand", ["status", "config"])
def test_a_probe_git_call_past_its_deadline_is_killed_with_what_it_started(lab, tmp_path, subcommand):
    """``status`` hangs (a huge tree, a slow disk); ``config`` is the view's read of the repository's config."""
    git, pids = hanging_git(tmp_path, subcommand)
    views_before = views()
    started = time.monotonic()
    answer = code_probe.probe({"path": str(lab.repo), "commit": lab.pinned, "git": git, "timeout": 1})
    took = time.monotonic() - started
    assert took < 10, f"the probe answered after {took:.1f} s: it waited for the hung git"
    assert len(pids.read_text().split()) == 2 and gone(pids), "git or its child outlived the deadline"
    [said] = answer["errors"]
    assert "did not finish in time and was killed with what it started" in said, said
    if subcommand == "status":
        assert said.startswith("`git status --porcelain=v1") and f"(in {lab.repo}, within the probe's timeout)" in said
        assert answer["head"] == lab.later  # what was read before the deadline is kept
    else:
        assert said.startswith(f"`git config --file {lab.repo}/.git/config --list --null` did not finish"), said
        assert said.endswith(f"(reading the repository's config in {lab.repo}/.git, within the probe's timeout)")
    assert views() == views_before, "the probe left its scratch view behind"


def views():
    """The scratch views (ct_git.View) in the directory they are made in."""
    root = ct_git.scratch_root()
    return {name for name in os.listdir(root) if name.startswith("pve-gpu-recover-git-")}


def test_a_lock_read_from_a_commit_past_its_deadline_is_killed_with_what_it_started(lab, tmp_path):
    (lab.repo / "train.lock").write_text("six==1.17.0\n")
    run_git(lab.repo, "add", "train.lock")
    run_git(lab.repo, "commit", "-q", "-m", "lock")
    commit = run_git(lab.repo, "rev-parse", "HEAD")
    wrapper, pids = hanging_git(tmp_path, "cat-file")
    views_before = views()
    started = time.monotonic()
    found = ct_git.read_at_commit(wrapper, str(lab.repo), commit, "train.lock", deadline=time.monotonic() + 1)
    assert time.monotonic() - started < 10
    assert gone(pids) and views() == views_before
    where = f"train.lock in commit {commit[:12]} of {lab.repo}"
    assert found["text"] is None, found
    assert found["error"].startswith(f"reading {where} did not finish within the probe's time: `git cat-file"), found
    # The same read with the real git answers the text.
    assert ct_git.read_at_commit(REAL_GIT, str(lab.repo), commit, "train.lock", deadline=time.monotonic() + 30) == {
        "text": "six==1.17.0\n",
        "missing": None,
        "error": None,
    }


def test_a_read_whose_time_is_up_starts_no_git(tmp_path):
    wrapper, pids = hanging_git(tmp_path, "status")
    with pytest.raises(ct_git.Unfinished, match=r"the time was up before `git status`"):
        ct_git.read(ct_git.git_argv(wrapper, str(tmp_path), ["status"]), {}, time.monotonic() - 1)
    assert not pids.exists()


def test_a_git_that_cannot_be_started_is_named(tmp_path):
    missing = str(tmp_path / "no-git")
    with pytest.raises(ct_git.Unfinished, match=rf"cannot run `{missing}`: it is not there"):
        ct_git.read([missing, "-C", str(tmp_path), "status"], {}, time.monotonic() + 10)
    not_executable = tmp_path / "git"
    not_executable.write_text("#!/bin/sh\n")
    with pytest.raises(ct_git.Unfinished, match=r"cannot run `.*/git`: Permission denied"):
        ct_git.read([str(not_executable), "status"], {}, time.monotonic() + 10)


def test_a_git_that_prints_without_end_is_cut_off_and_named_never_read_as_a_whole_listing(monkeypatch):
    monkeypatch.setattr(ct_git, "READ_CAP", 1 << 20)
    with pytest.raises(ct_git.Unfinished, match=r"`git ls-files -z` printed more than 1 MiB") as raised:
        ct_git.read(["sh", "-c", "yes | head -c 3000000", "-C", "/", "ls-files", "-z"], {}, time.monotonic() + 30)
    assert raised.value.timed_out is False


def test_a_large_listing_is_kept_whole_as_bytes():
    """A tree of 100,000 files lists in MBs: past ct_run's 4 MiB cap for untrusted tools' output."""
    size = ct_run.OUTPUT_CAP + 100_000
    rc, out, err = ct_git.read(["sh", "-c", f"head -c {size} /dev/zero; printf '\\377' >&2"], {}, time.monotonic() + 30)
    assert (rc, len(out), out[:1], err) == (0, size, b"\0", "\ufffd")
