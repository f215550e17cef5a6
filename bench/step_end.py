#!/usr/bin/env python3
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Benchmark (not a test): how soon a finished build is seen, Ansible's polls against the step's action (issue 41).

    .venv/bin/python bench/step_end.py [--runs 5] [--build 1] [--interval 15] [--out FILE.json]

On localhost (a bare host, no lab), the real training_venv module rebuilds a venv whose uv is a stand-in that
works for ``--build`` seconds (it says what it downloads), then fails as a dropped download: the module's own
answer ends the job. Two tasks of one play run the same module with the same options, interleaved ``--runs``
times, each in its own ansible-playbook run:

* ``polled``: ``async`` and ``poll: <interval>``, Ansible's own way (the action steps aside: Ansible sleeps
  ``poll`` seconds before each ``async_status``, and cleans up after);
* ``followed``: ``async``, ``poll: 0`` and ``pve_gpu_recover_follow: <interval>``, as the roles run it: the action
  follows the job, each status call waiting on the node.

Per run: the task's seconds (ansible-playbook's own timing, from the profile callback), how long after the stand-in
uv ended the task ended, and the connection's commands and transfers (``-vvv``'s EXEC and PUT lines). Medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
LOCK = "--index-url http://127.0.0.1:9/simple\n\nsix==1.17.0 \\\n    --hash=sha256:" + "a" * 64 + "\n"
UV = """#!/bin/sh
case "$1" in
  venv) for a in "$@"; do last="$a"; done; mkdir -p "$last/bin"; exit 0 ;;
  pip) end=$(( $(date +%s%N) + BUILD_NS ))
       while [ "$(date +%s%N)" -lt "$end" ]; do echo "Downloading torch (846.0MiB)" >&2; sleep 0.1; done
       date +%s.%N > "$(dirname "$0")/uv-ended"
       echo "error: Failed to download torch: connection closed" >&2; exit 2 ;;
esac
exit 1
"""
PLAY = """
- name: One rebuild, {kind}
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Rebuild ({kind})
      pve_gpu.recover.training_venv:
        node_name: localhost
        state: present
        path: "{work}/venvs/train"
        lock: "{{{{ lookup('ansible.builtin.file', '{work}/lock.txt') }}}}"
        uv: "{work}/uv"
        python_version: "{python}"
        tooling: ignore
      async: 600
      poll: {poll}
      vars:
        pve_gpu_recover_follow: {follow}
      ignore_errors: true
"""


def run_once(work, kind, interval):
    play = work / f"{kind}.yml"
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    poll, follow = (interval, "null") if kind == "polled" else (0, interval)
    play.write_text(PLAY.format(kind=kind, work=work, python=python, poll=poll, follow=follow))
    (work / "uv-ended").unlink(missing_ok=True)
    profile = work / "profile.json"
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_PIPELINING="true",
        ANSIBLE_CALLBACK_PLUGINS=str(ROOT / "bench/callback"),
        ANSIBLE_CALLBACKS_ENABLED="bench_profile",
        BENCH_PROFILE=str(profile),
    )
    argv = [str(BIN / "ansible-playbook"), "-vvv", "-i", "localhost,", "-c", "local", str(play)]
    argv += ["-e", f"ansible_python_interpreter={sys.executable}"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    ended_at = time.time()
    if done.returncode != 0 or not (work / "uv-ended").exists():
        sys.exit(f"bench: {kind} did not run the build:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")
    task = json.loads(profile.read_text())["tasks"][0]
    section = done.stdout[done.stdout.index("TASK [Rebuild") :]
    return {
        "seconds": task["seconds"],
        # The playbook ends right after the task: its end, less ansible-playbook's own exit, bounds the task's.
        "after_build": round(ended_at - float((work / "uv-ended").read_text()), 3),
        "exec": len(re.findall(r"^<localhost> EXEC ", section, re.M)),
        "put": len(re.findall(r"^<localhost> PUT ", section, re.M)),
        # async_status's (cleanup included) or step_job_status's module executions.
        "status_calls": len(re.findall(r"^Using module file .*/(?:async_status|step_job_status)\.py$", section, re.M)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--build", type=float, default=1.0)
    parser.add_argument("--interval", type=int, default=15)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=True)
    results = {
        "about": {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "commit": head.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else ""),
            "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.platform()}",
            "command": " ".join(sys.argv),
        },
        "polled": [],
        "followed": [],
    }
    with tempfile.TemporaryDirectory(prefix="pgr-step-end-") as tmp:
        work = Path(tmp)
        (work / "lock.txt").write_text(LOCK)
        (work / "uv").write_text(UV.replace("BUILD_NS", str(int(args.build * 1e9))))
        (work / "uv").chmod(0o755)
        for i in range(args.runs):
            for kind in ("polled", "followed") if i % 2 == 0 else ("followed", "polled"):
                results[kind].append(run_once(work, kind, args.interval))
    results["medians"] = {
        kind: {key: statistics.median(r[key] for r in results[kind]) for key in results[kind][0]}
        for kind in ("polled", "followed")
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results["medians"], indent=1))


if __name__ == "__main__":
    main()
