"""plugins/module_utils/steps/training_code/facts.py: the porcelain parser, the settings check and the facts of the
training code step.

Everything here is pure: status text as ``git status --porcelain=v1 -z --untracked-files=all`` writes it (renames
with their original path in the next field, names with spaces and newlines unquoted) and probe answers in, facts
out. The probe part and the reset script against real repositories are in tests/unit/library/test_training_code.py.
"""

import pytest
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import git_paths as ct_git_paths
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import (
    backups,
    git_runner,
    nofollow,
    script,
    users,
    worktree,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import facts as code_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code import probe as code_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_code.facts import CodeError

from tests.fakes import not_shippable

LABEL = "CT 200 on pve1"
CONTEXT = {"target": {"label": LABEL, "node": "pve1", "vmid": 200}, "check_mode": True, "steps": {}}
PINNED = "4f3c2a1b0e9d8c7b6a5f4e3d2c1b0a9f8e7d6c5b"
OTHER = "9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d"
SPEC = dict(code_facts.SPEC_DEFAULTS, commit=PINNED)
# A tree after a week of experiments: a monkey-patch in the model file, a staged change, a staged rename with
# spaces, a file both staged and edited again, untracked notes (one with a newline in its name).
STATUS = (
    " M model.py\0"
    "M  data.py\0"
    "R  loaders/new loader.py\0loaders/old loader.py\0"
    "MM train.py\0"
    "?? notes.txt\0"
    "?? runs/notes\nv2.txt\0"
)


def answer(**changed):
    """The probe's answer for /srv/train on main at OTHER, clean, the pinned commit present."""
    found = {
        "path": "/srv/train",
        "exists": True,
        "git": "/usr/bin/git",
        "git_version": "2.39.5",
        "repo": True,
        "bare": False,
        "toplevel": "/srv/train",
        "head": OTHER,
        "branch": "main",
        "status": "",
        "operation": None,
        "commit_present": True,
        "collisions": [],
        "errors": [],
    }
    found.update(changed)
    return found


def evaluate(spec=None, **changed):
    return code_facts.evaluate_step(spec or SPEC, answer(**changed), {}, CONTEXT)


# -- the porcelain ---------------------------------------------------------------------------------------------
def test_porcelain_z_is_split_at_nul_only_with_renames_taking_their_original_path():
    assert code_facts.parse_status(STATUS) == [
        {"code": " M", "path": "model.py", "orig": None},
        {"code": "M ", "path": "data.py", "orig": None},
        {"code": "R ", "path": "loaders/new loader.py", "orig": "loaders/old loader.py"},
        {"code": "MM", "path": "train.py", "orig": None},
        {"code": "??", "path": "notes.txt", "orig": None},
        {"code": "??", "path": "runs/notes\nv2.txt", "orig": None},
    ]
    assert code_facts.parse_status("") == []


def test_a_copy_and_a_rename_in_the_work_tree_column_take_their_original_path_too():
    text = "C  b.py\0a.py\0 R c.py\0d.py\0A  e f.py\0"
    assert [(e["code"], e["path"], e["orig"]) for e in code_facts.parse_status(text)] == [
        ("C ", "b.py", "a.py"),
        (" R", "c.py", "d.py"),
        ("A ", "e f.py", None),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("M\0", "a status entry git never writes: 'M'"),
        ("MMmodel.py\0", "a status entry git never writes: 'MMmodel.py'"),
        ("R  new.py\0", "the status entry 'R  new.py' lacks the path it was renamed from"),
    ],
)
def test_status_text_git_never_writes_is_refused(text, message):
    with pytest.raises(CodeError, match=message):
        code_facts.parse_status(text)


def test_dirty_paths_are_listed_per_state_a_rename_as_old_to_new():
    assert code_facts.dirty_of(code_facts.parse_status(STATUS)) == {
        "staged": ["data.py", "loaders/old loader.py -> loaders/new loader.py", "train.py"],
        "unstaged": ["model.py", "train.py"],
        "untracked": ["notes.txt", "runs/notes\nv2.txt"],
    }


def test_status_lines_read_like_porcelain_and_a_newline_cannot_forge_a_line():
    assert code_facts.status_lines(code_facts.parse_status(STATUS)) == [
        " M model.py",
        "M  data.py",
        "R  loaders/old loader.py -> loaders/new loader.py",
        "MM train.py",
        "?? notes.txt",
        '?? "runs/notes\\nv2.txt"',
    ]
    assert code_facts.quote('say "hi"\\') == '"say \\"hi\\"\\\\"'
    assert code_facts.quote("päth with space") == "päth with space"


def test_the_container_side_splits_status_like_the_parser():
    # The probe and the script split it with ct_git in the target; it must agree with the node's parser.
    parsed = [(e["code"], e["path"], e["orig"]) for e in code_facts.parse_status(STATUS)]
    assert worktree.status_entries(STATUS.encode()) == parsed


@pytest.mark.parametrize(
    ("changed", "untracked", "phrase"),
    [(2, 1, "2 changed and 1 untracked files"), (1, 0, "1 changed file"), (0, 1, "1 untracked file")],
)
def test_counts_read_as_a_phrase(changed, untracked, phrase):
    assert code_facts.count_phrase(changed, untracked) == phrase


# -- settings --------------------------------------------------------------------------------------------------
def test_the_spec_validates_with_its_defaults():
    result = ArgumentSpecValidator(code_facts.SPEC).validate({"commit": PINNED})
    assert result.error_messages == []
    assert result.validated_parameters == {
        "path": "/srv/train",
        "commit": PINNED,
        "remote": None,
        "backup_dir": "/var/backups/pve-gpu-recover/training_code",
        "backup_min_free_mib": 1024,
        "git": "git",
        "unattended": False,
    }


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({}, ""),
        ({"commit": PINNED.upper()}, ""),
        ({"commit": "ab" * 32}, ""),  # a SHA-256 repository
        ({"commit": "main"}, "commit is 'main'; expected the full sha of the known-good commit, 40 hex digits"),
        ({"commit": PINNED[:12]}, f"commit is '{PINNED[:12]}'; expected the full sha"),
        ({"commit": ""}, "commit is ''; expected the full sha"),
        ({"path": "srv/train"}, "path is 'srv/train'; expected the absolute path"),
        ({"backup_dir": "backups"}, "backup_dir is 'backups'; expected an absolute path"),
        ({"backup_dir": "/srv/train/.backups"}, "backup_dir /srv/train/.backups lies inside the repository /srv/train"),
        ({"backup_dir": "/srv/train"}, "backup_dir /srv/train lies inside the repository"),
        ({"backup_dir": "/srv/training"}, ""),
        ({"remote": "--upload-pack=touch /x"}, "remote is '--upload-pack=touch /x'; expected a remote's name"),
        ({"remote": "origin"}, ""),
        ({"git": ""}, "git is empty"),
        ({"backup_min_free_mib": 0}, ""),
        ({"backup_min_free_mib": -1}, "backup_min_free_mib is -1; expected the MiB to keep free"),
    ],
)
def test_settings_that_cannot_work_are_named(changed, message):
    found = code_facts.check_spec(dict(SPEC, **changed))
    assert found.startswith(message)
    assert bool(found) == bool(message)


def test_the_probe_payload_names_the_commit_in_lower_case():
    assert code_facts.probe_payload(dict(SPEC, commit=PINNED.upper()), 30) == {
        "path": "/srv/train",
        "commit": PINNED,
        "git": "git",
        "timeout": 30,
        "backup_dir": "/var/backups/pve-gpu-recover/training_code",
    }


# -- the facts -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("head", "branch"), [(PINNED, "main"), (PINNED, None)])
def test_at_the_commit_and_clean_is_converged_on_a_branch_or_detached(head, branch):
    facts = evaluate(head=head, branch=branch)
    assert (facts["changes"], facts["problems"], facts["pending"]) == ([], [], False)
    assert facts["at_commit"] is True and facts["detached"] is (branch is None)
    assert facts["diff"] == {"before": f"HEAD {PINNED}\n", "after": f"HEAD {PINNED}\n"}
    assert facts["dirty"] == {"staged": [], "unstaged": [], "untracked": []}


def test_ignored_files_never_count():
    # git status without --ignored never lists them; the answer of a tree full of checkpoints is this one.
    assert evaluate(head=PINNED, status="")["pending"] is False


def test_a_dirty_tree_on_another_commit_is_saved_then_checked_out():
    facts = evaluate(status=STATUS)
    assert facts["changes"] == [
        f"save 4 changed and 2 untracked files to a backup, then check out {PINNED[:12]} (HEAD is {OTHER[:12]} on main)"
    ]
    assert facts["diff"] == {
        "before": f"HEAD {OTHER}\n M model.py\nM  data.py\nR  loaders/old loader.py -> loaders/new loader.py\n"
        f'MM train.py\n?? notes.txt\n?? "runs/notes\\nv2.txt"\n',
        "after": f"HEAD {PINNED}\n",
    }
    assert (facts["pending"], facts["at_commit"], facts["head"], facts["branch"]) == (True, False, OTHER, "main")


def test_a_dirty_tree_at_the_commit_is_saved_then_discarded():
    facts = evaluate(head=PINNED, branch=None, status=" M model.py\0")
    assert facts["changes"] == [f"save 1 changed file to a backup, then discard them (HEAD is {PINNED[:12]}, detached)"]
    assert facts["pending"] is True


def test_a_clean_tree_on_another_commit_is_only_checked_out():
    assert evaluate()["changes"] == [f"check out {PINNED[:12]} (HEAD is {OTHER[:12]} on main)"]


def test_a_missing_commit_is_fetched_from_the_remote():
    facts = evaluate(dict(SPEC, remote="origin"), commit_present=False, status="?? notes.txt\0")
    assert facts["changes"] == [
        f"fetch {PINNED[:12]} from origin (not in the repository)",
        f"save 1 untracked file to a backup, then check out {PINNED[:12]} (HEAD is {OTHER[:12]} on main)",
    ]
    assert (facts["pending"], facts["remote"]) == (True, "origin")


def test_a_missing_commit_without_a_remote_is_a_problem_and_nothing_is_pending():
    facts = evaluate(commit_present=False)
    assert facts["problems"] == [
        f"{LABEL}: commit {PINNED} is not in the repository at /srv/train and no remote is set to fetch it from; "
        f"set training_code_remote (a remote's name such as origin, or a URL), or fetch it there "
        f"(git -C /srv/train fetch origin {PINNED})"
    ]
    assert facts["pending"] is False
    assert facts["changes"] == [f"check out {PINNED[:12]} (HEAD is {OTHER[:12]} on main)"]  # what it would be


def test_a_repository_without_a_commit_is_checked_out_after_its_untracked_files_are_saved():
    facts = evaluate(dict(SPEC, remote="origin"), head=None, commit_present=False, status="?? a.py\0")
    assert facts["changes"][1] == (
        f"save 1 untracked file to a backup, then check out {PINNED[:12]} (the repository has no commit yet)"
    )
    assert facts["diff"]["before"] == "HEAD (no commit)\n?? a.py\n"
    assert facts["detached"] is False


@pytest.mark.parametrize(
    ("changed", "problem"),
    [
        (
            {"git": None, "git_version": None, "repo": False, "status": None, "head": None},
            f"{LABEL}: git not found in the target (`git` on the PATH of a non-login root shell); install it there "
            f"(apt install git) or set training_code_git to its path",
        ),
        (
            {"exists": False, "repo": False, "toplevel": None, "status": None, "head": None},
            f"{LABEL}: there is no directory /srv/train; clone the training code there first (git clone <url> "
            f"/srv/train) or set training_code_path to where it is",
        ),
        (
            {"repo": False, "toplevel": None, "status": None, "head": None, "branch": None},
            f"{LABEL}: /srv/train is not a git repository (no .git); clone the training code there or set "
            f"training_code_path to the top of its work tree",
        ),
        (
            {"repo": False, "bare": True, "toplevel": None, "status": None, "head": None},
            f"{LABEL}: /srv/train is a bare repository (no work tree); set training_code_path to a clone",
        ),
        (
            {"repo": False, "toplevel": "/srv", "status": None, "head": None},
            f"{LABEL}: the work tree of the repository at /srv/train is /srv; set training_code_path to the top of "
            f"the work tree",
        ),
        (
            {"repo": False, "toplevel": None, "status": None, "head": None, "errors": ["git refuses /srv/train: x"]},
            f"{LABEL}: the training code probe could not read everything: git refuses /srv/train: x",
        ),
        (
            {"operation": "rebase"},
            f"{LABEL}: a rebase is in progress in /srv/train; finish it or abort it (git rebase --abort) and run "
            f"again: an unfinished rebase cannot be saved to a patch",
        ),
        (
            {"operation": "bisect"},
            f"{LABEL}: a bisect is in progress in /srv/train; finish it or abort it (git bisect reset) and run again: "
            f"an unfinished bisect cannot be saved to a patch",
        ),
        (
            {"status": "UU model.py\0 M data.py\0"},
            f"{LABEL}: /srv/train has unmerged paths (a conflict): model.py; resolve them (git add) or discard them "
            f"and run again",
        ),
        (
            {"status": "?? vendor/lib/\0"},
            f"{LABEL}: vendor/lib/ in /srv/train is a git repository of its own (untracked): a reset would neither "
            f"save nor remove it; move it out of /srv/train or add it to .gitignore",
        ),
        (
            {"head": None, "status": "A  a.py\0"},
            f"{LABEL}: /srv/train has no commit yet but files are staged (a.py); commit them or unstage them "
            f"(git rm -r --cached .) and run again",
        ),
        (
            {"collisions": ["checkpoints/best.pt", "config.yaml"]},
            f"{LABEL}: checking out {PINNED[:12]} would overwrite ignored files that the commit tracks: "
            f"checkpoints/best.pt, config.yaml; move them out of /srv/train and run again (ignored files are never "
            f"touched)",
        ),
    ],
)
def test_what_cannot_be_done_safely_is_one_problem_and_nothing_is_pending(changed, problem):
    facts = evaluate(**changed)
    assert facts["problems"] == [problem]
    assert facts["pending"] is False


def test_a_long_list_of_paths_is_cut_in_a_sentence():
    many = "".join(f"UU f{n}.py\0" for n in range(8))
    assert "f0.py, f1.py, f2.py, f3.py, f4.py (and 3 more);" in evaluate(status=many)["problems"][0]


def test_without_a_repository_the_diff_before_is_empty():
    facts = evaluate(repo=False, toplevel=None, status=None, head=None, branch=None)
    assert facts["diff"] == {"before": "", "after": f"HEAD {PINNED}\n"}
    assert (facts["exists"], facts["changes"], facts["detached"]) == (False, [], False)


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ([], "answered no object"),
        ({"exists": "yes"}, "answered no 'exists' of the expected type"),
        ({"status": 7}, "answered no 'status' of the expected type"),
        ({"head": "HEAD; rm -rf /"}, "answered a HEAD that is no sha"),
        ({"errors": [1]}, "answered 'errors' that are not all strings"),
    ],
)
def test_an_answer_of_the_wrong_shape_is_refused(broken, message):
    found = broken if isinstance(broken, list) else answer(**broken)
    with pytest.raises(CodeError, match=message):
        code_facts.evaluate_step(SPEC, found, {}, CONTEXT)


def test_a_missing_key_is_refused_too():
    found = answer()
    del found["commit_present"]
    with pytest.raises(CodeError, match="answered no 'commit_present'"):
        code_facts.evaluate_step(SPEC, found, {}, CONTEXT)


def test_nothing_on_the_node():
    assert code_facts.read_node(SPEC, None, answer(), CONTEXT) == {}


@pytest.mark.parametrize("module", [code_probe, script, git_runner, nofollow, backups, worktree, users, ct_git_paths])
def test_the_parts_that_travel_import_only_the_standard_library_and_what_they_ship(module):
    assert not_shippable(module) == set()
