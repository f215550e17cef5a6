"""Preconditions (issue 21, item 3) of the training_code step: what it needs to do its work (the missing commit's
remote) is checked by the fact pass, so a run that cannot finish fails before any step changes anything, in --check
as in the real run."""

import os
import subprocess

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import facts as code_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import probe as code_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import worktree

from tests.unit.plugins.module_utils.steps.training_code import test_facts as code

LABEL = "CT 200 on pve1"
CT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# -- training_code ---------------------------------------------------------------------------------------------
PINNED = code.PINNED


def code_step(spec=None, **changed):
    return code_facts.evaluate_step(dict(code.SPEC, **(spec or {})), code.answer(**changed), {}, code.CONTEXT)


def test_a_missing_commit_from_a_remote_the_repository_lacks_is_a_problem():
    facts = code_step({"remote": "upstream"}, commit_present=False, remotes=["backup", "origin"])
    assert facts["problems"] == [
        f"{LABEL}: commit {PINNED} is not in the repository at /srv/train and training_code_remote upstream is not "
        "a remote of it (its remotes are backup, origin); set training_code_remote to one of them or to a URL, or "
        "add it there (git -C /srv/train remote add upstream <url>)"
    ]
    assert facts["pending"] is False
    lonely = code_step({"remote": "origin"}, commit_present=False, remotes=[])
    assert "training_code_remote origin is not a remote of it (it has no remote)" in lonely["problems"][0]


@pytest.mark.parametrize(
    "remote", ["origin", "https://git.example.org/train.git", "git@git.example.org:train.git", "/srv/up.git", "../up"]
)
def test_a_configured_remote_or_a_url_can_fetch(remote):
    facts = code_step({"remote": remote}, commit_present=False, remotes=["origin"])
    assert facts["problems"] == []
    assert facts["changes"][0] == f"fetch {PINNED[:12]} from {remote} (not in the repository)"
    assert facts["pending"] is True


def test_the_remote_matters_only_when_the_commit_is_missing_and_is_not_judged_unread():
    assert code_step({"remote": "upstream"}, commit_present=True, remotes=[])["problems"] == []
    assert code_step({"remote": "upstream"}, commit_present=False)["problems"] == []  # an older probe's answer
    with pytest.raises(code_facts.CodeError, match="'remotes'"):
        code_step(commit_present=False, remotes="origin")


@pytest.mark.parametrize(
    ("remote", "is_name"),
    [
        ("origin", True),
        ("team/upstream", True),
        ("https://h/r.git", False),
        ("git@h:r.git", False),
        ("/srv/r.git", False),
        ("./r", False),
        ("~/r", False),
    ],
)
def test_what_git_reads_as_a_remotes_name(remote, is_name):
    assert code_facts.names_a_remote(remote) is is_name


def git(*args, cwd):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, env=dict(os.environ, **code_env()))


def code_env():
    return {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@x"}


def test_the_probe_names_the_remotes_of_the_repository(tmp_path):
    repo = tmp_path / "train"
    repo.mkdir()
    git("init", "-q", cwd=repo)
    (repo / "train.py").write_text("print(1)\n")
    git("add", "train.py", cwd=repo)
    git("commit", "-q", "-m", "one", cwd=repo)
    git("remote", "add", "origin", "/srv/up.git", cwd=repo)
    git("remote", "add", "Team/Backup", "https://git.example.org/t.git", cwd=repo)
    git("config", "remote.pushonly.pushurl", "/srv/p.git", cwd=repo)  # no url: git cannot fetch from it
    answer = code_probe.probe({"path": str(repo), "commit": "ab" * 20, "git": "git", "timeout": 30})
    assert (answer["commit_present"], answer["remotes"]) == (False, ["Team/Backup", "origin"])
    assert (
        code_probe.probe({"path": str(tmp_path), "commit": "ab" * 20, "git": "git", "timeout": 30})["remotes"] is None
    )
    facts = code_facts.evaluate_step(dict(code.SPEC, path=str(repo), remote="upstream"), answer, {}, code.CONTEXT)
    assert (
        "training_code_remote upstream is not a remote of it (its remotes are Team/Backup, origin)"
        in (facts["problems"][0])
    )


def test_remote_names_come_from_the_url_keys():
    config = [
        ("core.bare", "false"),
        ("remote.origin.url", "/up"),
        ("remote.origin.fetch", "+refs/*"),
        ("remote..url", "x"),
    ]
    assert worktree.remote_names([*config, ("remote.a.b.url", "y")]) == ["a.b", "origin"]
