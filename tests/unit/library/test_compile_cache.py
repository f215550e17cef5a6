"""plugins/modules/compile_cache.py: the module on a CT through FakeRunner, and on a bare host with real directories.

A CT target is replayed through FakeRunner: every ``pct exec`` argv (with the JSON payloads it carries) and the
sources that travel on stdin are asserted; a converged target costs one call, a purge two. A bare host runs the
probe part and the acting script in-process against real directories in tmp_path (a hand-made venv, a stand-in
nvidia-smi on PATH naming an H200): stale purged, fresh kept, unstamped adopted (and not when the venv is rebuilt
in the run), a symlink inside a root that leads out survives with only the link gone, check mode changes nothing
and answers what a real run does, a second run changes nothing. Last, a real torch.compile warm-up with the CPU
torch wheel of /opt/wheels in a uv venv (skipped without the wheel or a C compiler): it fills and stamps the cache
for that torch, and a second run keeps it; its cold and warm first-call times are printed (run with -s).
"""

import inspect
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import compile_cache
import pytest
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import act as ct_act
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import fs as ct_fs
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import proc as ct_proc
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import progress as ct_progress
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import venv as ct_venv
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import facts as cache_facts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import probe as cache_probe
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import script
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import verdicts as cache_verdicts
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache import warmup as cache_warmup

from tests.conftest import ROOT, other_python, unavailable
from tests.fakes import FakeRunner, run_module, run_probes_program

STAMP = ".pve-gpu-recover-stamp"
H200 = ["NVIDIA H200"]
CU128 = {"torch": "2.11.0+cu128", "variant": "cu128", "cuda": "12.8", "triton": "3.3.0", "gpus": H200}
CU130 = {"torch": "2.11.0+cu130", "variant": "cu130", "cuda": "13.0", "triton": "3.3.0", "gpus": H200}
NOW = "torch 2.11.0+cu128 (CUDA 12.8), triton 3.3.0, NVIDIA H200"
VERSION_PY = "__version__ = '{version}'\ndebug = False\ncuda: Optional[str] = '{cuda}'\ngit_version = 'abc'\n"
MB = 1_000_000

# -- a CT through FakeRunner -----------------------------------------------------------------------------------
PCT = ["pct", "exec", "200", "--keep-env", "0", "--", "timeout", "-k", "5"]
WRAPPER = ["env", "LC_ALL=C", "LANG=C", "python3", "-I", "-"]
CT_ROOTS = ["/tmp/torchinductor_{user}", "{home}/.triton/cache"]
CT_PARAMS = {"vmid": 200}
READ_PAYLOAD = {
    "user": "root",
    "venv": "/opt/venvs/train",
    "roots": CT_ROOTS,
    "stamp_name": STAMP,
    "timeout": 60,
    "nvidia_smi_argv": ["nvidia-smi", "--query-gpu=name", "--format=csv"],
}
SMI = {"rc": 0, "stdout": "name\n" + "NVIDIA H200\n" * 8, "stderr": ""}


def ct_root(path, *, stamp=None, size=0, exists=True, entries=1, escapes=()):
    stamped = {"state": "ok", "fingerprint": stamp, "reason": None} if stamp else {"state": "none", "reason": None}
    walk = {"size_bytes": size, "files": 2, "entries": entries, "links": len(escapes), "escapes": list(escapes)}
    walk.update(escapes_count=len(escapes), mounts=[], partial=False, unreadable=[])
    return {
        "template": path,
        "expanded": path,
        "path": path,
        "exists": exists,
        "is_link": False,
        "is_dir": exists,
        "real_path": path,
        "owner": {"uid": 0, "gid": 0} if exists else None,
        "stamp": stamped if exists else None,
        "walk": walk if exists else None,
        "walked": exists,
        "unsafe": None,
        "id": [64, 11 if path.startswith("/tmp") else 12] if exists else None,
    }


def ct_answer(inductor, triton, users=None):
    return {
        "user": {"name": "root", "exists": True, "uid": 0, "gid": 0, "home": "/root"},
        "homes": {"/root": ["root"], "/nonexistent": ["nobody"]},
        "venv": {
            "path": "/opt/venvs/train",
            "exists": True,
            "site_packages": "/opt/venvs/train/lib/python3.11/site-packages",
            "torch_version_py": {"version": "2.11.0+cu128", "cuda": "12.8", "git_version": "abc", "hip": None},
            "triton": {"name": "triton", "version": "3.3.0"},
        },
        "roots": [dict(inductor, template=CT_ROOTS[0]), dict(triton, template=CT_ROOTS[1])],
        "users": users or {},
        "unreadable_processes": [],
        "users_partial": False,
        "gpus": SMI,
        "pid": 77,
        "euid": 0,
        "errors": [],
    }


LINK = {"link": "/tmp/torchinductor_root/h", "target": "/etc/hostname"}
CONVERGED = ct_answer(
    ct_root("/tmp/torchinductor_root", stamp=CU128, size=MB), ct_root("/root/.triton/cache", stamp=CU128)
)
STALE = ct_answer(
    ct_root("/tmp/torchinductor_root", stamp=CU130, size=152 * MB, escapes=[LINK]),
    ct_root("/root/.triton/cache", size=12 * MB),
)
ACT_PAYLOAD = {
    "roots": [
        {"path": "/tmp/torchinductor_root", "real_path": "/tmp/torchinductor_root", "id": [64, 11], "action": "purge"},
        {"path": "/root/.triton/cache", "real_path": "/root/.triton/cache", "id": [64, 12], "action": "stamp"},
    ],
    "fingerprint": CU128,
    "stamp_name": STAMP,
    "homes": {"/root": ["root"], "/nonexistent": ["nobody"]},
    "uid": 0,
    "warmup": None,
    "timeout": 960,  # warmup_timeout + timeout: the script's own deadline
}
DONE = {
    "roots": [
        {
            "path": "/tmp/torchinductor_root",
            "real_path": "/tmp/torchinductor_root",
            "action": "purge",
            "size_before": 152 * MB,
            "size_after": 0,
            "purged": {"files": 1204, "bytes": 152 * MB, "links": 1, "links_out": [LINK], "mounts_left": []},
            "stamped": True,
        },
        {
            "path": "/root/.triton/cache",
            "real_path": "/root/.triton/cache",
            "action": "stamp",
            "size_before": 12 * MB,
            "size_after": 12 * MB,
            "purged": None,
            "stamped": True,
        },
    ],
    "warmup": None,
    "fingerprint": CU128,
    "seconds": 0.8,
}
STALE_CHANGES = [
    "purge /tmp/torchinductor_root (stamped for torch 2.11.0+cu130, now 2.11.0+cu128; 152 MB; symlinks out of it "
    "removed, never followed: /tmp/torchinductor_root/h -> /etc/hostname)",
    f"stamp /tmp/torchinductor_root for {NOW}",
    f"stamp /root/.triton/cache (unstamped: adopted as built for {NOW}; 12 MB)",
]


def read_call(answer, payload=READ_PAYLOAD):
    out = json.dumps({"compile_cache": {"answer": answer, "seconds": 0.02}})
    return [*PCT, "60", *WRAPPER, json.dumps({"compile_cache": payload})], (0, out, "")


def act_call(done, reread, payload=ACT_PAYLOAD, seconds="1020", read_payload=READ_PAYLOAD):
    # warmup_timeout (900) + timeout (60) + 60 s so the script answers before the pct exec is killed.
    payloads = {"act": payload, "compile_cache": read_payload}
    out = json.dumps({"act": {"answer": done, "seconds": 0.8}, "compile_cache": {"answer": reread, "seconds": 0.02}})
    return [*PCT, seconds, *WRAPPER, json.dumps(payloads)], (0, out, "")


@pytest.fixture
def on_pve1(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "pve1")


@pytest.mark.usefixtures("on_pve1")
def test_ct_fresh_caches_cost_one_pct_exec_and_change_nothing(monkeypatch, capsys):
    for check_mode in (False, True):
        runner = FakeRunner(read_call(CONVERGED))
        result = run_module(compile_cache, CT_PARAMS, runner, monkeypatch, capsys, check_mode=check_mode)
        assert (result["changed"], result["changes"], result["expected"]) == (False, [], CU128)
        assert (
            result["diff"]["before"]
            == result["diff"]["after"]
            == (f"/tmp/torchinductor_root: {NOW}\n/root/.triton/cache: {NOW}\n")
        )
        assert [r["verdict"] for r in result["cache_roots"]] == ["fresh", "fresh"]
        assert (result["size_before"], result["size_after"], result["warmup"]) == (MB, None, None)


@pytest.mark.usefixtures("on_pve1")
def test_ct_check_mode_reports_the_purge_and_the_real_run_does_it_in_one_more_pct_exec(monkeypatch, capsys):
    check = run_module(compile_cache, CT_PARAMS, FakeRunner(read_call(STALE)), monkeypatch, capsys, check_mode=True)
    runner = FakeRunner(read_call(STALE), act_call(DONE, CONVERGED))
    real = run_module(compile_cache, CT_PARAMS, runner, monkeypatch, capsys)
    assert check["changed"] is real["changed"] is True
    assert check["changes"] == real["changes"] == STALE_CHANGES
    assert (
        check["diff"]
        == real["diff"]
        == {
            "before": "/tmp/torchinductor_root: torch 2.11.0+cu130 (CUDA 13.0), triton 3.3.0, NVIDIA H200\n"
            "/root/.triton/cache: unstamped\n",
            "after": f"/tmp/torchinductor_root: {NOW}\n/root/.triton/cache: {NOW}\n",
        }
    )
    assert [r["verdict"] for r in check["cache_roots"]] == ["stale", "unstamped"]
    assert "purged" not in check["cache_roots"][0]
    assert real["cache_roots"][0]["purged"]["links_out"] == [LINK]
    assert [r["stamped"] for r in real["cache_roots"]] == [True, True]
    assert (real["size_before"], real["size_after"]) == (164 * MB, 1 * MB)
    # What travels on stdin: the shared module once, then the script's and the reader's sources, run in that order
    # in one process.
    given = json.loads(runner.stdin[1])
    shipped = (ct_act, ct_fs, ct_proc, ct_run, ct_progress, ct_venv)
    assert given["shared"] == {m.__name__: inspect.getsource(m) for m in shipped}
    assert given["sources"] == {
        "act": inspect.getsource(script),
        "compile_cache": inspect.getsource(cache_probe),
    }


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_refused_root_fails_before_anything_is_deleted(monkeypatch, capsys):
    refused = dict(ct_root("/"), walk=None, stamp=None, walked=False)
    home = dict(ct_root("/root"), walk=None, stamp=None, walked=False)
    answer = ct_answer(refused, home)
    params = dict(CT_PARAMS, roots=["/", "{home}"])
    result = run_module(
        compile_cache,
        params,
        FakeRunner(read_call(answer, dict(READ_PAYLOAD, roots=["/", "{home}"]))),
        monkeypatch,
        capsys,
    )
    assert (result["failed"], result["error"]) == (True, "problems")
    assert result["msg"] == (
        "CT 200 on pve1: compile cache root / refused: it is the filesystem root /; nothing is deleted "
        "(compile_cache_roots must name the cache directories themselves, like /tmp/torchinductor_root); "
        "CT 200 on pve1: compile cache root /root refused: it is the home directory of root; nothing is deleted "
        "(compile_cache_roots must name the cache directories themselves, like /tmp/torchinductor_root)"
    )
    assert result["refused"] == [
        {"path": "/", "reason": "it is the filesystem root /", "problem": True},
        {"path": "/root", "reason": "it is the home directory of root", "problem": True},
    ]


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_process_the_gpu_step_ends_first_counts_as_gone_in_check_mode_only(monkeypatch, capsys):
    users = {"/tmp/torchinductor_root": [{"pid": 41, "name": "python3", "how": ["mapped"]}]}
    answer = ct_answer(STALE["roots"][0], STALE["roots"][1], users=users)
    params = dict(CT_PARAMS, ending_pids=[41])
    check = run_module(compile_cache, params, FakeRunner(read_call(answer)), monkeypatch, capsys, check_mode=True)
    assert check["changed"] is True
    assert check["changes"][0].endswith("; in use by pid 41 (python3: mapped), which the GPU step ends first)")
    # A real run comes after the GPU step: a process still there is a live one, and nothing is purged under it.
    real = run_module(compile_cache, params, FakeRunner(read_call(answer)), monkeypatch, capsys)
    assert (real["failed"], real["error"]) == (True, "problems")
    assert "cannot purge /tmp/torchinductor_root: in use by pid 41 (python3: mapped)" in real["msg"]


WARMUP_PATH = "/opt/venvs/train/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
@pytest.mark.usefixtures("on_pve1")
def test_ct_a_warm_up_that_cannot_start_fails_before_anything_is_purged(check_mode, monkeypatch, capsys):
    warmup = ["warmup-train", "--steps", "1"]
    read = dict(READ_PAYLOAD, warmup={"command": "warmup-train", "path": WARMUP_PATH})
    found = {"command": "warmup-train", "file": None, "state": "missing", "mode": None}
    answer = dict(STALE, warmup=dict(found, interpreter=None, interpreter_state=None))
    runner = FakeRunner(read_call(answer, read))  # the read, and no act: nothing is purged
    result = run_module(
        compile_cache, dict(CT_PARAMS, warmup=warmup), runner, monkeypatch, capsys, check_mode=check_mode
    )
    assert (result["failed"], result["error"]) == (True, "problems")
    assert result["msg"] == (
        f"CT 200 on pve1: the warm-up command warmup-train is not on the PATH it runs with ({WARMUP_PATH}); install "
        "it in the target or give compile_cache_warmup its full path, or set compile_cache_warmup to [] (no warm-up)"
    )


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_failed_warm_up_names_its_exit_code_and_stderr_and_what_was_done(monkeypatch, capsys):
    warmup = ["/opt/venvs/train/bin/python", "/srv/train/warmup.py"]
    failed = {
        "error": "warmup_failed",
        "message": "the warm-up `/opt/venvs/train/bin/python /srv/train/warmup.py` failed with exit code 1: "
        "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised: CompilationError",
        "cmd": warmup,
        "rc": 1,
        "stdout_tail": "",
        "stderr_tail": "Traceback (most recent call last):\n...\ntorch._dynamo.exc.BackendCompilerFailed: backend="
        "'inductor' raised: CompilationError",
        "done": {"roots": DONE["roots"], "warmup": {"argv": warmup, "rc": 1}},
    }
    payload = dict(ACT_PAYLOAD)
    payload["warmup"] = {
        "argv": warmup,
        "env": {
            "PATH": "/opt/venvs/train/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root",
            "USER": "root",
            "LOGNAME": "root",
            "LANG": "C.UTF-8",
            "VIRTUAL_ENV": "/opt/venvs/train",
            "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_root",
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
        },
        "timeout": 900,
        "cwd": "/root",
        "user": "root",
        "uid": 0,
        "gid": 0,
    }
    # The read also says how the warm-up's command would be found.
    read = dict(READ_PAYLOAD, warmup={"command": warmup[0], "path": payload["warmup"]["env"]["PATH"]})
    runner = FakeRunner(read_call(STALE, read), act_call(failed, CONVERGED, payload, read_payload=read))
    result = run_module(compile_cache, dict(CT_PARAMS, warmup=warmup), runner, monkeypatch, capsys)
    assert (result["failed"], result["error"], result["rc"], result["cmd"]) == (True, "warmup_failed", 1, warmup)
    assert result["msg"] == f"CT 200 on pve1: {failed['message']}"
    assert result["stderr_tail"] == failed["stderr_tail"]
    assert result["done"]["roots"][0]["purged"]["files"] == 1204


@pytest.mark.usefixtures("on_pve1")
def test_ct_caches_still_stale_after_acting_fail_the_task(monkeypatch, capsys):
    runner = FakeRunner(read_call(STALE), act_call(DONE, STALE))
    result = run_module(compile_cache, CT_PARAMS, runner, monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "verify")
    assert result["msg"].startswith(
        "CT 200 on pve1: the compile caches are still not in spec after the purge: purge /tmp/torchinductor_root"
    )


@pytest.mark.usefixtures("on_pve1")
def test_ct_a_script_answer_of_the_wrong_shape_is_refused(monkeypatch, capsys):
    runner = FakeRunner(read_call(STALE), act_call({"roots": "all"}, CONVERGED))
    result = run_module(compile_cache, CT_PARAMS, runner, monkeypatch, capsys)
    assert (result["error"], result["msg"]) == (
        "probe",
        "CT 200 on pve1: the compile cache script answered no 'roots' in the expected shape",
    )


@pytest.mark.usefixtures("on_pve1")
def test_ct_options_that_cannot_work_fail_before_any_call(monkeypatch, capsys):
    result = run_module(compile_cache, dict(CT_PARAMS, roots=["cache"]), FakeRunner(), monkeypatch, capsys)
    assert (result["failed"], result["error"]) == (True, "invalid")
    assert result["msg"].startswith("the root 'cache' is not an absolute path")


# -- real directories on a bare host ---------------------------------------------------------------------------
def fake_venv(directory, version="2.11.0+cu128", cuda="12.8", triton="3.3.0"):
    site = directory / "lib" / "python3.11" / "site-packages"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "version.py").write_text(VERSION_PY.format(version=version, cuda=cuda))
    record = site / f"triton-{triton}.dist-info"
    record.mkdir()
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: triton\nVersion: {triton}\n\n")
    (directory / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.11.2\n")
    return directory


def write_stamp(root, fingerprint):
    (root / STAMP).write_text(json.dumps({"fingerprint": fingerprint, "stamped_by": "pve-gpu-recover"}))


def stamp_of(root):
    return json.loads((root / STAMP).read_text())["fingerprint"]


def snapshot(*roots):
    """Every path under ``roots``: kind, link target, size, mtime, inode. What check mode must keep."""
    found = {}
    for root in roots:
        for directory, dirs, files in os.walk(root):
            for name in [".", *dirs, *files]:
                full = os.path.normpath(os.path.join(directory, name))
                info = os.lstat(full)
                link = os.readlink(full) if stat.S_ISLNK(info.st_mode) else None
                found[full] = (stat.S_IFMT(info.st_mode), link, info.st_size, info.st_mtime_ns, info.st_ino)
    return found


def warnings_of(result):
    """The module's warnings as text (ansible-core 2.19+ returns each as a dict with its event; they add up over
    the module runs of one test process, so a test looks at the last)."""
    return [w["event"]["msg"] if isinstance(w, dict) else w for w in result.get("warnings") or []]


class Host:
    """A bare GPU host in tmp_path: a venv, three roots (inductor, triton, extra), an H200 nvidia-smi stand-in."""

    def __init__(self, tmp_path, monkeypatch):
        self.tmp = tmp_path
        self.monkeypatch = monkeypatch
        self.venv = fake_venv(tmp_path / "venv")
        self.inductor = tmp_path / "inductor"
        self.triton = tmp_path / "triton"
        self.extra = tmp_path / "extra"
        self.outside = tmp_path / "outside"
        self.outside.mkdir()
        (self.outside / "precious").write_text("precious")

    def params(self, **changed):
        roots = [str(self.inductor), str(self.triton), str(self.extra)]
        return {"venv": str(self.venv), "roots": roots, **changed}

    def run(self, capsys, *, check_mode=False, **changed):
        return run_module(
            compile_cache, self.params(**changed), FakeRunner(), self.monkeypatch, capsys, check_mode=check_mode
        )

    def weeks_of_experiments(self):
        """Stale inductor cache with a link out of it, an unstamped triton cache, a fresh extra one."""
        (self.inductor / "fxgraph" / "ab").mkdir(parents=True)
        (self.inductor / "fxgraph" / "ab" / "graph").write_bytes(b"g" * 4000)
        (self.inductor / "fxgraph" / "precious-link").symlink_to(self.outside / "precious")
        (self.inductor / "outside-dir").symlink_to(self.outside)
        write_stamp(self.inductor, CU130)
        (self.triton / "abc").mkdir(parents=True)
        (self.triton / "abc" / "kernel.cubin").write_bytes(b"k" * 300)
        self.extra.mkdir()
        (self.extra / "kept").write_text("compiled long ago")
        write_stamp(self.extra, CU128)


@pytest.fixture
def host(tmp_path, monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu1")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf 'name\\nNVIDIA H200\\nNVIDIA H200\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return Host(tmp_path, monkeypatch)


def test_stale_is_purged_fresh_kept_unstamped_adopted_and_the_links_target_survives(host, capsys):
    host.weeks_of_experiments()
    fresh_before = snapshot(host.extra)
    result = host.run(capsys)
    assert result["changed"] is True
    assert [r["verdict"] for r in result["cache_roots"]] == ["stale", "unstamped", "fresh"]
    # The walk reads a directory before the ones below it: the link at the top is named first.
    assert result["changes"][0] == (
        f"purge {host.inductor} (stamped for torch 2.11.0+cu130, now 2.11.0+cu128; 4.0 kB; symlinks out of it "
        f"removed, never followed: {host.inductor}/outside-dir -> {host.outside}, "
        f"{host.inductor}/fxgraph/precious-link -> {host.outside}/precious)"
    )
    # Stale: emptied, stamped for the venv and GPUs in use.
    assert sorted(os.listdir(host.inductor)) == [STAMP]
    assert stamp_of(host.inductor) == CU128
    purged = result["cache_roots"][0]["purged"]
    assert (purged["files"], purged["bytes"], purged["links"]) == (3, 4000, 2)
    assert sorted(e["link"] for e in purged["links_out"]) == [
        f"{host.inductor}/fxgraph/precious-link",
        f"{host.inductor}/outside-dir",
    ]
    # The links went; what they pointed at did not.
    assert (host.outside / "precious").read_text() == "precious"
    # Unstamped: adopted as it is.
    assert (host.triton / "abc" / "kernel.cubin").read_bytes() == b"k" * 300
    assert stamp_of(host.triton) == CU128
    # Fresh: not touched at all (same inodes, sizes, times).
    assert snapshot(host.extra) == fresh_before
    assert [(r["size_before"], r["size_after"], r["stamped"]) for r in result["cache_roots"]] == [
        (4000, 0, True),
        (300, 300, True),
        (17, 17, False),
    ]
    assert (result["size_before"], result["size_after"]) == (4317, 317)


def test_check_mode_changes_nothing_and_answers_what_the_real_run_does(host, capsys):
    host.weeks_of_experiments()
    before = snapshot(host.tmp)
    check = host.run(capsys, check_mode=True)
    assert snapshot(host.tmp) == before
    real = host.run(capsys)
    assert check["changed"] is real["changed"] is True
    assert check["changes"] == real["changes"]
    assert check["diff"] == real["diff"]
    assert check["diff"]["after"] == f"{host.inductor}: {NOW}\n{host.triton}: {NOW}\n{host.extra}: {NOW}\n"


def test_a_second_run_changes_nothing(host, capsys):
    host.weeks_of_experiments()
    assert host.run(capsys)["changed"] is True
    after_first = snapshot(host.tmp)
    for check_mode in (True, False):
        again = host.run(capsys, check_mode=check_mode)
        assert (again["changed"], again["changes"]) == (False, [])
        assert [r["verdict"] for r in again["cache_roots"]] == ["fresh", "fresh", "fresh"]
    assert snapshot(host.tmp) == after_first


def test_an_unstamped_cache_is_purged_not_adopted_when_the_venv_is_rebuilt_in_the_run(host, capsys):
    host.weeks_of_experiments()
    result = host.run(capsys, venv_pending=True)
    assert [r["verdict"] for r in result["cache_roots"]] == ["stale", "stale", "stale"]
    assert f"stamp {host.triton} for the venv as rebuilt in this run" in result["changes"]
    assert sorted(os.listdir(host.triton)) == [STAMP]
    assert sorted(os.listdir(host.extra)) == [STAMP]
    # Stamped for the venv as it is when the module runs (after the venv step rebuilt it).
    assert stamp_of(host.triton) == stamp_of(host.extra) == CU128
    assert host.run(capsys)["changed"] is False


def test_check_mode_on_a_fresh_target_plans_what_the_real_run_does_after_the_venv_step_builds_the_venv(host, capsys):
    # Issue 43, break 3: no venv yet (the venv step builds it first in a real run) and no cache. Check mode built
    # nothing, so there is no venv to read: the module judges against the lock's torch the role passes (as the
    # fact pass does) and plans the warm-up, instead of failing "... is no venv, so the caches cannot be judged".
    shutil.rmtree(host.venv)
    warmup = ["sh", "-c", 'mkdir -p "$TORCHINDUCTOR_CACHE_DIR" && echo compiled > "$TORCHINDUCTOR_CACHE_DIR/warm"']
    before = snapshot(host.tmp)
    check = host.run(
        capsys, check_mode=True, venv_pending=True, venv_pending_torch="2.11.0+cu128", warmup=warmup
    )  # fmt: skip
    assert snapshot(host.tmp) == before
    assert (check.get("failed"), check.get("changed")) == (None, True), check.get("msg")
    assert check["changes"] == [cache_warmup.warmup_line(dict(cache_facts.SPEC_DEFAULTS, warmup=warmup))]
    assert check["expected"] == dict(CU128, triton=None)
    # The real run: the venv step has built the venv by then; the warm-up fills the first root, stamped for it.
    fake_venv(host.venv)
    real = host.run(capsys, venv_pending=True, venv_pending_torch="2.11.0+cu128", warmup=warmup)
    assert (real["changed"], real["changes"]) == (True, check["changes"])
    assert stamp_of(host.inductor) == CU128
    assert host.run(capsys, warmup=warmup)["changed"] is False


def test_a_new_torch_build_makes_the_caches_stale(host, capsys):
    host.weeks_of_experiments()
    host.run(capsys)
    version_py = host.venv / "lib" / "python3.11" / "site-packages" / "torch" / "version.py"
    version_py.write_text(VERSION_PY.format(version="2.11.0+cu130", cuda="13.0"))
    result = host.run(capsys, check_mode=True)
    assert [r["reason"] for r in result["cache_roots"]] == ["stamped for torch 2.11.0+cu128, now 2.11.0+cu130"] * 3


def test_a_root_in_use_by_a_live_process_is_not_purged_and_the_pid_is_named(host, capsys):
    host.weeks_of_experiments()
    sleeper = subprocess.Popen(["sleep", "30"], cwd=host.inductor / "fxgraph")
    try:
        result = host.run(capsys)
        check = host.run(capsys, check_mode=True, ending_pids=[sleeper.pid])
    finally:
        sleeper.kill()
        sleeper.wait()
    assert (result["failed"], result["error"]) == (True, "problems")
    assert f"cannot purge {host.inductor}: in use by pid {sleeper.pid} (sleep: cwd)" in result["msg"]
    assert (host.inductor / "fxgraph" / "ab" / "graph").exists()
    assert check["changed"] is True  # the GPU step would have ended it


def test_a_symlinked_root_is_refused_wherever_it_leads_and_the_checkpoints_it_leads_to_survive(host, capsys):
    # Issue 25: the user's own root made a link to a checkpoint directory; a venv rebuilt in the run made every
    # cache stale, and the purge deleted the checkpoints as root. Now a root that is a link is never opened; and
    # since the user made it, it is refused alone: a warning, not a failure of every run (review C).
    checkpoints = host.tmp / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "step-90000.pt").write_text("weeks of training")
    link = host.tmp / "torchinductor_nobody"
    link.symlink_to(checkpoints)
    os.lchown(link, 65534, 65534)
    reason = (
        f"{link} is a symlink (to {checkpoints}); a root is opened without following links: give the directory "
        "itself as the root"
    )
    for check_mode in (True, False):
        result = host.run(capsys, check_mode=check_mode, user="nobody", roots=[str(link)], venv_pending=True)
        assert (checkpoints / "step-90000.pt").read_text() == "weeks of training"
        assert (result.get("failed"), result["changed"], result["changes"]) == (None, False, [])
        assert result["refused"] == [{"path": str(link), "reason": reason, "problem": False}]
        assert warnings_of(result)[-1] == (
            f"host gpu1: compile cache root {link} refused: {reason}; it is left as it is (neither purged nor "
            "stamped), the other roots are handled as usual; another user of the target may have put it there: "
            "remove it in the target, or set compile_cache_roots to a directory only root and compile_cache_user "
            "can write"
        )
    assert (checkpoints / "step-90000.pt").read_text() == "weeks of training"
    link.unlink()
    link.symlink_to("/root")
    result = host.run(capsys, roots=[str(link)])
    assert (
        f"compile cache root {link} refused: it resolves through a symlink to /root, and is the home"
        in (warnings_of(result)[-1])
    )


def test_the_warm_up_runs_alone_single_threaded_in_the_first_root_and_the_roots_it_makes_are_stamped(host, capsys):
    warmup = ["sh", "-c", 'mkdir -p "$TORCHINDUCTOR_CACHE_DIR" && env > "$TORCHINDUCTOR_CACHE_DIR/env.txt"']
    result = host.run(capsys, warmup=warmup, warmup_env={"EXTRA": "yes"})
    assert result["changed"] is True
    assert result["changes"] == [
        'warm up with `sh -c \'mkdir -p "$TORCHINDUCTOR_CACHE_DIR" && env > "$TORCHINDUCTOR_CACHE_DIR/env.txt"\'` '
        "as root (TORCHINDUCTOR_COMPILE_THREADS=1, timeout 900 s), then stamp the roots it fills"
    ]
    env = dict(line.split("=", 1) for line in (host.inductor / "env.txt").read_text().splitlines() if "=" in line)
    assert env["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(host.inductor)
    assert env["PATH"].startswith(f"{host.venv}/bin:")
    assert (env["HOME"], env["USER"], env["EXTRA"], env["VIRTUAL_ENV"]) == ("/root", "root", "yes", str(host.venv))
    assert "PYTEST_CURRENT_TEST" not in env  # nothing of the module's own environment leaks in
    warm = result["warmup"]
    assert (warm["ran"], warm["rc"], warm["filled"], warm["size_before"]) == (True, 0, True, 0)
    assert warm["size_after"] == (host.inductor / "env.txt").stat().st_size
    assert stamp_of(host.inductor) == CU128
    assert not host.triton.exists() and not host.extra.exists()  # it made none of them: nothing to stamp
    again = host.run(capsys, warmup=warmup)
    assert (again["changed"], again["warmup"]["planned"], again["warmup"]["ran"]) == (False, False, False)


def test_a_failed_warm_up_fails_with_its_exit_code_and_stderr_tail(host, capsys):
    host.weeks_of_experiments()
    warmup = ["sh", "-c", "echo compiling; echo 'RuntimeError: no GPU' >&2; exit 3"]
    result = host.run(capsys, warmup=warmup)
    assert (result["failed"], result["error"], result["rc"], result["cmd"]) == (True, "warmup_failed", 3, warmup)
    assert result["msg"] == f"host gpu1: the warm-up `{' '.join(warmup)}` failed with exit code 3: RuntimeError: no GPU"
    assert (result["stderr_tail"], result["stdout_tail"]) == ("RuntimeError: no GPU", "compiling")
    assert result["done"]["roots"][0]["purged"]["bytes"] == 4000  # the purge had happened, and says so


def test_a_warm_up_past_its_timeout_is_killed_with_its_children(host, capsys):
    warmup = ["sh", "-c", "sleep 30 & sleep 30"]
    started = time.monotonic()
    result = host.run(capsys, warmup=warmup, warmup_timeout=1)
    assert time.monotonic() - started < 10
    assert (result["error"], result["cmd"]) == ("warmup_timeout", warmup)
    assert "did not finish within 1 s (warmup_timeout) and was killed" in result["msg"]


def test_a_warm_up_that_fills_no_root_is_an_error_not_a_run_that_repeats_forever(host, capsys):
    result = host.run(capsys, warmup=["true"])
    assert result["error"] == "warmup_empty"
    assert "succeeded but left every cache root empty" in result["msg"]


def test_the_probe_and_script_run_as_shipped_on_python_3_9(host, capsys):
    python = other_python("3.9")
    if python is None:
        unavailable("no python3.9 here")
    host.weeks_of_experiments()
    spec = {name: host.params().get(name, default) for name, default in cache_facts.SPEC_DEFAULTS.items()}
    read = cache_facts.probe_payload(spec, 30, gpus=True)
    before = cache_facts.module_facts(spec, cache_probe.probe(read), "host gpu1")
    act = cache_facts.act_payload(spec, before, cache_probe.probe(read), 60)
    answers = run_probes_program(python, {"act": (script, act), "compile_cache": (cache_probe, read)})
    assert "error" not in answers["act"], answers["act"]
    assert "error" not in answers["act"]["answer"], answers["act"]["answer"]
    after = cache_facts.module_facts(spec, answers["compile_cache"]["answer"], "host gpu1")
    assert (after["changes"], [r["verdict"] for r in after["roots"]]) == ([], ["fresh", "fresh", "fresh"])


# -- a real torch.compile warm-up ------------------------------------------------------------------------------
TORCH_WHEEL = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
UV = ROOT / ".venv" / "bin" / "uv"
WARMUP = """\
import json, os, sys, time
import torch

@torch.compile
def step(x, w):
    return torch.nn.functional.gelu(x @ w).sum(dim=-1) + torch.sin(x).mean()

x, w = torch.randn(64, 32), torch.randn(32, 16)
started = time.perf_counter()
step(x, w)
first = time.perf_counter() - started
print(json.dumps({"first_call_s": round(first, 2), "torch": torch.__version__, "cuda": torch.version.cuda,
                  "threads": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS"),
                  "cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}))
"""


@pytest.fixture(scope="module")
def cpu_torch_venv(tmp_path_factory):
    """A python 3.11 uv venv holding the CPU torch wheel FILE of /opt/wheels and its runtime dependencies."""
    if not TORCH_WHEEL.exists():
        unavailable(f"{TORCH_WHEEL} is absent")
    if not (shutil.which("cc") and (shutil.which("c++") or shutil.which("g++"))):
        unavailable("no C/C++ compiler here (inductor compiles its CPU kernels)")
    if not Path("/usr/bin/python3.11").exists():
        unavailable("no /usr/bin/python3.11 (the wheel is cp311)")
    venv = tmp_path_factory.mktemp("torch") / "venv"
    env = dict(os.environ, UV_PYTHON_DOWNLOADS="never", UV_NO_CONFIG="1", UV_NO_PROGRESS="1")
    for argv in (
        [UV, "venv", "--quiet", "--python", "/usr/bin/python3.11", venv],
        # The wheel file itself, never PyPI's torch; its dependencies (sympy, networkx, ...) come from PyPI.
        [UV, "pip", "install", "--quiet", "--python", venv / "bin" / "python", TORCH_WHEEL],
    ):
        done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0 and "pypi.org" in done.stderr:
            unavailable(f"PyPI cannot be reached for torch's dependencies: {done.stderr.strip()[-300:]}")
        assert done.returncode == 0, done.stderr
    return venv


def first_call(venv, script_path, cache):
    env = {"PATH": f"{venv}/bin:/usr/bin:/bin", "HOME": "/root", "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    done = subprocess.run(
        [f"{venv}/bin/python", str(script_path)], capture_output=True, text=True, env=env, check=True, timeout=600
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_real_torch_compile_warm_up_fills_and_stamps_the_cache_and_a_second_run_keeps_it(
    cpu_torch_venv, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(socket, "gethostname", lambda: "cpu1")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi: a CPU host, no GPU in the fingerprint
    warm_py = tmp_path / "warmup.py"
    warm_py.write_text(WARMUP)
    inductor, triton = tmp_path / "inductor", tmp_path / "triton"
    params = {
        "venv": str(cpu_torch_venv),
        "roots": [str(inductor), str(triton)],
        "warmup": [f"{cpu_torch_venv}/bin/python", str(warm_py)],
        "warmup_timeout": 600,
    }
    started = time.monotonic()
    first = run_module(compile_cache, params, FakeRunner(), monkeypatch, capsys)
    module_seconds = time.monotonic() - started
    cpu = {"torch": "2.13.0+cpu", "variant": "cpu", "cuda": None, "triton": None, "gpus": []}
    assert first["changed"] is True
    assert first["expected"] == cpu
    warm = first["warmup"]
    assert (warm["ran"], warm["rc"], warm["filled"]) == (True, 0, True)
    cold = json.loads(warm["stdout_tail"].splitlines()[-1])
    assert (cold["torch"], cold["cuda"], cold["threads"], cold["cache"]) == ("2.13.0+cpu", None, "1", str(inductor))
    assert warm["size_after"] > warm["size_before"] == 0  # the compiled graph and its kernels
    assert len(os.listdir(inductor)) > 1
    assert stamp_of(inductor) == cpu
    assert not triton.exists()  # a CPU compile writes no triton cache
    second = run_module(compile_cache, params, FakeRunner(), monkeypatch, capsys)
    assert (second["changed"], second["warmup"]["ran"], [r["verdict"] for r in second["cache_roots"]]) == (
        False,
        False,
        ["fresh", "missing"],
    )
    # The same first call with the warm cache, and once more with an empty one, for the record.
    warm_again = first_call(cpu_torch_venv, warm_py, inductor)
    cold_again = first_call(cpu_torch_venv, warm_py, tmp_path / "cold")
    with capsys.disabled():
        print(
            f"\ntorch.compile first call on CPU ({os.cpu_count()} cores): cold {cold['first_call_s']} s in the warm-up"
            f" (module run {module_seconds:.1f} s, cache {cache_verdicts.human_size(warm['size_after'])}), cold again "
            f"{cold_again['first_call_s']} s, warm {warm_again['first_call_s']} s",
            file=sys.stderr,
        )


def test_a_root_another_user_squats_leaves_a_converged_target_unchanged_in_check_and_real_runs(host, capsys):
    # Review C: any user of the target could create /tmp/torchinductor_root first; that must not fail the step on
    # every run under the timer, nor make every run "changed". It is refused alone, loudly.
    sticky = host.tmp / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    squatted = sticky / "torchinductor_root"
    (squatted / "fx").mkdir(parents=True)
    (squatted / "fx" / "graph").write_text("theirs")
    os.chown(squatted / "fx" / "graph", 4321, 4321)
    os.chown(squatted / "fx", 4321, 4321)
    os.chown(squatted, 4321, 4321)
    host.weeks_of_experiments()
    roots = [str(squatted), str(host.extra)]  # extra is fresh
    results = [host.run(capsys, check_mode=check, roots=roots) for check in (True, False)]
    for unattended in (False, True):
        results.append(host.run(capsys, roots=roots, unattended=unattended))
    for result in results:
        assert (result.get("failed"), result["changed"], result["changes"]) == (None, False, [])
        assert [r["verdict"] for r in result["cache_roots"]] == ["refused", "fresh"]
        assert result["refused"][0]["problem"] is False
        assert f"compile cache root {squatted} refused: {squatted} is owned by uid 4321" in warnings_of(result)[-1]
        assert result["diff"]["before"] == result["diff"]["after"]
    assert [len(r["needs_window"]) for r in results] == [0, 0, 0, 1]
    assert (squatted / "fx" / "graph").read_text() == "theirs"
