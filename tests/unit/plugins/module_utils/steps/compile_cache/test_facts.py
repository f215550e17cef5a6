"""plugins/module_utils/steps/compile_cache/facts.py, its probe part and its acting script: fingerprints, verdicts,
the safety rules.

The pure layer (fingerprint comparison, verdicts, refusals, the fact pass's choice of the expected fingerprint,
changes and diff) is fed hand-made probe answers. The probe part and the script run against real directories in
tmp_path: symlinks that lead out of a root, a symlinked root, a stamp that is a link, a process whose cwd is in a
root, a filesystem mounted inside a root (when this machine lets the test mount a tmpfs). No test imports torch.
"""

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import fs as ct_fs
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import probe_name
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import facts as cache_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import (
    fingerprint as cache_fingerprint,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import probe as cache_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import script
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import verdicts as cache_verdicts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import warmup as cache_warmup
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache.answer import CacheError
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import probe as venv_probe

from tests.conftest import other_python, unavailable
from tests.fakes import not_shippable, run_probes_program

LABEL = "CT 200 on pve1"
SPEC = dict(cache_facts.SPEC_DEFAULTS)
H200 = ["NVIDIA H200"]
CU128 = {"torch": "2.11.0+cu128", "variant": "cu128", "cuda": "12.8", "triton": "3.3.0", "gpus": H200}
CU130 = {"torch": "2.11.0+cu130", "variant": "cu130", "cuda": "13.0", "triton": "3.3.0", "gpus": H200}
HOMES = {"/root": ["root"], "/home/alice": ["alice"], "/var/cache/man": ["man"], "/nonexistent": ["nobody"]}
VERSION_PY = "__version__ = '{version}'\ndebug = False\ncuda: Optional[str] = {cuda}\ngit_version = 'abc'\n"
MB = 1_000_000


# -- hand-made answers -----------------------------------------------------------------------------------------
def root_of(path, *, stamp=None, stamp_state=None, size=0, entries=1, exists=True, real=None, is_dir=True, **walked):
    """The probe's answer for one root (``stamp``: a fingerprint; ``stamp_state``: "invalid" with a reason)."""
    if stamp is not None:
        stamped = {"state": "ok", "fingerprint": stamp, "reason": None, "content": {"fingerprint": stamp}}
    elif stamp_state:
        stamped = {"state": "invalid", "fingerprint": None, "reason": stamp_state, "content": None}
    else:
        stamped = {"state": "none", "fingerprint": None, "reason": None, "content": None}
    walk = {"size_bytes": size, "files": 3 if size else 0, "entries": entries, "links": 0, "escapes": []}
    walk.update(escapes_count=0, mounts=[], partial=False, unreadable=[])
    walk.update(walked)
    return {
        "template": path,
        "expanded": path,
        "path": path,
        "exists": exists,
        "is_link": bool(real and real != path),
        "is_dir": exists and is_dir,
        "real_path": real or path,
        "owner": {"uid": 0, "gid": 0} if exists else None,
        "stamp": stamped if exists and is_dir else None,
        "walk": walk if exists and is_dir else None,
    }


def answer_of(*roots, torch="2.11.0+cu128", cuda="'12.8'", triton="3.3.0", users=None, **changed):
    answer = {
        "user": {"name": "root", "exists": True, "uid": 0, "gid": 0, "home": "/root"},
        "homes": dict(HOMES),
        "venv": {
            "path": "/opt/venvs/train",
            "exists": True,
            "site_packages": "/opt/venvs/train/lib/python3.11/site-packages",
            "torch_version_py": cache_probe.parse_torch_version_py(VERSION_PY.format(version=torch, cuda=cuda))
            if torch
            else None,
            "triton": {"name": "triton", "version": triton} if triton else None,
        },
        "roots": list(roots),
        "users": users or {},
        "unreadable_processes": [],
        "users_partial": False,
        "gpus": None,
        "pid": 4242,
        "euid": 0,
        "errors": [],
    }
    answer.update(changed)
    return answer


def spec_for(answer, **changed):
    return dict(SPEC, roots=[r["template"] for r in answer["roots"]], **changed)


def context(**steps):
    preflight = {"gpus": [{"index": i, "name": "NVIDIA H200"} for i in range(8)], "problems": []}
    return {
        "target": {"label": LABEL, "vmid": 200, "node": "pve1"},
        "check_mode": False,
        "steps": dict({"preflight": preflight}, **steps),
    }


def facts_of(answer, ctx=None, **spec):
    return cache_facts.evaluate_step(spec_for(answer, **spec), answer, {}, ctx or context())


STALE = root_of("/tmp/torchinductor_root", stamp=CU130, size=152 * MB)
UNSTAMPED = root_of("/root/.triton/cache", size=12 * MB)
FRESH = root_of("/var/cache/torch-extra", stamp=CU128, size=5 * MB)
MISSING = root_of("/srv/cache/missing", exists=False)


# -- fingerprints ----------------------------------------------------------------------------------------------
def test_a_fingerprint_sorts_the_gpu_models_once_each():
    gpus = ["NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    assert cache_fingerprint.make_fingerprint("2.11.0+cu128", "12.8", "3.3.0", gpus) == {
        "torch": "2.11.0+cu128",
        "variant": "cu128",
        "cuda": "12.8",
        "triton": "3.3.0",
        "gpus": ["NVIDIA H100 80GB HBM3", "NVIDIA H200"],
    }
    assert cache_fingerprint.make_fingerprint("2.13.0+cpu", None, None, [])["variant"] == "cpu"


def test_fingerprints_are_described_and_compared_by_what_differs():
    assert cache_fingerprint.describe(CU128) == "torch 2.11.0+cu128 (CUDA 12.8), triton 3.3.0, NVIDIA H200"
    cpu = cache_fingerprint.make_fingerprint("2.13.0+cpu", None, None, [])
    assert cache_fingerprint.describe(cpu) == "torch 2.13.0+cpu (no CUDA), no triton, no GPU"
    assert cache_fingerprint.differences(CU130, CU128) == "stamped for torch 2.11.0+cu130, now 2.11.0+cu128"
    assert cache_fingerprint.differences(dict(CU128, triton="3.2.0"), CU128) == "stamped for triton 3.2.0, now 3.3.0"
    assert cache_fingerprint.differences(dict(CU128, cuda="12.6"), CU128) == "stamped for CUDA 12.6, now 12.8"
    assert (
        cache_fingerprint.differences(dict(CU128, gpus=["NVIDIA H100 80GB HBM3"]), CU128)
        == "stamped for GPUs NVIDIA H100 80GB HBM3, now NVIDIA H200"
    )


def test_a_stamp_compares_exactly_local_tag_included_and_ignores_gpu_order():
    # PEP 440 calls 2.11.0 and 2.11.0+cu128 equal; a cache built for one is stale for the other.
    answer = answer_of(root_of("/tmp/a", stamp=dict(CU128, torch="2.11.0", variant=None)))
    assert facts_of(answer)["roots"][0]["verdict"] == "stale"
    two = ["NVIDIA H200", "NVIDIA A100-SXM4-80GB"]
    ctx = context()
    ctx["steps"]["preflight"]["gpus"] = [{"name": n} for n in two]
    answer = answer_of(root_of("/tmp/a", stamp=dict(CU128, gpus=list(reversed(sorted(two))))))
    assert facts_of(answer, ctx)["roots"][0]["verdict"] == "fresh"


@pytest.mark.parametrize(
    ("size", "shown"),
    [(0, "0 bytes"), (1, "1 byte"), (999, "999 bytes"), (1500, "1.5 kB"), (152 * MB, "152 MB"), (3 * 10**9, "3.0 GB")],
)
def test_sizes_are_shown_in_decimal_units(size, shown):
    assert cache_verdicts.human_size(size) == shown


# -- verdicts, changes, diff -----------------------------------------------------------------------------------
def test_each_verdict_with_its_change_and_diff_line():
    facts = facts_of(answer_of(STALE, UNSTAMPED, FRESH, MISSING))
    assert [r["verdict"] for r in facts["roots"]] == ["stale", "unstamped", "fresh", "missing"]
    now = "torch 2.11.0+cu128 (CUDA 12.8), triton 3.3.0, NVIDIA H200"
    assert facts["changes"] == [
        "purge /tmp/torchinductor_root (stamped for torch 2.11.0+cu130, now 2.11.0+cu128; 152 MB)",
        f"stamp /tmp/torchinductor_root for {now}",
        f"stamp /root/.triton/cache (unstamped: adopted as built for {now}; 12 MB)",
    ]
    assert facts["diff"] == {
        "before": (
            "/tmp/torchinductor_root: torch 2.11.0+cu130 (CUDA 13.0), triton 3.3.0, NVIDIA H200\n"
            "/root/.triton/cache: unstamped\n"
            f"/var/cache/torch-extra: {now}\n"
            "/srv/cache/missing: missing\n"
        ),
        "after": (
            f"/tmp/torchinductor_root: {now}\n/root/.triton/cache: {now}\n/var/cache/torch-extra: {now}\n"
            "/srv/cache/missing: missing\n"
        ),
    }
    assert (facts["pending"], facts["problems"], facts["expected"], facts["expected_from"]) == (
        True,
        [],
        CU128,
        "venv",
    )
    assert facts["roots"][0]["stamp"] == CU130
    assert facts["size_bytes"] == 169 * MB


def test_fresh_and_missing_roots_leave_nothing_to_do_and_equal_diff_sides():
    facts = facts_of(answer_of(FRESH, MISSING))
    assert (facts["changes"], facts["pending"]) == ([], False)
    assert facts["diff"]["before"] == facts["diff"]["after"]


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        ("it is not JSON", "its stamp cannot be used: it is not JSON"),
        ("it is a symlink", "its stamp cannot be used: it is a symlink"),
        ("a purge of it was interrupted", "its stamp cannot be used: a purge of it was interrupted"),
    ],
)
def test_an_unusable_stamp_is_stale_never_adopted(state, reason):
    facts = facts_of(answer_of(root_of("/tmp/torchinductor_root", stamp_state=state, size=MB)))
    assert (facts["roots"][0]["verdict"], facts["roots"][0]["reason"]) == ("stale", reason)
    assert facts["changes"][0] == f"purge /tmp/torchinductor_root ({reason}; 1.0 MB)"


def test_a_venv_rebuilt_in_this_run_makes_every_cache_stale_and_adopts_none():
    venv = {"path": "/opt/venvs/train", "pending": True, "lock": {"torch": "2.11.0+cu130"}, "problems": []}
    facts = facts_of(answer_of(STALE, UNSTAMPED, FRESH, MISSING), context(training_venv=venv))
    assert [r["verdict"] for r in facts["roots"]] == ["stale", "stale", "stale", "missing"]
    # The lock names torch; its CUDA comes from the build variant; triton is known once the venv is rebuilt.
    assert facts["expected"] == {
        "torch": "2.11.0+cu130",
        "variant": "cu130",
        "cuda": "13.0",
        "triton": None,
        "gpus": H200,
    }
    assert (facts["venv_changes"], facts["expected_from"]) == (
        True,
        "training_venv lock (the venv is rebuilt in this run)",
    )
    assert facts["roots"][1]["reason"] == "the venv is rebuilt in this run; unstamped"
    assert facts["changes"][2:4] == [
        "purge /root/.triton/cache (the venv is rebuilt in this run; unstamped; 12 MB)",
        "stamp /root/.triton/cache for the venv as rebuilt in this run",
    ]
    assert "stamp /root/.triton/cache (unstamped" not in "\n".join(facts["changes"])
    assert facts["diff"]["after"].splitlines()[1] == "/root/.triton/cache: for the venv as rebuilt in this run"


def test_the_module_in_check_mode_judges_a_venv_still_to_be_built_as_the_fact_pass_does():
    # Issue 43, break 3: a fresh target has no venv yet and no caches; a real run builds the venv (the venv step
    # runs first), then warms the caches up. Check mode builds nothing, so the module cannot read that venv: it
    # judges against the lock's torch, as the fact pass did, and plans the same work, never "no venv".
    venv = {"path": "/opt/venvs/train", "pending": True, "lock": {"torch": "2.11.0+cu128"}, "problems": []}
    no_venv = {"path": "/opt/venvs/train", "exists": False, "site_packages": None, "torch_version_py": None}
    smi = {"rc": 0, "stdout": "name\n" + "NVIDIA H200\n" * 8, "stderr": ""}
    warmup = ["/opt/venvs/train/bin/python", "/srv/dflash/warmup.py"]
    for roots in ((MISSING,), (STALE, UNSTAMPED, MISSING)):
        answer = answer_of(*roots, venv=dict(no_venv, triton=None), gpus=smi)
        fact_pass = facts_of(answer, context(training_venv=venv), warmup=warmup)
        module = cache_facts.module_facts(
            spec_for(answer, warmup=warmup), answer, LABEL, venv_pending=True, planned_torch="2.11.0+cu128",
            check_mode=True,
        )  # fmt: skip
        assert module["problems"] == fact_pass["problems"] == []
        for key in ("expected", "expected_from", "changes", "diff", "pending", "warmup"):
            assert module[key] == fact_pass[key], key
        assert module["expected"] == dict(CU128, triton=None)
        assert module["changes"][-1].startswith("warm up with `/opt/venvs/train/bin/python /srv/dflash/warmup.py`")
        assert [r["verdict"] for r in module["roots"]] == [r["verdict"] for r in fact_pass["roots"]]
    # A real run reads the venv the venv step built: a venv without torch there is still a problem.
    real = cache_facts.module_facts(spec_for(answer), answer, LABEL, venv_pending=True, planned_torch="2.11.0+cu128")
    assert real["problems"] == [
        f"{LABEL}: /opt/venvs/train is no venv, so the caches cannot be judged; set compile_cache_venv to the venv "
        "training runs in"
    ]


def test_a_venv_in_spec_or_another_venv_leaves_the_verdicts_to_the_stamps():
    for venv in (
        {"path": "/opt/venvs/train", "pending": False, "lock": {"torch": "2.11.0+cu130"}},
        {"path": "/opt/venvs/other", "pending": True, "lock": {"torch": "2.11.0+cu130"}},
        {"error": "the training_venv facts could not be read", "pending": False},
    ):
        facts = facts_of(answer_of(STALE, UNSTAMPED, FRESH), context(training_venv=venv))
        assert [r["verdict"] for r in facts["roots"]] == ["stale", "unstamped", "fresh"]
        assert (facts["venv_changes"], facts["expected"]) == (False, CU128)


def test_the_gpu_models_come_from_preflight_in_the_fact_pass():
    ctx = context()
    ctx["steps"]["preflight"]["gpus"] = [{"name": "NVIDIA H100 80GB HBM3"}]
    facts = facts_of(answer_of(FRESH), ctx)
    assert facts["roots"][0]["reason"] == "stamped for GPUs NVIDIA H200, now NVIDIA H100 80GB HBM3"


def test_a_venv_without_torch_cannot_judge_and_says_what_to_set():
    facts = facts_of(answer_of(STALE, torch=None))
    assert facts["roots"][0]["verdict"] == "unknown"
    assert facts["problems"] == [
        f"{LABEL}: /opt/venvs/train is a venv without torch/version.py, so the caches cannot be judged; set "
        "compile_cache_venv to the venv training runs in"
    ]
    assert facts["pending"] is False


def test_an_unknown_user_is_a_problem():
    answer = answer_of(MISSING, user={"name": "alice", "exists": False, "uid": None, "gid": None, "home": None})
    facts = facts_of(answer, user="alice")
    assert facts["problems"][0] == (
        f"{LABEL}: the compile cache user alice does not exist in the target; set compile_cache_user to the user "
        "training runs as"
    )


# -- warm-up planning ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("roots", "planned"),
    [
        ((STALE, FRESH), True),  # a purge empties a cache: warm it again
        ((MISSING,), True),  # nothing compiled yet
        ((root_of("/tmp/a", stamp=CU128, entries=0), MISSING), True),  # only a stamp: still cold
        ((FRESH, MISSING), False),  # warm already
        ((UNSTAMPED,), False),  # adopted as it is, warm
    ],
)
def test_the_warm_up_runs_after_a_purge_or_when_every_root_is_cold(roots, planned):
    facts = facts_of(answer_of(*roots), warmup=["python3", "/srv/warm.py"])
    assert facts["warmup"] == {"argv": ["python3", "/srv/warm.py"], "timeout": 900, "planned": planned}
    line = "warm up with `python3 /srv/warm.py` as root (TORCHINDUCTOR_COMPILE_THREADS=1, timeout 900 s), then "
    assert (line + "stamp the roots it fills" in facts["changes"]) is planned
    assert facts_of(answer_of(*roots))["warmup"] is None


def test_the_warm_up_environment_is_the_users_single_threaded_inductor_in_the_first_root():
    spec = dict(SPEC, warmup_env={"CUDA_VISIBLE_DEVICES": 0, "HOME": "/scratch", "TRACE": True})
    assert cache_warmup.warmup_environment(spec, "/root", "/tmp/torchinductor_root") == {
        "PATH": "/opt/venvs/train/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": "/scratch",
        "USER": "root",
        "LOGNAME": "root",
        "LANG": "C.UTF-8",
        "VIRTUAL_ENV": "/opt/venvs/train",
        "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_root",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "0",
        "TRACE": "true",
    }


# -- safety ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("/", "it is the filesystem root /"),
        ("//", "it is the filesystem root /"),
        ("/usr", "it is the system directory /usr"),
        ("/etc/", "it is the system directory /etc"),
        ("/var", "it is the system directory /var"),
        ("/opt", "it is the system directory /opt"),
        ("/srv", "it is the system directory /srv"),
        ("/root", "it is the home directory of root"),
        ("/home/alice", "it is the home directory of alice"),
        ("/home", "it contains the home directory /home/alice of alice"),
        ("/var/cache", "it contains the home directory /var/cache/man of man"),
        (
            "/tmp",
            "it has fewer than 2 path components (a cache is a directory of its own, like /tmp/torchinductor_root)",
        ),
        (
            "/scratch",
            "it has fewer than 2 path components (a cache is a directory of its own, like /tmp/torchinductor_root)",
        ),
        ("/usr/local/cache", "it lies inside the system tree /usr"),
        ("/etc/inductor", "it lies inside the system tree /etc"),
        ("/lib64/x", "it lies inside the system tree /lib64"),
        ("/tmp/../etc/x", "it contains '..'"),
        ("tmp/torchinductor_root", "it is not an absolute path"),
        ("/tmp/torchinductor_root", None),
        ("/root/.triton/cache", None),
        ("/home/alice/.cache/inductor", None),
        ("/var/cache/torch", None),
        ("/srv/cache/inductor", None),
        ("/scratch/inductor/", None),
    ],
)
def test_the_refusal_rules(path, reason):
    assert ct_fs.refusal(path, HOMES) == reason  # ct_fs.refusal: the node, the probe and the script apply it


def test_a_symlinked_root_is_judged_by_where_it_resolves_too():
    to_root = root_of("/tmp/torchinductor_root", real="/", stamp=CU130)
    to_home = root_of("/tmp/torchinductor_root", real="/root", stamp=CU130)
    to_scratch = root_of("/tmp/torchinductor_root", real="/scratch/inductor", stamp=CU130, size=MB)
    facts = facts_of(answer_of(to_root, to_home, to_scratch))
    assert [r["reason"] for r in facts["roots"][:2]] == [
        "it resolves through a symlink to /, and is the filesystem root /",
        "it resolves through a symlink to /root, and is the home directory of root",
    ]
    # A link at the path is what a user of the target put there, not the settings: refused alone, loudly.
    assert facts["refused"] == [
        {"path": r["path"], "reason": r["reason"], "problem": False} for r in facts["roots"][:2]
    ]
    assert facts["problems"] == []
    assert facts["warnings"][0] == (
        f"{LABEL}: compile cache root /tmp/torchinductor_root refused: it resolves through a symlink to /, and is the "
        "filesystem root /; it is left as it is (neither purged nor stamped), the other roots are handled as usual; "
        "another user of the target may have put it there: remove it in the target, or set compile_cache_roots to a "
        "directory only root and compile_cache_user can write"
    )
    assert facts["changes"][0].startswith("purge /tmp/torchinductor_root (stamped for torch 2.11.0+cu130")
    assert facts["pending"] is True  # the third root, acceptable where it resolves
    # Acceptable where it resolves: purged there, and the purge line says so.
    alone = facts_of(answer_of(to_scratch))
    assert alone["changes"][0] == (
        "purge /tmp/torchinductor_root (stamped for torch 2.11.0+cu130, now 2.11.0+cu128; a symlink to "
        "/scratch/inductor; 1.0 MB)"
    )


def test_a_root_that_is_no_directory_or_inside_another_root_is_refused():
    a_file = root_of("/tmp/torchinductor_root", is_dir=False)
    outer = root_of("/scratch/cache", stamp=CU128)
    inner = root_of("/scratch/cache/triton", stamp=CU128)
    again = root_of("/scratch/link", real="/scratch/cache", stamp=CU128)
    facts = facts_of(answer_of(a_file, outer, inner, again))
    assert [r["reason"] for r in facts["roots"]] == [
        "it is not a directory",
        "stamped for torch 2.11.0+cu128 (CUDA 12.8), triton 3.3.0, NVIDIA H200",
        "it lies inside the root /scratch/cache; give only that one",
        "it is the same directory as the root /scratch/cache",
    ]
    # A file where the root should be: found there, refused alone; two roots that overlap: the settings, a problem.
    assert [r["problem"] for r in facts["refused"]] == [False, True, True]
    assert len(facts["problems"]) == 2 and len(facts["warnings"]) == 1


def test_a_root_template_needing_a_home_the_user_lacks_is_refused():
    answer = answer_of(MISSING, user={"name": "svc", "exists": True, "uid": 5, "gid": 5, "home": ""})
    answer["roots"] = [dict(MISSING, template="{home}/.triton/cache", path=None, expanded=None, real_path=None)]
    facts = facts_of(answer, user="svc")
    assert (
        facts["roots"][0]["reason"] == "its template {home}/.triton/cache needs the home directory of svc, who has none"
    )


def test_symlinks_out_of_a_root_and_mounts_inside_are_named_in_the_purge():
    escapes = [{"link": "/tmp/torchinductor_root/h", "target": "/etc/hostname"}]
    root = root_of(
        "/tmp/torchinductor_root",
        stamp=CU130,
        size=MB,
        escapes=escapes,
        escapes_count=1,
        mounts=["/tmp/torchinductor_root/data"],
    )
    facts = facts_of(answer_of(root))
    assert facts["changes"][0] == (
        "purge /tmp/torchinductor_root (stamped for torch 2.11.0+cu130, now 2.11.0+cu128; 1.0 MB; symlinks out of it "
        "removed, never followed: /tmp/torchinductor_root/h -> /etc/hostname; left alone, another mount: "
        "/tmp/torchinductor_root/data)"
    )


def test_a_root_in_use_by_a_live_process_is_never_purged_unless_the_gpu_step_ends_it_first():
    users = {"/tmp/torchinductor_root": [{"pid": 4711, "name": "python3", "how": ["cwd", "mapped"]}]}
    facts = facts_of(answer_of(STALE, users=users))
    assert facts["problems"] == [
        f"{LABEL}: cannot purge /tmp/torchinductor_root: in use by pid 4711 (python3: cwd, mapped); a purge never "
        "runs under a live process (a running compile): stop it and run again"
    ]
    assert facts["pending"] is False
    gpu = {"pending": True, "processes": [{"pid": 90411, "ns_pid": 4711}], "launchers": [{"pid": 90400, "ns_pid": 7}]}
    facts = facts_of(answer_of(STALE, users=users), context(gpu_processes=gpu))
    assert (facts["problems"], facts["ending_pids"], facts["pending"]) == ([], [7, 4711], True)
    assert facts["changes"][0].endswith("; in use by pid 4711 (python3: cwd, mapped), which the GPU step ends first)")
    # A fresh root in use is nobody's business: nothing is deleted there.
    users = {"/var/cache/torch-extra": users["/tmp/torchinductor_root"]}
    assert facts_of(answer_of(FRESH, users=users))["problems"] == []


def test_a_process_scan_cut_short_blocks_a_purge():
    facts = facts_of(answer_of(STALE, users_partial=True))
    assert facts["problems"] == [
        f"{LABEL}: cannot tell whether a live process uses a cache to purge: the process scan ran out of time; raise "
        "compile_cache_timeout"
    ]


# -- the probe's answer, settings, registry --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ([], "the compile_cache probe answered no object"),
        ({"user": {}}, "the compile_cache probe answered no 'homes' (dict)"),
        (dict(answer_of(STALE), roots=[STALE, STALE]), "the compile_cache probe answered another number of roots"),
        (dict(answer_of(STALE), roots=[dict(STALE, exists="yes")]), "the compile_cache probe answered a root of the"),
        (dict(answer_of(STALE), roots=[dict(STALE, path=7)]), "the compile_cache probe answered a root whose path"),
    ],
)
def test_an_answer_that_is_not_the_probes_is_a_clear_error(answer, message):
    with pytest.raises(CacheError, match=re.escape(message)):
        cache_facts.evaluate_step(dict(SPEC, roots=["/tmp/torchinductor_root"]), answer, {}, context())


def test_the_spec_validates_with_ansible_and_fills_defaults():
    result = ArgumentSpecValidator(cache_facts.SPEC).validate({})
    assert result.error_messages == []
    assert result.validated_parameters == {
        "user": "root",
        "venv": "/opt/venvs/train",
        "roots": ["/tmp/torchinductor_{user}", "{home}/.triton/cache"],
        "stamp_name": ".pve-gpu-recover-stamp",
        "warmup": [],
        "warmup_timeout": 900,
        "warmup_env": {},
        "unattended": False,
    }
    assert cache_facts.check_spec(result.validated_parameters) == ""


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"user": "-x"}, "user is '-x', which is not a user name"),
        ({"venv": "venvs/train"}, "venv is 'venvs/train'; give the venv's absolute path inside the target"),
        ({"roots": []}, "roots is empty;"),
        ({"roots": ["/tmp/{uid}"]}, "the root '/tmp/{uid}' uses {uid}; only {user} and {home} are expanded"),
        ({"roots": ["cache"]}, "the root 'cache' is not an absolute path"),
        ({"stamp_name": "a/b"}, "stamp_name is 'a/b'; give a plain file name"),
        ({"warmup": [""]}, "warmup starts with an empty command name"),
        ({"warmup_timeout": 0}, "warmup_timeout is 0;"),
        ({"warmup_env": {"A-B": "1"}}, "warmup_env has 'A-B', which is not an environment variable name"),
        ({"warmup_env": {"A": [1]}}, "warmup_env's A is [1]; give a string"),
        (
            {"warmup_env": {"TORCHINDUCTOR_COMPILE_THREADS": "8"}},
            "warmup_env sets TORCHINDUCTOR_COMPILE_THREADS; the warm-up compiles single-threaded",
        ),
    ],
)
def test_check_spec_names_settings_that_cannot_work(changed, message):
    assert cache_facts.check_spec(dict(SPEC, **changed)).startswith(message)


def test_the_step_plugs_into_the_registry():
    assert cache_facts.NAME == "compile_cache"
    assert probe_name(cache_facts.PROBE) == cache_facts.NAME
    assert cache_facts.probe_payload(SPEC, 30) == {
        "user": "root",
        "venv": "/opt/venvs/train",
        "roots": ["/tmp/torchinductor_{user}", "{home}/.triton/cache"],
        "stamp_name": ".pve-gpu-recover-stamp",
        "timeout": 30,
        "nvidia_smi_argv": None,  # the fact pass has the GPU models from preflight
    }
    assert cache_facts.probe_payload(SPEC, 30, gpus=True)["nvidia_smi_argv"] == [
        "nvidia-smi",
        "--query-gpu=name",
        "--format=csv",
    ]
    assert cache_facts.read_node(SPEC, None, {}, context()) == {}
    facts = facts_of(answer_of(STALE, UNSTAMPED))
    assert {"changes", "problems", "diff", "pending", "roots", "expected", "refused"} <= set(facts)


@pytest.mark.parametrize("module", [cache_probe, script])
def test_the_shipped_parts_import_only_the_standard_library_and_what_they_ship(module):
    assert not_shippable(module) == set()


def test_version_py_is_read_as_the_training_venv_probe_reads_it():
    for text in (VERSION_PY.format(version="2.11.0+cu130", cuda="'13.0'"), "__version__ = '2.13.0+cpu'\ncuda = None\n"):
        ours = cache_probe.parse_torch_version_py(text)
        theirs = venv_probe.parse_torch_version_py(text)
        assert {k: ours[k] for k in ("version", "cuda", "git_version")} == {
            k: theirs[k] for k in ("version", "cuda", "git_version")
        }


# -- the probe part on real directories ------------------------------------------------------------------------
def fake_venv(directory, version="2.11.0+cu128", cuda="'12.8'", triton="3.3.0"):
    site = directory / "lib" / "python3.11" / "site-packages"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "version.py").write_text(VERSION_PY.format(version=version, cuda=cuda))
    if triton:
        record = site / f"triton-{triton}.dist-info"
        record.mkdir()
        (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: triton\nVersion: {triton}\n\nlong text\n")
    (directory / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.11.2\n")
    return directory


def test_the_venv_is_read_from_the_site_packages_its_python_imports_only(tmp_path):
    venv = fake_venv(tmp_path / "venv")
    assert cache_probe.read_venv(str(venv))["torch_version_py"]["version"] == "2.11.0+cu128"
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.12.1\n")  # its python is 3.12 now
    answer = cache_probe.read_venv(str(venv))
    assert (answer["site_packages"], answer["torch_version_py"], answer["triton"]) == (None, None, None)


def write_stamp(root, fingerprint):
    (root / SPEC["stamp_name"]).write_text(json.dumps({"fingerprint": fingerprint, "stamped_by": "pve-gpu-recover"}))


def probe_of(tmp_path, roots, **spec):
    payload = cache_facts.probe_payload(dict(SPEC, venv=str(tmp_path / "venv"), roots=roots, **spec), 30)
    return cache_probe.probe(payload)


def test_the_probe_reads_the_venv_from_its_files(tmp_path):
    fake_venv(tmp_path / "venv")
    venv = probe_of(tmp_path, [])["venv"]
    assert venv["torch_version_py"]["version"] == "2.11.0+cu128"
    assert venv["torch_version_py"]["cuda"] == "12.8"
    assert venv["triton"] == {"name": "triton", "version": "3.3.0"}
    nightly = tmp_path / "nightly"
    fake_venv(nightly, triton=None)
    record = nightly / "lib" / "python3.11" / "site-packages" / "pytorch_triton-3.4.0+git1b0418a9.dist-info"
    record.mkdir()
    (record / "METADATA").write_text("Name: pytorch-triton\nVersion: 3.4.0+git1b0418a9\n\n")
    assert cache_probe.read_venv(str(nightly))["triton"] == {
        "name": "pytorch-triton",
        "version": "3.4.0+git1b0418a9",
    }
    assert cache_probe.read_venv(str(tmp_path / "none"))["exists"] is False


def test_the_probe_expands_the_templates_for_the_user():
    answer = cache_probe.probe(cache_facts.probe_payload(dict(SPEC, venv="/nonexistent/venv"), 30))
    home = answer["user"]["home"]
    assert [r["path"] for r in answer["roots"]] == ["/tmp/torchinductor_root", f"{home}/.triton/cache"]
    assert answer["homes"][home] == ["root"] or "root" in answer["homes"][home]
    assert cache_probe.expand("{home}/.triton/cache", "bob", None) is None
    assert ct_fs.clean("//.triton//cache/") == "/.triton/cache"


def test_the_probe_walks_by_lstat_names_links_out_and_reads_stamps_without_following(tmp_path):
    outside = tmp_path / "outside"
    (outside / "big").mkdir(parents=True)
    (outside / "big" / "data").write_bytes(b"x" * 5000)
    root = tmp_path / "inductor"
    (root / "fx" / "ab").mkdir(parents=True)
    (root / "fx" / "ab" / "graph").write_bytes(b"g" * 1000)
    (root / "fx" / "inside-link").symlink_to("ab/graph")
    (root / "to-dir").symlink_to(outside / "big")  # never entered: its 5000 bytes are not the cache's
    (root / "to-file").symlink_to("/etc/hostname")
    write_stamp(root, CU130)
    answer = probe_of(tmp_path, [str(root)])
    walked = answer["roots"][0]["walk"]
    assert (walked["size_bytes"], walked["files"], walked["links"], walked["entries"]) == (1000, 1, 3, 3)
    assert sorted(walked["escapes"], key=lambda e: e["link"]) == [
        {"link": f"{root}/to-dir", "target": str(outside / "big")},
        {"link": f"{root}/to-file", "target": "/etc/hostname"},
    ]
    assert answer["roots"][0]["stamp"]["fingerprint"] == CU130
    (root / SPEC["stamp_name"]).unlink()
    (root / SPEC["stamp_name"]).symlink_to(outside / "big" / "data")
    assert probe_of(tmp_path, [str(root)])["roots"][0]["stamp"]["reason"] == "it is a symlink"
    (root / SPEC["stamp_name"]).unlink()
    (root / SPEC["stamp_name"]).write_text("{not json")
    assert probe_of(tmp_path, [str(root)])["roots"][0]["stamp"]["reason"] == "it is not JSON"


def test_the_probe_resolves_a_symlinked_root(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "to-slash").symlink_to("/")
    answer = probe_of(tmp_path, [str(tmp_path / "link"), str(tmp_path / "to-slash"), str(tmp_path / "dangling")])
    link, slash, dangling = answer["roots"]
    assert (link["is_link"], link["real_path"], link["is_dir"]) == (True, str(tmp_path / "real"), True)
    assert (slash["real_path"], slash["walk"]) == ("/", slash["walk"])
    assert dangling["exists"] is False
    facts = cache_facts.module_facts(dict(SPEC, roots=[r["template"] for r in answer["roots"]]), answer, LABEL)
    assert facts["roots"][1]["reason"] == "it resolves through a symlink to /, and is the filesystem root /"


def test_the_probe_names_a_process_whose_cwd_or_open_file_is_in_a_root(tmp_path):
    root = tmp_path / "inductor"
    root.mkdir()
    (root / "kernel").write_text("k")
    sleeper = subprocess.Popen(["sleep", "30"], cwd=root)
    holder = subprocess.Popen(["sh", "-c", "exec 3<kernel; cd /; exec sleep 30"], cwd=root)
    try:
        for _ in range(100):  # until the shell has opened the file and left the directory
            answer = probe_of(tmp_path, [str(root)])
            found = {u["pid"]: u["how"] for u in answer["users"][str(root)]}
            if found.get(holder.pid) == ["open"]:
                break
            subprocess.run(["sleep", "0.05"], check=True)
        assert found == {sleeper.pid: ["cwd"], holder.pid: ["open"]}
    finally:
        for process in (sleeper, holder):
            process.kill()
            process.wait()


def test_the_probe_runs_as_the_fact_pass_ships_it_on_python_3_9(tmp_path):
    python = other_python("3.9")
    if python is None:
        unavailable("no python3.9 here")
    fake_venv(tmp_path / "venv")
    root = tmp_path / "inductor"
    root.mkdir()
    write_stamp(root, CU130)
    payload = cache_facts.probe_payload(dict(SPEC, venv=str(tmp_path / "venv"), roots=[str(root)]), 30)
    answer = run_probes_program(python, {"compile_cache": (cache_probe, payload)})["compile_cache"]
    assert "error" not in answer, answer
    assert answer["answer"]["roots"][0]["stamp"]["fingerprint"] == CU130


# -- the script on real directories ----------------------------------------------------------------------------
def act(tmp_path, roots, fingerprint=CU128, warmup=None, homes=None, *, uid=0):
    payload = {
        "roots": [{"path": str(p), "real_path": os.path.realpath(p), "id": None, "action": a} for p, a in roots],
        "fingerprint": fingerprint,
        "stamp_name": SPEC["stamp_name"],
        "homes": homes if homes is not None else HOMES,
        "uid": uid,
        "warmup": warmup,
        "timeout": 30,
    }
    return script.probe(payload)


def tree(root):
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*"))


def test_a_purge_removes_links_never_their_targets_and_stamps_last(tmp_path):
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "precious").write_text("precious")
    root = tmp_path / "inductor"
    (root / "fx" / "ab").mkdir(parents=True)
    (root / "fx" / "ab" / "graph").write_bytes(b"g" * 1000)
    (root / "fx" / "to-dir").symlink_to(outside / "keep")
    (root / "to-file").symlink_to(outside / "keep" / "precious")
    (root / "fifo").mkdir()
    os.mkfifo(root / "fifo" / "pipe")
    write_stamp(root, CU130)
    done = act(tmp_path, [(root, "purge")])
    assert "error" not in done, done
    purged = done["roots"][0]["purged"]
    assert (purged["files"], purged["bytes"], purged["links"]) == (4, 1000, 2)
    assert sorted(purged["links_out"], key=lambda e: e["link"]) == [
        {"link": f"{root}/fx/to-dir", "target": str(outside / "keep")},
        {"link": f"{root}/to-file", "target": str(outside / "keep" / "precious")},
    ]
    assert tree(root) == [SPEC["stamp_name"]]
    assert (outside / "keep" / "precious").read_text() == "precious"
    stamp = json.loads((root / SPEC["stamp_name"]).read_text())
    assert (stamp["fingerprint"], stamp["stamped_by"]) == (CU128, "pve-gpu-recover")
    assert (done["roots"][0]["size_before"], done["roots"][0]["size_after"], done["roots"][0]["stamped"]) == (
        1000,
        0,
        True,
    )


def test_a_purge_cut_short_leaves_a_marker_that_is_never_adopted(tmp_path, monkeypatch):
    fake_venv(tmp_path / "venv")
    root = tmp_path / "inductor"
    (root / "a").mkdir(parents=True)
    (root / "a" / "f").write_text("f")
    write_stamp(root, CU130)

    def cut(self, *args, **kwargs):
        raise OSError(5, "Input/output error", "a/f")

    monkeypatch.setattr(script.Purge, "empty", cut)
    done = act(tmp_path, [(root, "purge")])
    assert (done["error"], done["message"]) == ("os_error", "Input/output error (a/f)")
    answer = probe_of(tmp_path, [str(root)])
    assert answer["roots"][0]["stamp"]["reason"] == "a purge of it was interrupted"
    assert cache_facts.module_facts(dict(SPEC, roots=[str(root)]), answer, LABEL)["roots"][0]["verdict"] == "stale"


def test_a_directory_mounted_inside_a_root_is_left_alone(tmp_path):
    root = tmp_path / "inductor"
    (root / "data").mkdir(parents=True)
    (root / "junk").write_text("j")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root / "data")], check=False, capture_output=True
    )
    if mounted.returncode != 0:
        unavailable(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        (root / "data" / "dataset").write_text("not a cache")
        answer = probe_of(tmp_path, [str(root)])
        assert answer["roots"][0]["walk"]["mounts"] == [str(root / "data")]
        done = act(tmp_path, [(root, "purge")])
        assert done["roots"][0]["purged"]["mounts_left"] == [str(root / "data")]
        assert (root / "data" / "dataset").read_text() == "not a cache"
        assert not (root / "junk").exists()
    finally:
        subprocess.run(["umount", str(root / "data")], check=True)


def test_the_script_checks_the_rules_again_and_deletes_nothing_when_one_fails(tmp_path):
    home = tmp_path / "home" / "alice"
    (home / "notes").mkdir(parents=True)
    (home / "notes" / "thesis.tex").write_text("years of work")
    done = act(tmp_path, [(home, "purge")], homes={str(home): ["alice"]})
    assert (done["error"], done["message"]) == (
        "refused",
        f"compile cache root {home} refused: it is the home directory of alice; nothing was deleted",
    )
    assert (home / "notes" / "thesis.tex").read_text() == "years of work"
    # A root replaced by a symlink after it was read: it resolves elsewhere now.
    root = tmp_path / "inductor"
    root.mkdir()
    payload_real = str(root)
    root.rmdir()
    root.symlink_to(home)
    payload = {
        "roots": [{"path": str(root), "real_path": payload_real, "action": "purge"}],
        "fingerprint": CU128,
        "stamp_name": SPEC["stamp_name"],
        "homes": {},
        "uid": 0,
        "warmup": None,
        "timeout": 30,
    }
    done = script.probe(payload)
    assert (done["error"], done["message"]) == (
        "unsafe",
        f"compile cache root {root} refused: {root} is a symlink (to {home}); a root is opened without following "
        "links: give the directory itself as the root; nothing was deleted",
    )
    assert (home / "notes" / "thesis.tex").read_text() == "years of work"


def test_the_script_purges_nothing_while_a_process_works_in_a_root(tmp_path):
    root = tmp_path / "inductor"
    root.mkdir()
    (root / "graph").write_text("g")
    sleeper = subprocess.Popen(["sleep", "30"], cwd=root)
    try:
        done = act(tmp_path, [(root, "purge")])
    finally:
        sleeper.kill()
        sleeper.wait()
    assert done["error"] == "busy"
    assert done["message"] == (
        f"nothing was purged: a live process uses a cache to purge: {root} by pid {sleeper.pid} (sleep: cwd)"
    )
    assert (root / "graph").read_text() == "g"


def test_a_stamp_is_written_atomically_and_owned_like_its_directory(tmp_path):
    root = tmp_path / "inductor"
    root.mkdir()
    os.chown(root, 4321, 4321)
    done = act(tmp_path, [(root, "stamp")])
    assert done["roots"][0]["stamped"] is True
    info = os.lstat(root / SPEC["stamp_name"])
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (4321, 4321, 0o644)
    assert tree(root) == [SPEC["stamp_name"]]  # no temporary file left


def test_the_step_fits_the_registry():
    # The registry's own validation and probe-part assembly, with the step's check_spec.
    from ansible_collections.pve_gpu.recover.plugins.module_utils.steps import registry as step_registry  # noqa: PLC0415

    assert step_registry.load_step("compile_cache") is cache_facts
    specs = step_registry.validate_specs(
        {"compile_cache": {"roots": ["/tmp/torchinductor_{user}"], "warmup": ["true"]}}
    )
    assert specs["compile_cache"] == dict(SPEC, roots=["/tmp/torchinductor_{user}"], warmup=["true"])
    assert step_registry.probe_parts(specs, 60)["compile_cache"] == (
        cache_probe,
        cache_facts.probe_payload(specs["compile_cache"], 60),
    )
    with pytest.raises(
        step_registry.StepSpecError, match=re.escape("settings of step compile_cache: the root '/x/{uid}'")
    ):
        step_registry.validate_specs({"compile_cache": {"roots": ["/x/{uid}"]}})
