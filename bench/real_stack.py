#!/usr/bin/env python3
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Benchmark (not a test): the seeds' real stack rebuilt through recover.yml beside the builder alone, and the
polluted recovery beside the sum of its parts, in the lab's CT 200 (issue 41 item 2).

    .venv/bin/python bench/real_stack.py prepare            # once, with network: the lock and ~2.7 GB of wheels
    flock /run/pve-gpu-lab-session.lock .venv/bin/python bench/real_stack.py run [--runs 3] [--pip-runs 1]
        [--keep-lab] [--out FILE.json]
    flock /run/pve-gpu-lab-session.lock .venv/bin/python bench/real_stack.py run --warm-only [--before DIR] ...

``prepare`` (no lab) compiles the seeds' requirements (torch 2.11.0, transformers, datasets, safetensors, wandb,
boto3) with ``uv pip compile --generate-hashes`` for CPython 3.11 on x86_64-manylinux_2_28 from PyPI (this machine
cannot reach download.pytorch.org: PyPI's torch 2.11.0 is a CUDA build with its nvidia-* wheels), and downloads
each pinned wheel with ``pip download --require-hashes`` into CACHE, which ``labctl destroy`` keeps; and PyPI's uv
wheel of the controller's uv. The lab's CTs have no network: ``run`` serves the wheels inside CT 200 (a PEP 503
index of hard links in the lab's index directory, ``labctl index-serve``) and points the lock at it.

``run`` builds the lab (unless it is up), then for each of ``--runs`` rounds, interleaved, in CT 200:

* ``cold``: recover.yml on a CT without the venv and with uv's cache emptied (every wheel fetched and unpacked);
  ``uv_cold``: the builder alone, the same way: ``uv venv`` + ``uv pip sync --require-hashes`` of the same lock
  with the same uv and python, uv's cache emptied first, into a scratch directory;
* ``warm``: recover.yml on the venv drifted by one ``.pth`` file, uv's cache full; ``uv_warm``: the builder alone
  on that cache; ``converged``: recover.yml right after (nothing to do);
* ``pip`` (``--pip-runs`` rounds): ``python3 -m venv`` + ``pip install --no-deps --require-hashes`` of the lock,
  as the build script runs pip, pip's cache off;
* ``polluted``: CT 200 broken as molecule's recover scenario's prepare breaks it (its first play, run as is: a
  stray GPU holder, the repo off its pin with local edits, a venv polluted with 3-pin locks, a stale compile
  cache), then recover.yml with that scenario's settings; broken again, its parts by hand: the GPU holder's end
  (SIGTERM until its memory is free), the repository saved and reset (``git diff``, a tarball of the untracked
  files, ``git reset --hard``, ``git clean``), the builder alone on the good lock (uv's cache warm), the stale
  cache purged, and a converged recover.yml (ansible-playbook, its fact pass: one ssh, one pct exec). Then
  ``polluted_nosettle``: the same with ``gpu_processes_settle=0``.

``--warm-only`` runs the warm rebuild, the builder alone and a third kind in turn: the warm rebuild with piped file
transfers, or with ``--before DIR`` the warm rebuild of another checkout (``git archive`` of an older commit), so
that a change is measured against what it changed, interleaved, on the same lab and cache.

Each recover.yml run starts cold (a fresh ssh ControlPath) and counts ssh invocations and which ran a module
(every ssh whose command runs python: a pipelined module, an async start, a status call), new ssh connections
(the lab sshd's log), ``pct exec`` calls (the stand-in's log), with the per-task profile
(bench/callback/bench_profile.py). It checks the venv's files are linked from uv's cache (link counts) and prints
medians and the floors' ratios: warm <= uv_warm + 1.5 s, cold <= 1.1 x uv_cold, polluted <= 1.3 x its parts.
Whatever it made in the CT goes at the end; a lab it built is destroyed unless ``--keep-lab``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "lab"))
import wheelhouse  # noqa: E402  (the lab's index writer)

BIN = Path(sys.executable).parent
LAB = Path("/var/lib/pve-gpu-recover-lab")
LABCTL = ["/usr/bin/python3", str(ROOT / "tests/lab/labctl.py")]
CACHE = Path("/var/cache/pve-gpu-recover-lab/real-stack")
REQUIREMENTS = ["torch==2.11.0", "transformers", "datasets", "safetensors", "wandb", "boto3"]
INDEX_URL = "http://127.0.0.1:8900/realstack/simple"
VENV = "/opt/venvs/real"
LOCK_IN_CT = "/root/real-stack.lock"
# Beside the venv: on its file system, as the build's new version is (uv hard-links from its cache there).
SCRATCH = "/opt/venvs/bench-builder"
PARTS_CACHE = "/opt/venvs/bench-uv-cache"
PYTHON = "3.11"
CT = ["lxc-attach", "-P", str(LAB / "lxc"), "-n", "200", "--clear-env", "--"]
CT_ENV = ["env", "HOME=/root", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C"]
# ssh that notes each invocation and its remote command (one line) before it runs.
SSH_WRAPPER = """#!/bin/sh
printf '%s %s\\n' "$(date +%s.%N)" "$(printf '%s ' "$@" | tr '\\n' ' ')" >> "$BENCH_SSH_LOG"
exec ssh "$@"
"""


def sh(argv, **kwargs):
    return subprocess.run(argv, check=True, text=True, capture_output=True, **kwargs)


def in_ct(script, check=True):
    """A shell script in CT 200 as root (lxc-attach, a clean environment); its stdout."""
    done = subprocess.run([*CT, *CT_ENV, "sh", "-c", script], text=True, capture_output=True, check=False)
    if check and done.returncode != 0:
        sys.exit(f"bench: in CT 200 `{script}` failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def timed_in_ct(script):
    started = time.monotonic()
    in_ct(script)
    return round(time.monotonic() - started, 3)


# -- prepare: the lock and the wheels, on this machine -------------------------------------------------------------
def prepare(_args):
    CACHE.mkdir(parents=True, exist_ok=True)
    lock = CACHE / "pypi.lock"
    if not lock.exists():
        (CACHE / "requirements.in").write_text("\n".join(REQUIREMENTS) + "\n")
        argv = [str(BIN / "uv"), "pip", "compile", "--quiet", "--generate-hashes", "--emit-index-url"]
        argv += ["--python-version", PYTHON, "--python-platform", "x86_64-manylinux_2_28"]
        argv += ["--index-url", "https://pypi.org/simple", str(CACHE / "requirements.in"), "-o", str(lock)]
        sh(argv)
    wheels = CACHE / "wheels"
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    # This machine's CPython 3.11 on x86_64 is the CT's: pip takes the files of the lock's hashes that fit it.
    sh([*pip, "--require-hashes", "-r", str(lock), "-d", str(wheels)])
    sh([*pip, "--platform", "manylinux_2_17_x86_64", "-d", str(CACHE / "uv"), f"uv=={metadata.version('uv')}"])
    files = sorted(wheels.glob("*.whl"))
    print(
        f"{lock}: {pins(lock.read_text())} pins; {len(files)} wheels, {sum(f.stat().st_size for f in files) >> 20} MiB"
    )


def pins(text):
    return sum(1 for line in text.splitlines() if "==" in line and not line.startswith(("#", " ")))


def lab_lock():
    """The lock, pointed at the index served in the CT."""
    text = (CACHE / "pypi.lock").read_text()
    return "".join(
        f"--index-url {INDEX_URL}\n" if line.startswith("--index-url") else line
        for line in text.splitlines(keepends=True)
    )


# -- one recover.yml run, counted -----------------------------------------------------------------------------------
def count_lines(path, needle=None):
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return sum(1 for line in handle if needle is None or needle in line)
    except FileNotFoundError:
        return 0


def pct_execs():
    with open(LAB / "pct-calls.log", encoding="utf-8") as handle:
        return sum(1 for line in handle if json.loads(line)["argv"][:1] == ["exec"])


def recover(workdir, extra_vars, *extra, env=None, root=ROOT):
    """recover.yml of the checkout ``root`` on CT 200 with ``extra_vars`` (a file) and ``env`` on top of the bench's:
    seconds, round trips, per-task profile."""
    ssh_log, profile = workdir / "ssh.log", workdir / "profile.json"
    ssh_log.write_text("")
    profile.unlink(missing_ok=True)
    control = tempfile.mkdtemp(prefix="cp-", dir=workdir)
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(root / "ansible.cfg"),
        ANSIBLE_SSH_EXECUTABLE=str(workdir / "ssh"),
        ANSIBLE_SSH_CONTROL_PATH_DIR=control,
        ANSIBLE_CALLBACK_PLUGINS=str(ROOT / "bench/callback"),
        ANSIBLE_CALLBACKS_ENABLED="pve_gpu.recover.recover_report,bench_profile",
        PVE_GPU_RECOVER_REPORT_DIR=str(workdir / "reports"),
        BENCH_PROFILE=str(profile),
        BENCH_SSH_LOG=str(ssh_log),
        **(env or {}),
    )
    argv = [str(BIN / "ansible-playbook"), "-i", str(root / "inventory/lab"), "recover.yml", "-l", "ct200"]
    argv += ["-e", f"@{extra_vars}", *extra]
    accepted, execs = count_lines(LAB / "ssh/sshd.log", "Accepted"), pct_execs()
    started = time.monotonic()
    done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        sys.exit(f"bench: recover.yml failed (exit {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}")
    for socket in Path(control).iterdir():  # end the run's master: the next run starts cold
        subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={socket}", "x"], capture_output=True, check=False)
    commands = [line.split(" ", 1) for line in ssh_log.read_text().splitlines()]
    tasks = json.loads(profile.read_text())["tasks"] if profile.exists() else []
    wall = time.time() - seconds
    return {
        "seconds": round(seconds, 3),
        "ssh_invocations": len(commands),
        "module_executions": sum(1 for _, c in commands if "python" in c),
        "ssh_connections": count_lines(LAB / "ssh/sshd.log", "Accepted") - accepted,
        "pct_exec": pct_execs() - execs,
        "tasks": {t["task"]: t["seconds"] for t in tasks},
        "progress_lines": [line for line in done.stderr.splitlines() if ": training_venv: " in line],
        # When each ssh started (seconds into the run) and the end of its command: where the time went.
        "timeline": [[round(float(at) - wall, 3), command[-110:]] for at, command in commands],
    }


def task_seconds(run, words):
    return round(sum(s for name, s in run["tasks"].items() if words in name), 3)


# -- the real stack ---------------------------------------------------------------------------------------------------
def uv_in_ct():
    """The uv the role installed in the CT for the build (training_venv's install_uv): the builder alone runs it."""
    found = in_ct("ls -d /usr/local/lib/pve-gpu-recover/uv-*/uv 2>/dev/null; true").split()
    if not found:
        sys.exit("bench: no uv in CT 200 after a rebuild (looked in /usr/local/lib/pve-gpu-recover)")
    return found[-1]


def build_cache(uv):
    """The uv cache the build used: its own beside the venv's versions (``<path>.cache/uv``) where the step keeps
    one, else uv's default for root. The builder alone uses the same, so that warm means the same for both."""
    own = in_ct(f"test -d {VENV}.cache/uv && echo {VENV}.cache/uv; true").strip()
    return own or in_ct(f"{uv} cache dir").strip()


def builder_uv(uv, cache, lock=LOCK_IN_CT, cold=False):
    """``uv venv`` + ``uv pip sync`` of the lock into a scratch directory beside the venv, as the build script runs
    them (wheels only, hard links from the cache), with ``cache`` as uv's cache, emptied first when ``cold``."""
    in_ct(f"rm -rf {SCRATCH}" + (f" {cache}" if cold else ""))
    seconds = timed_in_ct(
        f"export UV_CACHE_DIR={cache} UV_LINK_MODE=hardlink UV_NO_CONFIG=1; "
        f"{uv} venv --quiet --allow-existing --python python{PYTHON} {SCRATCH} && "
        f"{uv} pip sync --quiet --python {SCRATCH}/bin/python --require-hashes --only-binary :all: {lock}"
    )
    in_ct(f"rm -rf {SCRATCH}")
    return seconds


def builder_pip():
    """``python -m venv`` + pip, as the build script runs pip (its cache off, so every wheel is fetched)."""
    in_ct(f"rm -rf {SCRATCH}")
    seconds = timed_in_ct(
        f"python{PYTHON} -m venv {SCRATCH} && PIP_NO_CACHE_DIR=1 {SCRATCH}/bin/python -B -m pip install --quiet "
        f"--no-deps --require-hashes --no-input -r {LOCK_IN_CT}"
    )
    in_ct(f"rm -rf {SCRATCH}")
    return seconds


def links(venv, cache):
    """The venv's files and how many of them are hard links (uv's cache holds the other name); the venv's own
    size beside uv's cache (``du`` counts a file once: what the venv adds to the cache)."""
    out = in_ct(f"find {venv}/lib -type f -printf '%n\\n' | sort | uniq -c; du -sh {cache} {venv}/ | cut -f1")
    rows = [line.split() for line in out.splitlines()]
    counts = {int(n): int(c) for c, n in (r for r in rows if len(r) == 2)}
    return {
        "files": sum(counts.values()),
        "linked": sum(c for n, c in counts.items() if n > 1),
        "cache": cache,
        "cache_size": rows[-2][0],
        "venv_beyond_cache": rows[-1][0],
    }


def drift_venv():
    in_ct(f"echo 'import os' > {VENV}/lib/python{PYTHON}/site-packages/zz-bench-drift.pth")


# -- the polluted recovery -------------------------------------------------------------------------------------------
def break_like_molecule(workdir):
    """Run the first play of molecule/recover/prepare.yml as is (the breakage); its settings and holder pid."""
    # make_venv_index.py builds its torch wheels anew (another hash each time) and never replaces a file of the
    # index: each break starts from none, as a scenario's first prepare does.
    # uv keeps a wheel it fetched by its URL: the old torch of the same name would fail the new lock's hash, so its
    # caches lose those wheels too (the build's own beside /opt/venvs/train, and root's default).
    for index in ("pypi", "cu128"):
        shutil.rmtree(LAB / "index" / index, ignore_errors=True)
    in_ct(
        "rm -rf /opt/venvs/train.cache; for uv in /usr/local/lib/pve-gpu-recover/uv-*/uv; do [ -x $uv ] && "
        "$uv cache clean torch six idna flashinfer-python >/dev/null 2>&1; done; true"
    )
    plays = yaml.safe_load((ROOT / "molecule/recover/prepare.yml").read_text())
    playbook = ROOT / "molecule/recover" / f".bench-break-{os.getpid()}.yml"  # beside it: its tasks/ resolve
    playbook.write_text(yaml.safe_dump(plays[:1], sort_keys=False))
    ephemeral = workdir / "molecule"
    ephemeral.mkdir(exist_ok=True)
    env = dict(os.environ, MOLECULE_PROJECT_DIRECTORY=str(ROOT), MOLECULE_EPHEMERAL_DIRECTORY=str(ephemeral))
    env["ANSIBLE_CONFIG"] = str(ROOT / "ansible.cfg")
    interpreter = f"ansible_python_interpreter={sys.executable}"  # as molecule's inventory gives it
    try:
        done = subprocess.run(
            [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", "-e", interpreter, str(playbook)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        playbook.unlink()
    if done.returncode != 0:
        sys.exit(f"bench: breaking CT 200 as molecule's recover scenario does failed:\n{done.stdout[-4000:]}")
    return ephemeral / "settings.json", int((ephemeral / "holder_pid").read_text())


def gpu_memory_free():
    out = sh([*CT, "nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]).stdout
    return all(int(value) == 0 for value in out.split())


def parts_by_hand(workdir, settings, holder, uv):
    """The broken CT's unavoidable work, each part timed alone: the holder's end (SIGTERM, gone, its memory free),
    the repository saved and reset, the builder alone on the good lock (uv's cache warm), the stale cache purged."""
    commit = json.loads(Path(settings).read_text())["training_code_commit"]
    started = time.monotonic()
    os.kill(holder, 15)
    while Path(f"/proc/{holder}").exists() or not gpu_memory_free():
        time.sleep(0.005)  # the bench's own sampling, not the product's
    gpu_end = round(time.monotonic() - started, 3)
    git = timed_in_ct(
        "cd /srv/train && git diff HEAD > /root/bench-saved.patch && "
        "git ls-files -o --exclude-standard -z | xargs -0 tar -cf /root/bench-untracked.tar && "
        f"git reset -q --hard {commit} && git clean -fdq"
    )
    subprocess.run(
        [*CT, "sh", "-c", "cat > /root/bench-good.lock"],
        input=(workdir / "molecule/locks/good.lock").read_text(),
        text=True,
        check=True,
    )
    # The recovery's build fetches these three pins anew (see break_like_molecule): so does the builder alone.
    venv = builder_uv(uv, PARTS_CACHE, "/root/bench-good.lock", cold=True)
    in_ct(f"rm -rf {PARTS_CACHE}")
    purge = timed_in_ct("rm -rf /tmp/torchinductor_root")
    in_ct("rm -f /root/bench-saved.patch /root/bench-untracked.tar /root/bench-good.lock")
    return {"gpu_end": gpu_end, "git_save_and_reset": git, "builder": venv, "cache_purge": purge}


# -- the run ----------------------------------------------------------------------------------------------------------
def lab_up():
    """Build the lab unless it is up; whether this run built it."""
    if "CT 200: running" in subprocess.run([*LABCTL, "status"], capture_output=True, text=True, check=False).stdout:
        return False
    sh([*LABCTL, "create"])
    return True


def serve_lock():
    wheels = sorted((CACHE / "wheels").glob("*.whl"))
    if not wheels:
        sys.exit(f"bench: no wheels in {CACHE / 'wheels'}; run `bench/real_stack.py prepare` first (network)")
    wheelhouse.write_index(LAB / "index" / "realstack", wheels)  # hard links: no copy of the 2.7 GB
    sh([*LABCTL, "index-serve", "ct200"])
    subprocess.run([*CT, "sh", "-c", f"cat > {LOCK_IN_CT}"], input=lab_lock(), text=True, check=True)
    return {"pins": pins(lab_lock()), "wheels": len(wheels), "wheel_bytes": sum(w.stat().st_size for w in wheels)}


def one_round(workdir, stack_vars, results, pip):
    uv, cache = results["uv"], results["cache"]
    # Cold: the builder first (with no venv left, its emptied cache frees every block), then recover.yml.
    in_ct(f"rm -rf {VENV} {VENV}.*")
    results["uv_cold"].append(builder_uv(uv, cache, cold=True))
    in_ct(f"rm -rf {VENV} {VENV}.* {cache}")
    results["cold"].append(recover(workdir, stack_vars))
    results["links_cold"].append(links(VENV, cache))
    # Warm: one .pth more in the venv, uv's cache full; the builder and recover.yml in turn, then converged.
    pair = [
        ("warm", lambda: (drift_venv(), recover(workdir, stack_vars))[1]),
        ("uv_warm", lambda: builder_uv(uv, cache)),
    ]
    for name, measure in pair if len(results["warm"]) % 2 == 0 else pair[::-1]:
        results[name].append(measure())
    results["links_warm"].append(links(VENV, cache))
    results["converged"].append(recover(workdir, stack_vars))
    if pip:
        results["pip"].append(builder_pip())
    # The polluted CT: recover.yml; its converged run; broken again, its parts by hand; again, without settle.
    settings, _ = break_like_molecule(workdir)
    results["polluted"].append(recover(workdir, settings))
    results["polluted_converged"].append(recover(workdir, settings))
    settings, holder = break_like_molecule(workdir)
    results["parts"].append(parts_by_hand(workdir, settings, holder, uv))
    settings, _ = break_like_molecule(workdir)
    results["polluted_nosettle"].append(recover(workdir, settings, "-e", "gpu_processes_settle=0"))


def warm_round(workdir, stack_vars, results, before=None):
    """``--warm-only``: the warm rebuild, the builder, and the warm rebuild with the ssh connection's file transfers
    piped through ssh (``ssh_transfer_method = piped``: the async start's two puts) instead of sftp, in turn; with
    ``before`` (``--before DIR``, another checkout) the warm rebuild of that checkout in the piped one's place."""
    piped = {"ANSIBLE_SSH_TRANSFER_METHOD": "piped"}
    third = ("warm_piped", lambda: (drift_venv(), recover(workdir, stack_vars, env=piped))[1])
    if before is not None:
        third = ("warm_before", lambda: (drift_venv(), recover(workdir, stack_vars, root=before))[1])
    kinds = [
        ("warm", lambda: (drift_venv(), recover(workdir, stack_vars))[1]),
        ("uv_warm", lambda: builder_uv(results["uv"], results["cache"])),
        third,
    ]
    shift = len(results["warm"]) % len(kinds)
    for name, measure in kinds[shift:] + kinds[:shift]:
        results[name].append(measure())


def summarize_warm(results):
    build, copy = "Build the venv from the lock", "Put the uv wheel on the node"
    m = {k: median([r["seconds"] for r in results[k]]) for k in ("warm", "warm_piped", "warm_before")}
    m.update(
        uv_warm=median(results["uv_warm"]),
        warm_build_task=median([task_seconds(r, build) for r in results["warm"]]),
        warm_piped_build_task=median([task_seconds(r, build) for r in results["warm_piped"]]),
        warm_before_build_task=median([task_seconds(r, build) for r in results["warm_before"]]),
        warm_copy_task=median([task_seconds(r, copy) for r in results["warm"]]),
        warm_before_copy_task=median([task_seconds(r, copy) for r in results["warm_before"]]),
    )
    return {"medians": m}


def median(values):
    return round(statistics.median(values), 3) if values else None


def summarize(results):
    seconds = {k: [r["seconds"] for r in results[k]] for k in ("cold", "warm", "converged", "polluted")}
    seconds["polluted_nosettle"] = [r["seconds"] for r in results["polluted_nosettle"]]
    build = "Build the venv from the lock"
    parts = [
        round(sum(p.values()) + c["seconds"], 3)
        for p, c in zip(results["parts"], results["polluted_converged"], strict=True)
    ]
    m = {k: median(v) for k, v in seconds.items()}
    m.update(
        {k: median(results[k]) for k in ("uv_cold", "uv_warm", "pip")},
        cold_build_task=median([task_seconds(r, build) for r in results["cold"]]),
        warm_build_task=median([task_seconds(r, build) for r in results["warm"]]),
        polluted_parts=median(parts),
        polluted_converged=median([r["seconds"] for r in results["polluted_converged"]]),
    )
    for part in ("gpu_end", "git_save_and_reset", "builder", "cache_purge"):
        m[f"part_{part}"] = median([p[part] for p in results["parts"]])
    counts = {
        k: {c: median([r[c] for r in results[k]]) for c in ("ssh_invocations", "module_executions", "pct_exec")}
        for k in ("cold", "warm", "converged", "polluted", "polluted_nosettle", "polluted_converged")
    }
    floors = {
        "warm build task <= uv_warm + 1.5 s": [m["warm_build_task"], round(m["uv_warm"] + 1.5, 3)],
        "warm recover.yml - converged <= uv_warm + 1.5 s": [
            round(m["warm"] - m["converged"], 3),
            round(m["uv_warm"] + 1.5, 3),
        ],
        "cold build task <= 1.1 x uv_cold": [m["cold_build_task"], round(1.1 * m["uv_cold"], 3)],
        "cold recover.yml - converged <= 1.1 x uv_cold": [
            round(m["cold"] - m["converged"], 3),
            round(1.1 * m["uv_cold"], 3),
        ],
        "polluted recover.yml <= 1.3 x its parts": [m["polluted"], round(1.3 * m["polluted_parts"], 3)],
        "polluted recover.yml, settle 0 <= 1.3 x its parts": [
            m["polluted_nosettle"],
            round(1.3 * m["polluted_parts"], 3),
        ],
    }
    return {"medians": m, "round_trips": counts, "floors": {k: [*v, v[0] <= v[1]] for k, v in floors.items()}}


def run(args):
    results = {
        k: []
        for k in (
            "cold",
            "uv_cold",
            "links_cold",
            "warm",
            "uv_warm",
            "links_warm",
            "converged",
            "pip",
            "polluted",
            "polluted_converged",
            "parts",
            "polluted_nosettle",
            "warm_piped",
            "warm_before",
        )
    }
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=True)
    results["about"] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": head.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else ""),
        "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.platform()}",
        "command": " ".join(sys.argv),
    }
    created = lab_up()
    try:
        results["stack"] = serve_lock()
        with tempfile.TemporaryDirectory(prefix="pgr-real-stack-") as tmp:
            workdir = Path(tmp)
            (workdir / "ssh").write_text(SSH_WRAPPER)
            (workdir / "ssh").chmod(0o755)
            stack_vars = workdir / "stack.json"
            stack_vars.write_text(
                json.dumps(
                    {
                        "training_venv_lock_file": str(CACHE / "lab.lock"),
                        "training_venv_path": VENV,
                        "training_venv_uv_wheel": str(next((CACHE / "uv").glob("uv-*.whl"))),
                        "training_venv_python_version": PYTHON,
                        "training_venv_keep": 2,
                    }
                )
            )
            (CACHE / "lab.lock").write_text(lab_lock())
            recover(workdir, stack_vars)  # not counted: installs the role's uv in the CT, warms the file caches
            results["uv"] = uv_in_ct()
            results["cache"] = build_cache(results["uv"])
            for i in range(args.runs):
                if args.warm_only:
                    warm_round(workdir, stack_vars, results, args.before)
                    print(f"round {i + 1}: " + json.dumps(summarize_warm(results)["medians"]), flush=True)
                    continue
                one_round(workdir, stack_vars, results, pip=i < args.pip_runs)
                print(f"round {i + 1}: " + json.dumps(summarize(results)["medians"]), flush=True)
    finally:
        in_ct(f"rm -rf {VENV} {VENV}.* {SCRATCH} {LOCK_IN_CT} /root/.cache/uv {PARTS_CACHE}", check=False)
        shutil.rmtree(LAB / "index" / "realstack", ignore_errors=True)
        if created and not args.keep_lab:
            subprocess.run([*LABCTL, "destroy"], check=False, capture_output=True)
        done = (
            (results["warm_before" if args.before else "warm_piped"])
            if args.warm_only
            else results["polluted_nosettle"]
        )
        results["summary"] = (summarize_warm if args.warm_only else summarize)(results) if done else None
        if args.out:  # what was measured, a run that stopped included
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results["summary"], indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(required=True)
    sub.add_parser("prepare", help="compile the lock and download the wheels (network)").set_defaults(func=prepare)
    p = sub.add_parser("run", help="the benchmark, in the lab (wrap it in flock /run/pve-gpu-lab-session.lock)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--pip-runs", type=int, default=1)
    p.add_argument("--keep-lab", action="store_true")
    p.add_argument("--warm-only", action="store_true", help="warm rebuilds only, with sftp and piped file transfers")
    p.add_argument("--before", type=Path, help="with --warm-only: another checkout's warm rebuild instead of piped")
    p.add_argument("--out", type=Path)
    p.set_defaults(func=run)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
