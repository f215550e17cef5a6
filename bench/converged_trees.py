#!/usr/bin/env python3
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Benchmark (not a test): a converged recover.yml from several checkouts, interleaved with the manual procedure and
the floor's two parts, on the lab.

    make lab-up && .venv/bin/python bench/converged_trees.py --tree before=/tmp/base --tree after=. --runs 7

Kinds, run in one loop whose order rotates each round (after one warm-up run of each, not counted), each run cold
(a fresh ssh ControlPath directory):

* ``recover@NAME``: ``ansible-playbook -i inventory/lab recover.yml`` from the checkout NAME (its ansible.cfg);
* ``manual``: bench/manual_check.sh, six ``ssh node "pct exec 200 -- ..."`` checks;
* ``noop``: ``ansible-playbook`` of a play of one ``meta: noop`` on CT 200 (Ansible's start, the inventory, a play);
* ``ssh_pct``: one ``ssh node "pct exec 200 -- true"``.

The floor of issue 41 is ``noop`` + ``ssh_pct``. It prints each kind's median and its ratio to ``manual``.
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
BIN = Path(sys.executable).parent
NOOP = "- name: Nothing\n  hosts: ct200\n  gather_facts: false\n  tasks:\n    - ansible.builtin.meta: noop\n"


def kinds(trees, workdir):
    noop = workdir / "noop.yml"
    noop.write_text(NOOP)
    playbook = [str(BIN / "ansible-playbook"), "-i", "inventory/lab/hosts.yml"]
    found = {"manual": (["bash", str(ROOT / "bench/manual_check.sh")], ROOT, {})}
    found["noop"] = ([*playbook, str(noop)], ROOT, {"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")})
    ssh = ["ssh", "-p", "2222", "-i", str(LAB / "ssh/id_ed25519"), "-o", f"UserKnownHostsFile={LAB}/ssh/known_hosts"]
    found["ssh_pct"] = ([*ssh, "-o", "BatchMode=yes", "root@127.0.0.1", "pct exec 200 -- true"], ROOT, {})
    for name, path in trees:
        found[f"recover@{name}"] = ([*playbook, "recover.yml"], path, {"ANSIBLE_CONFIG": str(path / "ansible.cfg")})
    return found


def run_once(argv, cwd, env, workdir):
    control = tempfile.mkdtemp(prefix="cp-", dir=workdir)
    started = time.monotonic()
    done = subprocess.run(argv, cwd=cwd, env=dict(os.environ, **env, ANSIBLE_SSH_CONTROL_PATH_DIR=control),
                          capture_output=True, text=True, check=False)  # fmt: skip
    seconds = time.monotonic() - started
    for socket in Path(control).iterdir():  # its master ends now, not in the next run
        subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={socket}", "x"], capture_output=True, check=False)
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")
    return round(seconds, 3)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH of a checkout (repeatable)")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = [(name, Path(path).resolve()) for name, path in (tree.split("=", 1) for tree in args.tree or ["this=."])]
    with tempfile.TemporaryDirectory(prefix="pgr-trees-") as tmp:
        workdir = Path(tmp)
        found = kinds(trees, workdir)
        names = list(found)
        for name in names:  # warm-up: file caches, each checkout's payload kept; not counted
            run_once(*found[name], workdir)
        runs = {name: [] for name in names}
        for i in range(args.runs):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                runs[name].append(run_once(*found[name], workdir))
    manual = statistics.median(runs["manual"])
    for name in names:
        median = statistics.median(runs[name])
        print(f"{name:20s} {median:6.3f} s  {median / manual:5.2f}x manual   runs {' '.join(map(str, runs[name]))}")
    floor = statistics.median(runs["noop"]) + statistics.median(runs["ssh_pct"])
    print(f"{'floor (noop+ssh_pct)':20s} {floor:6.3f} s  {floor / manual:5.2f}x manual")
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": runs,
                                        "trees": {n: str(p) for n, p in trees}}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
