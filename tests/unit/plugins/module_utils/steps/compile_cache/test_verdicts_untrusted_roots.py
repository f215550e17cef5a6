"""Issue 25 item 1: the compile cache purge deletes only inside a root it can trust.

Real directories in tmp_path, real symlinks, real owners (uid 65534 ``nobody`` plays the user training runs as,
uid 4321 another user) and a real bind mount in a private mount namespace. Each case runs the probe part, the
module's judgement (``module_facts``) and the acting script as the module chains them (``act_payload``), and
asserts that what lies outside the root survives: a root that is a symlink to checkpoints, a link out of a root,
a root or a directory in it swapped after the verdict, a bind mount inside a root, a root under a directory others
can write, a root squatted in a sticky directory, a directory of root's moved into the user's root.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import fs as ct_fs
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import facts as cache_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import probe as cache_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import script

from tests.conftest import other_python, unavailable
from tests.fakes import run_probes_program
from tests.unit.plugins.module_utils.steps.compile_cache.test_facts import (
    CU130,
    LABEL,
    SPEC,
    fake_venv,
    probe_of,
    write_stamp,
)

NOBODY = 65534
OTHER = 4321
STAMP = SPEC["stamp_name"]


def chown_tree(path, uid):
    for directory, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(directory, name), uid, uid)
    os.lchown(path, uid, uid)


def checkpoints_in(tmp_path, name="checkpoints"):
    """Root's checkpoints: what a purge must never reach."""
    directory = tmp_path / name
    directory.mkdir()
    (directory / "step-90000.pt").write_text("weeks of training")
    return directory


def stale_cache(root, uid=0):
    (root / "fx" / "ab").mkdir(parents=True)
    (root / "fx" / "ab" / "graph").write_text("g")
    write_stamp(root, CU130)
    chown_tree(root, uid)
    return root


def judge_and_act(tmp_path, roots, user="root", before_act=None):
    """Probe, judge (the venv rebuilt in the run: every root stale) and act as the module does."""
    fake_venv(tmp_path / "venv")
    spec = dict(SPEC, venv=str(tmp_path / "venv"), roots=[str(r) for r in roots], user=user)
    answer = probe_of(tmp_path, spec["roots"], user=user)
    facts = cache_facts.module_facts(spec, answer, LABEL, venv_pending=True)
    if before_act:
        before_act()
    return facts, script.probe(cache_facts.act_payload(spec, facts, answer, 30))


def purge_payload(root, uid=0):
    """What the old module sent for a root it judged stale: the script must check it again on its own."""
    path = str(root)
    roots = [{"path": path, "real_path": os.path.realpath(path), "id": None, "action": "purge"}]
    payload = {"roots": roots, "fingerprint": CU130, "stamp_name": STAMP, "homes": {}, "uid": uid}
    return dict(payload, warmup=None, timeout=30)


def test_a_root_that_is_a_symlink_to_checkpoints_is_refused_and_the_checkpoints_survive(tmp_path):
    checkpoints = checkpoints_in(tmp_path)
    link = tmp_path / "torchinductor_nobody"
    link.symlink_to(checkpoints)
    os.lchown(link, NOBODY, NOBODY)
    facts, done = judge_and_act(tmp_path, [link], user="nobody")
    assert (checkpoints / "step-90000.pt").read_text() == "weeks of training"
    reason = (
        f"{link} is a symlink (to {checkpoints}); a root is opened without following links: give the directory "
        "itself as the root"
    )
    assert facts["refused"] == [{"path": str(link), "reason": reason, "problem": False}]
    assert facts["pending"] is False
    # The script, asked to purge it anyway, opens it the same way.
    done = script.probe(purge_payload(link, NOBODY))
    assert (done["error"], done["message"]) == (
        "unsafe",
        f"compile cache root {link} refused: {reason}; nothing was deleted",
    )
    assert (checkpoints / "step-90000.pt").read_text() == "weeks of training"


def test_a_link_out_of_a_root_is_removed_its_target_kept_and_its_name_shown_escaped(tmp_path):
    checkpoints = checkpoints_in(tmp_path)
    root = stale_cache(tmp_path / "inductor")
    (root / "fx" / "evil\nname").symlink_to(checkpoints)
    facts, done = judge_and_act(tmp_path, [root])
    assert "error" not in done, done
    assert f"symlinks out of it removed, never followed: {root}/fx/evil\\nname -> {checkpoints}" in facts["changes"][0]
    assert "\n" not in facts["changes"][0]
    assert done["roots"][0]["purged"]["links_out"] == [{"link": f"{root}/fx/evil\nname", "target": str(checkpoints)}]
    assert sorted(os.listdir(root)) == [STAMP]
    assert (checkpoints / "step-90000.pt").read_text() == "weeks of training"


def test_a_directory_above_the_root_swapped_for_a_link_after_the_check_changes_nothing_outside(tmp_path, monkeypatch):
    # The user owns the directory above the root: between the script's check and its purge they swap it for a
    # link to a directory that holds root's checkpoints under the same name. The purge works on the fd it checked.
    home = tmp_path / "alice"
    stale_cache(home / "cache", NOBODY)
    os.chown(home, NOBODY, NOBODY)
    elsewhere = tmp_path / "elsewhere"
    checkpoints = checkpoints_in(elsewhere.parent, "elsewhere") / "cache"
    checkpoints.mkdir()
    (checkpoints / "model.pt").write_text("weeks of training")
    users_of = script.users_of

    def swap_then_look(reals, own_pid):
        home.rename(tmp_path / "alice.moved")
        home.symlink_to(elsewhere)
        return users_of(reals, own_pid)

    monkeypatch.setattr(script, "users_of", swap_then_look)
    facts, done = judge_and_act(tmp_path, [home / "cache"], user="nobody")
    assert facts["roots"][0]["verdict"] == "stale"
    assert "error" not in done, done
    assert (checkpoints / "model.pt").read_text() == "weeks of training"
    assert sorted(os.listdir(tmp_path / "alice.moved" / "cache")) == [STAMP]  # the directory judged was purged


def test_a_directory_in_the_root_swapped_for_a_link_during_the_purge_loses_only_the_link(tmp_path, monkeypatch):
    checkpoints = checkpoints_in(tmp_path)
    root = stale_cache(tmp_path / "inductor")
    kind_at = ct_fs.kind_at
    swapped = []

    def swap_after_a_look(fd, name):
        kind = kind_at(fd, name)
        if name == "fx" and not swapped:  # seen as a directory, then a link takes its place
            swapped.append(name)
            (root / "fx").rename(tmp_path / "fx.gone")
            (root / "fx").symlink_to(checkpoints)
        return kind

    monkeypatch.setattr(ct_fs, "kind_at", swap_after_a_look)
    _, done = judge_and_act(tmp_path, [root])
    assert swapped == ["fx"]
    assert "error" not in done, done
    assert done["roots"][0]["purged"]["links_out"] == [{"link": f"{root}/fx", "target": str(checkpoints)}]
    assert sorted(os.listdir(root)) == [STAMP]
    assert (checkpoints / "step-90000.pt").read_text() == "weeks of training"


def test_a_root_replaced_by_another_directory_after_the_verdict_is_not_purged(tmp_path):
    root = stale_cache(tmp_path / "inductor")

    def replace():
        root.rename(tmp_path / "inductor.judged")
        root.mkdir()
        (root / "not-judged").write_text("n")

    facts, done = judge_and_act(tmp_path, [root], before_act=replace)
    assert (root / "not-judged").read_text() == "n"
    assert facts["roots"][0]["verdict"] == "stale"
    assert (done["error"], done["message"]) == ("changed", f"{root} is another directory than the one read; run again")
    assert (root / "not-judged").read_text() == "n"


def probe_then_act(python, root, payload, prefix=()):
    """The probe part, then the script told to purge ``root`` (its ``[st_dev, st_ino]``, read here), both in ONE real
    ``python -I -c PROBES_MAIN``, as Target.run_probes runs them in a CT: ``(answer, done)``."""
    info = os.stat(root)
    act = purge_payload(root)
    act["roots"][0]["id"] = [info.st_dev, info.st_ino]
    parts = {"compile_cache": (cache_probe, payload), "act": (script, act)}
    answers = run_probes_program(python, parts, prefix)
    return answers["compile_cache"]["answer"], answers["act"]["answer"]


def test_a_bind_mount_inside_a_root_is_never_entered_and_its_source_survives(tmp_path):
    if not shutil.which("unshare") or subprocess.run(["unshare", "-m", "true"], check=False).returncode != 0:
        unavailable("no private mount namespace here (unshare -m)")
    source = checkpoints_in(tmp_path, "dataset")
    root = stale_cache(tmp_path / "inductor")
    (root / "data").mkdir()
    fake_venv(tmp_path / "venv")
    spec = dict(SPEC, venv=str(tmp_path / "venv"), roots=[str(root)])
    mount = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    wrapper = ("unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh", source, root / "data")
    answer, done = probe_then_act(sys.executable, root, cache_facts.probe_payload(spec, 30), wrapper)
    assert (source / "step-90000.pt").read_text() == "weeks of training"
    assert answer["roots"][0]["walk"]["mounts"] == [str(root / "data")]
    facts = cache_facts.module_facts(spec, answer, LABEL, venv_pending=True)
    assert facts["changes"][0].endswith(f"; left alone, another mount: {root}/data)")
    assert "error" not in done, done
    assert done["roots"][0]["purged"]["mounts_left"] == [str(root / "data")]
    assert (source / "step-90000.pt").read_text() == "weeks of training"
    assert sorted(os.listdir(root)) == [STAMP, "data"]  # the mount point stays, empty in this namespace


@pytest.mark.parametrize(
    ("mode", "owner", "group", "why"),
    [
        (0o777, 0, 0, "which every user may write (mode 0777, no sticky bit)"),
        (0o775, 0, OTHER, f"which group {OTHER} may write (mode 0775, no sticky bit)"),
    ],
)
def test_a_root_under_a_directory_others_can_write_is_refused(tmp_path, mode, owner, group, why):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    os.chown(scratch, owner, group)
    scratch.chmod(mode)
    root = stale_cache(scratch / "cache")
    facts, _ = judge_and_act(tmp_path, [root])
    assert (root / "fx" / "ab" / "graph").read_text() == "g"
    reason = (
        f"it lies under {scratch}, {why}: any of them could put another directory in its place; chmod +t {scratch}, "
        "or give a root under a directory only root and the cache user can write"
    )
    assert facts["refused"] == [{"path": str(root), "reason": reason, "problem": False}]
    assert script.probe(purge_payload(root))["message"] == (
        f"compile cache root {root} refused: {reason}; nothing was deleted"
    )
    assert (root / "fx" / "ab" / "graph").read_text() == "g"


def test_a_root_under_a_directory_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER, OTHER)
    root = stale_cache(theirs / "cache")
    facts, _ = judge_and_act(tmp_path, [root])
    assert (root / "fx" / "ab" / "graph").read_text() == "g"
    assert facts["refused"][0]["reason"] == (
        f"it lies under {theirs}, owned by uid {OTHER}, who could put any directory in its place"
    )
    assert script.probe(purge_payload(root))["error"] == "unsafe"
    assert (root / "fx" / "ab" / "graph").read_text() == "g"


def test_in_a_sticky_directory_a_root_of_another_user_is_refused(tmp_path):
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    squatted = stale_cache(sticky / "torchinductor_root", OTHER)
    facts, _ = judge_and_act(tmp_path, [squatted])
    assert (squatted / "fx" / "ab" / "graph").read_text() == "g"
    assert facts["refused"][0]["reason"] == (
        f"{squatted} is owned by uid {OTHER}, but in {sticky} only root (uid 0) can be trusted (another user may "
        "have put it there): remove it, or give another root"
    )
    assert script.probe(purge_payload(squatted))["error"] == "unsafe"
    assert (squatted / "fx" / "ab" / "graph").read_text() == "g"


def test_the_users_own_root_is_purged_but_a_directory_of_roots_moved_into_it_is_left(tmp_path):
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    root = stale_cache(sticky / "torchinductor_nobody", NOBODY)
    # The user's own directory holding a directory of root's that they could not empty themselves.
    (root / "mine" / "roots").mkdir(parents=True)
    (root / "mine" / "roots" / "model.pt").write_text("weeks of training")
    os.chown(root / "mine", NOBODY, NOBODY)
    facts, done = judge_and_act(tmp_path, [root], user="nobody")
    assert (root / "mine" / "roots" / "model.pt").read_text() == "weeks of training"
    left = {"path": f"{root}/mine/roots", "why": ct_fs.LEFT["owner"]}
    assert facts["roots"][0]["left"] == [left]
    assert f"left alone: {root}/mine/roots (owned by another user than its directory's owner" in facts["changes"][0]
    assert "error" not in done, done
    assert done["roots"][0]["purged"]["left"] == [left]
    assert (root / "mine" / "roots" / "model.pt").read_text() == "weeks of training"
    assert sorted(os.listdir(root)) == [STAMP, "mine"]
    assert os.stat(root / STAMP).st_uid == NOBODY


def test_the_probe_and_script_open_roots_this_way_on_python_3_9(tmp_path):
    python = other_python("3.9")
    if python is None:
        unavailable("no python3.9 here")
    root = stale_cache(tmp_path / "inductor")
    fake_venv(tmp_path / "venv")
    spec = dict(SPEC, venv=str(tmp_path / "venv"), roots=[str(root)])
    answer, done = probe_then_act(python, root, cache_facts.probe_payload(spec, 30))
    assert answer["roots"][0]["unsafe"] is None
    assert answer["roots"][0]["id"] == [os.stat(root).st_dev, os.stat(root).st_ino]
    assert done["roots"][0]["purged"]["files"] == 1
    assert sorted(os.listdir(root)) == [STAMP]


# -- review C: a root another user squats is refused alone, never the whole step --------------------------------
def squatted_and_mine(tmp_path):
    """/tmp/torchinductor_root created first by another user (the cache user is root), and root's own stale cache."""
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    squatted = stale_cache(sticky / "torchinductor_root", OTHER)
    mine = stale_cache(tmp_path / "mine")
    return sticky, squatted, mine


def squat_line(squatted, sticky, warmup=False):
    reason = (
        f"{squatted} is owned by uid {OTHER}, but in {sticky} only root (uid 0) can be trusted (another user may "
        "have put it there): remove it, or give another root"
    )
    skipped = "; no warm-up runs while it is refused" if warmup else ""
    return reason, (
        f"{LABEL}: compile cache root {squatted} refused: {reason}; it is left as it is (neither purged nor stamped), "
        f"the other roots are handled as usual{skipped}; another user of the target may have put it there: remove it "
        "in the target, or set compile_cache_roots to a directory only root and compile_cache_user can write"
    )


def test_a_squatted_root_is_refused_alone_and_the_other_roots_are_still_purged(tmp_path):
    sticky, squatted, mine = squatted_and_mine(tmp_path)
    facts, done = judge_and_act(tmp_path, [squatted, mine])
    reason, line = squat_line(squatted, sticky)
    assert facts["problems"] == []
    assert facts["refused"] == [{"path": str(squatted), "reason": reason, "problem": False}]
    assert (facts["warnings"], facts["needs_window"]) == ([line], [])
    assert [r["verdict"] for r in facts["roots"]] == ["refused", "stale"]
    assert facts["pending"] is True and facts["changes"][0].startswith(f"purge {mine} (")
    assert "error" not in done, done
    assert [r["stamped"] for r in done["roots"]] == [False, True]
    assert sorted(os.listdir(mine)) == [STAMP]  # purged and stamped
    assert (squatted / "fx" / "ab" / "graph").read_text() == "g"  # not a byte of the squatter's directory touched
    assert json.loads((squatted / STAMP).read_text())["fingerprint"] == CU130


def test_a_converged_target_with_a_squatted_root_has_nothing_to_do(tmp_path):
    sticky, squatted, mine = squatted_and_mine(tmp_path)
    judge_and_act(tmp_path, [squatted, mine])  # mine is now fresh
    spec = dict(SPEC, venv=str(tmp_path / "venv"), roots=[str(squatted), str(mine)])
    for unattended in (False, True):
        facts = cache_facts.module_facts(dict(spec, unattended=unattended), probe_of(tmp_path, spec["roots"]), LABEL)
        assert [r["verdict"] for r in facts["roots"]] == ["refused", "fresh"]
        assert (facts["pending"], facts["changes"], facts["problems"]) == (False, [], [])
        assert facts["diff"]["before"] == facts["diff"]["after"]
        # Unattended: the drift corrector names it for a person (needs_window) instead of failing every hour.
        assert facts["needs_window"] == ([squat_line(squatted, sticky)[1]] if unattended else [])


def test_no_warm_up_runs_while_a_root_is_refused(tmp_path):
    sticky, squatted, mine = squatted_and_mine(tmp_path)
    fake_venv(tmp_path / "venv")
    spec = dict(SPEC, venv=str(tmp_path / "venv"), roots=[str(squatted), str(mine)], warmup=["true"])
    facts = cache_facts.module_facts(spec, probe_of(tmp_path, spec["roots"]), LABEL, venv_pending=True)
    assert facts["warmup"]["planned"] is False
    assert facts["warnings"] == [squat_line(squatted, sticky, warmup=True)[1]]
    assert facts["pending"] is True  # mine is still purged


def test_a_root_refused_by_its_setting_still_stops_the_run(tmp_path):
    _, _, mine = squatted_and_mine(tmp_path)
    fake_venv(tmp_path / "venv")
    spec = dict(SPEC, venv=str(tmp_path / "venv"), roots=[str(mine), str(mine / "fx")])
    facts = cache_facts.module_facts(spec, probe_of(tmp_path, spec["roots"]), LABEL, venv_pending=True)
    assert facts["refused"] == [
        {"path": str(mine / "fx"), "reason": f"it lies inside the root {mine}; give only that one", "problem": True}
    ]
    assert facts["problems"] and facts["pending"] is False and facts["warnings"] == []
