#!/usr/bin/env python3
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Benchmark (not a test): a converged recover.yml against the manual procedure and a plain playbook, on the lab.

    make lab-up && .venv/bin/python bench/converged.py [--runs 7] [--delays 0,0.3,1.0] [--out FILE.json]

For each pct cost in ``--delays`` (seconds every ``pct`` call sleeps first, like a real node's Perl ``pct``:
``labctl pct-delay``), it runs, interleaved in one loop so the machine's noise hits all four alike:

* ``recover``: ``ansible-playbook recover.yml`` on the converged lab (CT 200);
* ``manual``: bench/manual_check.sh, six checks with one ``ssh node "pct exec 200 -- ..."`` each;
* ``peer``: bench/peer_checks.yml, the same six checks as ``ansible.builtin.command: pct exec ...``;
* ``recover_built``: ``recover`` with an empty payload store (a fresh Ansible local temp directory each run), so
  Ansible builds the fact pass's AnsiballZ payload in every run as it does by default (``recover`` restores the
  one kept by its previous run). The target_facts action still runs: recover.yml needs it to name the run.

Each run starts cold: a fresh ssh ControlPath directory, so no connection survives from the run before. Per run it
counts ssh invocations (bench/ssh-counting), new ssh connections (the lab sshd's "Accepted" log lines), ``pct
exec`` calls (the stand-in's call log) and module executions (bench/callback/bench_profile.py), and keeps the
per-task profile. It prints medians and the ratios recover/manual and recover/peer, and writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAB = Path("/var/lib/pve-gpu-recover-lab")
LABCTL = ["/usr/bin/python3", str(ROOT / "tests/lab/labctl.py")]
BIN = Path(sys.executable).parent
# recover_built: recover.yml with the fact pass's AnsiballZ payload built every run, as Ansible does without a kept
# payload (the action's store is empty each run), to show what keeping it saves in the same run.
KINDS = ("recover", "manual", "peer", "recover_built")


def count_lines(path, needle=None):
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return sum(1 for line in handle if needle is None or needle in line)
    except FileNotFoundError:
        return 0


def pct_execs():
    with open(LAB / "pct-calls.log", encoding="utf-8") as handle:
        return sum(1 for line in handle if json.loads(line)["argv"][:1] == ["exec"])


def command_for(kind):
    playbook = {
        "recover": ROOT / "recover.yml",
        "recover_built": ROOT / "recover.yml",
        "peer": ROOT / "bench/peer_checks.yml",
    }.get(kind)
    if playbook is None:
        return ["bash", str(ROOT / "bench/manual_check.sh")]
    return [str(BIN / "ansible-playbook"), "-i", str(ROOT / "inventory/lab/hosts.yml"), str(playbook)]


def run_once(kind, workdir):
    """One cold run of ``kind``: wall seconds and what it cost in round trips."""
    ssh_log = workdir / "ssh.log"
    ssh_log.write_text("")
    profile = workdir / "profile.json"
    profile.unlink(missing_ok=True)
    control = tempfile.mkdtemp(prefix="cp-", dir=workdir)
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_SSH_EXECUTABLE=str(ROOT / "bench/ssh-counting"),
        ANSIBLE_SSH_CONTROL_PATH_DIR=control,
        ANSIBLE_CALLBACK_PLUGINS=str(ROOT / "bench/callback"),
        ANSIBLE_CALLBACKS_ENABLED="pve_gpu.recover.recover_report,bench_profile",
        PVE_GPU_RECOVER_REPORT_DIR=str(workdir / "reports"),
        BENCH_PROFILE=str(profile),
        BENCH_SSH=str(ROOT / "bench/ssh-counting"),
        BENCH_SSH_LOG=str(ssh_log),
    )
    if kind == "recover_built":
        # The action keeps its payloads beside Ansible's local temp directory: a fresh one has none to restore.
        env["ANSIBLE_LOCAL_TEMP"] = tempfile.mkdtemp(prefix="lt-", dir=workdir)
    accepted = count_lines(LAB / "ssh/sshd.log", "Accepted")
    execs = pct_execs()
    started = time.monotonic()
    done = subprocess.run(command_for(kind), cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        sys.exit(f"{kind} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")
    # End the run's ssh master now, so its connection is not reused and its close is not billed to the next run.
    for socket in Path(control).iterdir():
        subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={socket}", "x"], capture_output=True, check=False)
    tasks = json.loads(profile.read_text())["tasks"] if profile.exists() else []
    return {
        "seconds": round(seconds, 3),
        "ssh_invocations": count_lines(ssh_log),
        "ssh_connections": count_lines(LAB / "ssh/sshd.log", "Accepted") - accepted,
        "pct_exec": pct_execs() - execs,
        # The manual script runs no module: each of its checks is one ssh + one pct exec.
        "module_executions": sum(t["executions"] for t in tasks),
        "tasks": tasks,
    }


def summarize(runs):
    """Medians per kind and the ratios the floors are about."""
    medians = {}
    for kind in KINDS:
        rows = runs[kind]
        medians[kind] = {
            key: statistics.median(r[key] for r in rows)
            for key in ("seconds", "ssh_invocations", "ssh_connections", "pct_exec", "module_executions")
        }
    ratios = {
        "recover/manual": round(medians["recover"]["seconds"] / medians["manual"]["seconds"], 2),
        "recover/peer": round(medians["recover"]["seconds"] / medians["peer"]["seconds"], 2),
        "recover_built/manual": round(medians["recover_built"]["seconds"] / medians["manual"]["seconds"], 2),
    }
    profile = {}
    for run in runs["recover"]:
        for task in run["tasks"]:
            profile.setdefault(task["task"], []).append(task["seconds"])
    return {
        "medians": medians,
        "ratios": ratios,
        "recover_profile": {name: round(statistics.median(v), 3) for name, v in profile.items()},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--delays", default="0,0.3,1.0")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if subprocess.run([*LABCTL, "status"], capture_output=True, check=False).returncode != 0:
        sys.exit("bench: the lab is not up; run `make lab-up` first")
    results = {"date": time.strftime("%Y-%m-%d"), "runs_per_kind": args.runs, "delays": {}}
    try:
        for delay in [float(d) for d in args.delays.split(",")]:
            subprocess.run([*LABCTL, "pct-delay", str(delay)], check=True)
            runs = {kind: [] for kind in KINDS}
            with tempfile.TemporaryDirectory(prefix="pgr-bench-") as tmp:
                workdir = Path(tmp)
                for kind in KINDS:  # warm-up: file caches, python bytecode; not counted
                    run_once(kind, workdir)
                for i in range(args.runs):
                    shift = i % len(KINDS)
                    order = KINDS[shift:] + KINDS[:shift]  # rotate so no kind always runs first
                    for kind in order:
                        runs[kind].append(run_once(kind, workdir))
            summary = summarize(runs)
            results["delays"][str(delay)] = dict(summary, runs=runs)
            m = summary["medians"]
            print(
                f"pct delay {delay:g} s: "
                + ", ".join(
                    f"{k} {m[k]['seconds']:.2f} s (ssh {m[k]['ssh_invocations']:g}/{m[k]['ssh_connections']:g} "
                    f"conn, pct exec {m[k]['pct_exec']:g}, modules {m[k]['module_executions']:g})"
                    for k in KINDS
                )
                + f"; recover/manual {summary['ratios']['recover/manual']}, "
                f"recover/peer {summary['ratios']['recover/peer']}, "
                f"recover_built/manual {summary['ratios']['recover_built/manual']}",
                flush=True,
            )
    finally:
        subprocess.run([*LABCTL, "pct-delay", "0"], check=False)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"written: {args.out}")
    for delay, data in results["delays"].items():
        print(f"\nrecover.yml per-task medians (pct delay {delay} s):")
        for name, seconds in data["recover_profile"].items():
            print(f"  {seconds:6.3f}  {name}")


if __name__ == "__main__":
    main()
