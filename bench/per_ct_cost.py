#!/usr/bin/env python3
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Benchmark (not a test): what each piece of one converged CT's read costs in CPU, call by call.

    python3 bench/per_ct_cost.py [--runs 30] [--wrap 'lxc-attach -n 300 --clear-env --'] [--venv PATH]
                                 [--python python3] [--out FILE.json]

The fact pass reads a CT with one ``pct exec`` that runs, inside it, ``timeout``, ``env``, the CT's python with
the probe program (PROBES_MAIN fed the preflight and verify parts, what a CT of the lab's fleet is asked) and that
probe's one ``nvidia-smi --query-gpu``. This times each piece on its own, ``--runs`` calls of each, interleaved: CPU
seconds of the finished child (``getrusage(RUSAGE_CHILDREN)`` around each call) and wall seconds, medians.

* ``wrap``: ``true`` (what ``--wrap`` itself costs: ``lxc-attach`` into a lab CT; nothing on a bare host);
* ``timeout_env``: ``timeout -k 5 60 env LC_ALL=C LANG=C true``, the guard every CT command runs under;
* ``python_start``: ``python3 -I -S -c pass``, the probe's interpreter flags;
* ``python_start_site``: ``python3 -I -c pass``, the same with the CT's ``site`` (before 2.2.1);
* ``nvidia_smi_query_gpu``: the probe's own argv (module_utils/nvidia_smi.query_gpu_argv, every field);
* ``nvidia_smi_list``: ``nvidia-smi -L``;
* ``nvidia_smi_query_apps``: the compute processes (the node's read, once per node);
* ``probe``: the whole probe program with its JSON on stdin, its ``nvidia-smi`` included;
* ``probe_with_site``: the same program started without ``-S`` (before 2.2.1).

On a GPU host with no ``--wrap`` the nvidia-smi figures are the real tool's; in a lab CT they are the stand-in's.
Every figure includes ``--wrap``'s own cost (subtract ``wrap``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "collections"))

# pylint: disable=wrong-import-position
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import nvidia_smi  # noqa: E402
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import target as node_target  # noqa: E402
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.preflight import (  # noqa: E402
    facts as preflight_facts,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify import facts as verify_facts  # noqa: E402


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def probe_input(venv):
    """The stdin a converged CT's probe program gets: the preflight and verify parts with their default settings."""
    preflight = preflight_facts.probe_payload(dict(preflight_facts.SPEC_DEFAULTS))
    verify = verify_facts.probe_payload({"venv": venv})
    return node_target.probes_input(
        {
            node_target.probe_name(preflight_facts.PROBE): (preflight_facts.PROBE, preflight),
            node_target.probe_name(verify_facts.PROBE): (verify_facts.PROBE, verify),
        }
    ).encode()


def pieces(python, venv):
    """``{name: (argv, stdin)}``: every piece of a CT's read that is timed."""
    return {
        "wrap": (["true"], None),
        "timeout_env": (["timeout", "-k", "5", "60", "env", "LC_ALL=C", "LANG=C", "true"], None),
        "python_start": ([python, "-I", "-S", "-c", "pass"], None),
        "python_start_site": ([python, "-I", "-c", "pass"], None),
        "nvidia_smi_query_gpu": (nvidia_smi.query_gpu_argv(), None),
        "nvidia_smi_list": ([nvidia_smi.EXECUTABLE, "-L"], None),
        "nvidia_smi_query_apps": (nvidia_smi.query_apps_argv(), None),
        "probe": (node_target.probes_argv(python), probe_input(venv)),
        "probe_with_site": ([python, "-I", "-c", node_target.PROBES_MAIN], probe_input(venv)),
    }


def one_call(argv, stdin):
    cpu = children_cpu()
    started = time.monotonic()
    done = subprocess.run(argv, input=stdin, capture_output=True, check=False)
    return {"cpu": children_cpu() - cpu, "wall": time.monotonic() - started, "rc": done.returncode}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--wrap", default="", help="a command prefix that runs each piece elsewhere (a lab CT)")
    parser.add_argument("--python", default="python3", help="the interpreter the probe runs on")
    parser.add_argument("--venv", default="/opt/venvs/train", help="the venv the verify part reads")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    wrap = shlex.split(args.wrap)
    timed = pieces(args.python, args.venv)
    calls = {name: [] for name in timed}
    for argv, stdin in timed.values():  # warm-up: page cache, bytecode; not counted
        one_call(wrap + argv, stdin)
    for _ in range(args.runs):
        for name, (argv, stdin) in timed.items():
            calls[name].append(one_call(wrap + argv, stdin))
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "host": os.uname().nodename,
        "cpus": os.cpu_count(),
        "runs": args.runs,
        "wrap": args.wrap,
        "python": args.python,
        "venv": args.venv,
        "pieces": {
            name: {
                "argv": timed[name][0],
                "cpu_ms": round(statistics.median(c["cpu"] for c in found) * 1000, 1),
                "wall_ms": round(statistics.median(c["wall"] for c in found) * 1000, 1),
                "exit_codes": sorted({c["rc"] for c in found}),
            }
            for name, found in calls.items()
        },
    }
    text = json.dumps(results, indent=1) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    for name, piece in results["pieces"].items():
        print(f"{name:24} cpu {piece['cpu_ms']:7.1f} ms  wall {piece['wall_ms']:7.1f} ms  exit {piece['exit_codes']}")


if __name__ == "__main__":
    main()
