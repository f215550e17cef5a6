#!/usr/bin/env python3
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Benchmark (not a test): a converged recover.yml and the check-mode drift run over fleets of 1, 16 and 64 CTs.

    /usr/bin/python3 tests/lab/fleet.py create --nodes 4 --cts-per-node 16 --gpus-per-node 16
    .venv/bin/python bench/fleet.py --runs 3 --delays 0,0.3,1.0 --sizes 1,16,64 --forks 64 \\
        --out docs/benchmarks/fleet-YYYY-MM-DD.json

For each pct cost in ``--delays`` (``fleet.py pct-delay``: every node's ``pct`` sleeps that long per call, like a
real node's Perl ``pct``) and each size N in ``--sizes`` (the first N CTs of the fleet, round-robin over its nodes:
``fleet.py inventory --size N``), it runs, interleaved in one loop (the order rotates each round, after one
warm-up run of each that is not counted):

* ``recover``: ``ansible-playbook recover.yml --forks F`` on the converged fleet;
* ``drift``: ``drift/runner.py --forks F``, recover.yml ``--check --diff`` through ansible-runner, as the timer runs it.
* ``recover-per-ct``: ``recover`` with ``-e preflight_per_node=false``: each CT read in a module execution of its
  own, as before 2.1.0.

``--kinds`` runs some of them only. ``--baseline PATH`` names another checkout of this repository (``git worktree add
/tmp/base v2.4.0``): each kind also runs from there, interleaved with this checkout's in the same loop, as
``<kind>@baseline``, so that a change is measured against what it replaces on the same machine at the same time.

Each run starts cold (a fresh ssh ControlPath directory). Per run it measures the wall time, new ssh connections
(the ``Accepted`` lines of every node's sshd log), ssh sessions (bench/ssh-counting; each is one module execution
on a node, ssh being pipelined), ``pct exec`` calls (every node's pct call log), remote tasks (from the run's
reports: the steps' tasks that ran, one per target even where targets share an execution) and the controller's
CPU seconds (user + system of the run and every descendant it waited for: ``getrusage
(RUSAGE_CHILDREN)`` before and after) and the node side's (the whole machine's busy CPU seconds from
``/proc/stat`` less the controller's: the lab's nodes, their sshd, modules, ``pct`` and the CTs' probes share this
machine; the ssh masters, which leave the run's process tree, count there too), and of the node side what ran
inside the CTs (their cgroups: each read's probe, its ``nvidia-smi``, ``timeout``/``env``). Every run must find the
fleet converged (recover: each target's report ``ok`` with nothing pending; drift: exit 0, every target in spec), or
the benchmark stops: figures of a run that did work would mean something else. It prints a markdown table of the
medians with each figure's ratio to the smallest size, and writes every run as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from converged import count_lines  # bench/converged.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
FLEET = ["/usr/bin/python3", str(ROOT / "tests/lab/fleet.py")]
FLEET_DIR = Path(os.environ.get("PVE_GPU_FLEET_DIR", "/var/lib/pve-gpu-recover-fleet"))
BIN = Path(sys.executable).parent
# recover-per-ct: recover.yml with each CT read in an execution of its own (preflight_per_node=false), the way
# every run read them before 2.1.0, measured in the same loop so the ratio between the two is this run's.
KINDS = ("recover", "drift", "recover-per-ct")
# Each recover kind's extra options.
RECOVER_KINDS = {
    "recover": [],
    "recover-per-ct": ["-e", "preflight_per_node=false"],
}
METRICS = (
    "seconds",
    "cpu_seconds",
    "node_cpu_seconds",
    "ct_cpu_seconds",
    "ssh_connections",
    "ssh_invocations",
    "pct_exec",
    "remote_tasks",
)
RUN_TIMEOUT = 900  # seconds: a 64-CT run at a 1 s pct takes about a minute


def pct_execs(lab_dir):
    try:
        with open(Path(lab_dir) / "pct-calls.log", encoding="utf-8") as handle:
            return sum(1 for line in handle if json.loads(line)["argv"][:1] == ["exec"])
    except FileNotFoundError:
        return 0


def node_counters(nodes):
    """What every node has counted so far: sshd connections and pct exec calls, summed over the fleet."""
    return {
        "ssh_connections": sum(count_lines(Path(n["lab_dir"]) / "ssh/sshd.log", "Accepted") for n in nodes),
        "pct_exec": sum(pct_execs(n["lab_dir"]) for n in nodes),
    }


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def machine_cpu_seconds(stat="/proc/stat"):
    """CPU seconds this machine has been busy (every process: user, nice, system, irq, softirq, steal)."""
    with open(stat, encoding="ascii") as handle:
        fields = [int(v) for v in handle.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def containers_cpu_seconds(nodes, roots=("/sys/fs/cgroup/unified/lxc", "/sys/fs/cgroup/lxc")):
    """CPU seconds spent so far inside the fleet's CTs, from their cgroups (``lxc/<vmid>``, cgroup v2, beside v1 or
    alone): what each CT's read runs in it, its probe, the probe's ``nvidia-smi`` and ``timeout``/``env``. The
    benchmark stops where a CT has no such cgroup: a figure without some CTs would be wrong, not missing."""
    vmids = [vmid for node in nodes for vmid in node["cts"]]
    root = next((r for r in roots if os.path.isfile(os.path.join(r, str(vmids[0]), "cpu.stat"))), None)
    total = 0
    for vmid in vmids:
        path = os.path.join(root or roots[0], str(vmid), "cpu.stat")
        try:
            with open(path, encoding="ascii") as handle:
                total += int(dict(line.split() for line in handle)["usage_usec"])
        except (OSError, KeyError, ValueError) as error:
            sys.exit(f"bench: no CPU usage for CT {vmid} in its cgroup ({path}: {error}); is the fleet running?")
    return total / 1e6


def remote_tasks(reports):
    """Remote tasks that ran (not skipped), from the recover_report reports: one per converged target, also where
    targets of one node shared a module execution (those are the ssh sessions)."""
    return sum(
        1 for report in reports for task in report.get("tasks", []) if task["remote"] and task["status"] != "skipped"
    )


def tree_of(kind, baseline):
    """``(kind without its tree, the checkout it runs from)``: ``recover@baseline`` runs from ``baseline``."""
    name, _, tree = kind.partition("@")
    return name, (baseline if tree else ROOT)


def command_for(kind, inventory, forks, workdir, reports, *, root=ROOT):
    if kind in RECOVER_KINDS:
        return [
            *(str(BIN / "ansible-playbook"), "-i", str(inventory), "--forks", str(forks), *RECOVER_KINDS[kind]),
            str(root / "recover.yml"),
        ]
    return [
        sys.executable,
        str(root / "drift/runner.py"),
        *("--inventory", str(inventory), "--forks", str(forks), "--timeout", str(RUN_TIMEOUT)),
        *("--summary", str(workdir / "summary.json"), "--reports-dir", str(reports), "--keep-runs", "1"),
    ]


def converged_reports(kind, size, done, workdir, reports):
    """The run's reports, after checking that it found every target converged (else the benchmark stops)."""
    tail = f"\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    if kind in RECOVER_KINDS:
        found = [json.loads(p.read_text()) for p in sorted(reports.glob("*/*.json"))]
        busy = [r["target"] for r in found if r["status"] != "ok" or (r.get("before") or {}).get("pending")]
        if done.returncode != 0 or len(found) != size or busy:
            sys.exit(f"bench: recover.yml on {size} CTs did not find them converged (exit {done.returncode}, "
                     f"{len(found)} reports, not converged: {busy}){tail}")  # fmt: skip
        return found
    summary = json.loads((workdir / "summary.json").read_text()) if (workdir / "summary.json").exists() else {}
    targets = summary.get("targets") or {}
    if done.returncode != 0 or len(targets) != size:
        sys.exit(f"bench: the drift run on {size} CTs was not in spec (exit {done.returncode}, "
                 f"{summary.get('counts')}){tail}")  # fmt: skip
    return [json.loads(Path(t["report"]).read_text()) for t in targets.values()]


def run_once(kind, size, inventory, *, forks, nodes, workdir, baseline=None):
    """One cold run of ``kind`` on the first ``size`` CTs: wall and CPU seconds and what it cost in round trips."""
    kind, root = tree_of(kind, baseline)
    ssh_log = workdir / "ssh.log"
    ssh_log.write_text("")
    reports = workdir / "reports"
    shutil.rmtree(reports, ignore_errors=True)
    (workdir / "summary.json").unlink(missing_ok=True)
    control = tempfile.mkdtemp(prefix="cp-", dir=workdir)
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(root / "ansible.cfg"),
        ANSIBLE_SSH_EXECUTABLE=str(ROOT / "bench/ssh-counting"),
        ANSIBLE_SSH_CONTROL_PATH_DIR=control,
        PVE_GPU_RECOVER_REPORT_DIR=str(reports),  # recover.yml's; the drift runner sets its own under --reports-dir
        BENCH_SSH_LOG=str(ssh_log),
    )
    before = node_counters(nodes)
    cpu = cpu_seconds()
    machine = machine_cpu_seconds()
    containers = containers_cpu_seconds(nodes)
    started = time.monotonic()
    done = subprocess.run(
        command_for(kind, inventory, forks, workdir, reports, root=root),
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=RUN_TIMEOUT + 60,
    )
    seconds = time.monotonic() - started
    cpu = cpu_seconds() - cpu
    machine = machine_cpu_seconds() - machine
    containers = containers_cpu_seconds(nodes) - containers
    after = node_counters(nodes)
    # End the run's ssh masters now, so no connection is reused and no close is billed to the next run.
    for socket in Path(control).iterdir():
        subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={socket}", "x"], capture_output=True, check=False)
    found = converged_reports(kind, size, done, workdir, reports)
    return {
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu, 3),
        # The node side: what the machine burnt beyond the controller (the nodes' sshd, modules, pct, the CTs'
        # probes); the lab's nodes share this machine, so it is their sum.
        "node_cpu_seconds": round(max(machine - cpu, 0.0), 3),
        # Of the node side, what ran inside the CTs (the probes and their nvidia-smi); the rest is the nodes' own:
        # sshd, the modules, pct and lxc-attach.
        "ct_cpu_seconds": round(containers, 3),
        "ssh_connections": after["ssh_connections"] - before["ssh_connections"],
        "ssh_invocations": count_lines(ssh_log),
        "pct_exec": after["pct_exec"] - before["pct_exec"],
        "remote_tasks": remote_tasks(found),
    }


def summarize(runs, sizes):
    """Medians per kind and size, and each median's ratio to the smallest size's."""
    medians, ratios = {}, {}
    base = min(sizes)
    for kind in runs:
        medians[kind] = {
            str(size): {key: statistics.median(r[key] for r in runs[kind][str(size)]) for key in METRICS}
            for size in sizes
        }
        first = medians[kind][str(base)]
        ratios[kind] = {
            str(size): {
                key: round(medians[kind][str(size)][key] / first[key], 2) if first[key] else None for key in METRICS
            }
            for size in sizes
        }
    return {"medians": medians, f"ratios_to_{base}": ratios}


def ratio_text(value, ratio):
    shown = f"{value:.2f}" if isinstance(value, float) and not value.is_integer() else f"{value:g}"
    return shown if ratio is None else f"{shown} ({ratio:.2f}x)"


def markdown(results):
    """The medians as one markdown table, each figure with its ratio to the smallest size."""
    base = min(results["sizes"])
    lines = [
        f"Medians of {results['runs_per_figure']} runs, forks {results['forks']}; in parentheses: the ratio to "
        f"{base} CT{'s' if base > 1 else ''}.",
        "",
        "| pct cost | run | CTs | wall s | controller CPU s | node CPU s | of it in the CTs | new ssh connections "
        "| ssh sessions (module executions) | `pct exec` | remote tasks | controller CPU s per CT "
        "| node CPU s per CT |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for delay, data in results["delays"].items():
        for kind in data["medians"]:
            for size in results["sizes"]:
                m = data["medians"][kind][str(size)]
                r = data[f"ratios_to_{base}"][kind][str(size)]
                cells = [ratio_text(m[key], r[key]) for key in METRICS]
                cells += [f"{m[key] / size:.3f}" for key in ("cpu_seconds", "node_cpu_seconds")]
                lines.append(f"| {delay} s | {kind} | {size} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--delays", default="0,0.3,1.0")
    parser.add_argument("--sizes", default="1,4,16")
    parser.add_argument("--forks", type=int, default=16)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"which of {', '.join(KINDS)} to run")
    parser.add_argument("--baseline", type=Path, help="another checkout whose kinds run interleaved with these")
    args = parser.parse_args()
    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    if args.baseline:
        if not (args.baseline / "recover.yml").is_file():
            parser.error(f"--baseline: {args.baseline} is not a checkout of this repository (no recover.yml)")
        kinds += [f"{kind}@baseline" for kind in kinds]
    if unknown := set(args.kinds.split(",")) - set(KINDS):
        parser.error(f"--kinds: unknown {', '.join(sorted(unknown))} (known: {', '.join(KINDS)})")
    sizes = [int(s) for s in args.sizes.split(",")]
    try:
        nodes = json.loads((FLEET_DIR / "fleet.json").read_text())["nodes"]
    except FileNotFoundError:
        sys.exit("bench: no fleet; run `/usr/bin/python3 tests/lab/fleet.py create --nodes 2 --cts-per-node 8` first")
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "runs_per_figure": args.runs,
        "forks": args.forks,
        "sizes": sizes,
        "fleet": [{"node": n["node"], "cts": sorted(int(v) for v in n["cts"])} for n in nodes],
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()},
        "baseline": str(args.baseline) if args.baseline else None,
        "delays": {},
    }
    pairs = [(kind, size) for size in sizes for kind in kinds]
    try:
        with tempfile.TemporaryDirectory(prefix="pgr-fleet-bench-") as tmp:
            workdir = Path(tmp)
            inventories = {}
            for size in sizes:
                inventories[size] = workdir / f"inventory-{size}.yml"
                subprocess.run([*FLEET, "inventory", "--size", str(size), "--out", str(inventories[size])], check=True)
            for delay in [float(d) for d in args.delays.split(",")]:
                subprocess.run([*FLEET, "pct-delay", str(delay)], check=True)
                runs = {kind: {str(size): [] for size in sizes} for kind in kinds}
                for kind, size in pairs:  # warm-up: file caches, python bytecode; not counted
                    run_once(kind, size, inventories[size], forks=args.forks, nodes=nodes, workdir=workdir,
                             baseline=args.baseline)  # fmt: skip
                for i in range(args.runs):
                    shift = i % len(pairs)
                    for kind, size in pairs[shift:] + pairs[:shift]:  # rotate so no figure always runs first
                        run = run_once(
                            kind, size, inventories[size], forks=args.forks, nodes=nodes, workdir=workdir,
                            baseline=args.baseline,
                        )  # fmt: skip
                        runs[kind][str(size)].append(run)
                results["delays"][f"{delay:g}"] = dict(summarize(runs, sizes), runs=runs)
                print(f"pct delay {delay:g} s done", file=sys.stderr, flush=True)
    finally:
        subprocess.run([*FLEET, "pct-delay", "0"], check=False)
    results["machine"]["load_average_at_end"] = os.getloadavg()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"written: {args.out}", file=sys.stderr)
    print(markdown(results))


if __name__ == "__main__":
    main()
