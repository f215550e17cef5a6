#!/usr/bin/env python3
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Benchmark (not a test): what the venv step's hashed lock costs a fleet's fact pass, at the seeds' size.

    /usr/bin/python3 tests/lab/fleet.py create --nodes 4 --cts-per-node 16 --gpus-per-node 16
    .venv/bin/python bench/fleet_lock.py [--runs 3] [--size 64] [--delay 0.3] [--out FILE.json]

With the venv step on (``training_venv_lock_file``), every target's fact pass carries the lock text: to its node's
module execution (once per target of the node's batch), where the step reads it for each target, and back in each
target's ``invocation``. This runs recover.yml's fact pass alone (its tasks up to the fact pass, in check mode, so
the fleet's CTs, which have no venv, are only read) over the first ``--size`` CTs of the fleet, interleaved: with
a lock of the seeds' size (90 pins of 16 hashes each, about 126 KB, the size ``uv pip compile --generate-hashes``
gives for torch 2.11.0 with transformers, datasets, safetensors, wandb and boto3) and with a lock of one pin. The
difference is what carrying the lock costs. Per run: wall seconds, the controller's CPU seconds and the node
side's (as bench/fleet.py measures them) and each module execution's own CPU seconds and its children's (the
``pct exec`` it ran), from ``getrusage`` when it exits (the lab's nodes run their modules through a python that
notes it: ``ansible_python_interpreter``, with the bytes it carried: its AnsiballZ payload, options and all, in
and its JSON result out); medians of ``--runs``. The whole-run figures of this 2-core machine
vary by a third between identical runs; the module's own CPU is the steady one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fleet import FLEET, ROOT, cpu_seconds, machine_cpu_seconds  # bench/fleet.py, beside this script

BIN = Path(sys.executable).parent
PINS, HASHES = 90, 16
# The node's python for the modules: runs the module (AnsiballZ, on stdin) and notes its CPU when it exits.
NOTING_PYTHON = """#!/usr/bin/python3
import atexit, json, resource, sys
class Counting:
    def __init__(self, stream):
        self.stream, self.written = stream, 0
    def write(self, text):
        self.written += len(text.encode("utf-8", "surrogateescape"))
        return self.stream.write(text)
    def __getattr__(self, name):
        return getattr(self.stream, name)
def note():
    mine, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(NOTES, "a") as notes:
        cpu = [mine.ru_utime + mine.ru_stime, children.ru_utime + children.ru_stime]
        notes.write(json.dumps([*cpu, len(payload), sys.stdout.written]) + "\\n")
atexit.register(note)
payload = sys.stdin.buffer.read()
sys.stdout = Counting(sys.stdout)
exec(compile(payload, "ansiballz", "exec"), {"__name__": "__main__", "__file__": "ansiballz"})
"""
# recover.yml's tasks up to its fact pass: the steps' settings and the pass; nothing after it runs.
FACT_PASS_END = "    # A target with nothing to do ends here"  # noqa: S105 (a line of recover.yml, no secret)


def seeds_size_lock():
    """A hashed requirements lock of the seeds' size: PINS pins, HASHES ``--hash`` lines each (synthetic names)."""
    lines = ["--index-url https://pypi.org/simple", "--extra-index-url https://download.pytorch.org/whl/cu128", ""]
    for pin in range(PINS):
        name = f"package-{pin:02d}"
        lines.append(f"{name}==1.{pin}.0 \\")
        hashes = [hashlib.sha256(f"{name}-{n}".encode()).hexdigest() for n in range(HASHES)]
        lines += [f"    --hash=sha256:{h} \\" for h in hashes[:-1]] + [f"    --hash=sha256:{hashes[-1]}"]
        lines.append("    # via train")
    return "\n".join(lines) + "\n"


def one_run(playbook, inventory, lock, workdir):
    control = tempfile.mkdtemp(prefix="cp-", dir=workdir)
    notes = workdir / "module-cpu.jsonl"
    notes.write_text("")
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        ANSIBLE_SSH_CONTROL_PATH_DIR=control,
        PVE_GPU_RECOVER_REPORT_DIR=str(workdir / "reports"),
    )
    command = [str(BIN / "ansible-playbook"), "-i", str(inventory), "--forks", "64", str(playbook), "--check"]
    command += ["-e", f"training_venv_lock_file={lock}", "-e", f"ansible_python_interpreter={workdir / 'python'}"]
    cpu, machine, started = cpu_seconds(), machine_cpu_seconds(), time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    seconds, cpu, machine = time.monotonic() - started, cpu_seconds() - cpu, machine_cpu_seconds() - machine
    for socket in Path(control).iterdir():  # no connection survives into the next run
        subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={socket}", "x"], capture_output=True, check=False)
    if done.returncode != 0:
        sys.exit(f"bench: the fact pass failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    modules = [json.loads(line) for line in notes.read_text().splitlines()]
    return {
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu, 3),
        "node_cpu_seconds": round(machine - cpu, 3),
        "module_executions": len(modules),
        "module_cpu_seconds": round(statistics.median(m[0] for m in modules), 3),
        "module_children_cpu_seconds": round(statistics.median(m[1] for m in modules), 3),
        # What one module execution carried: the AnsiballZ payload with its options in, its JSON result out.
        "module_input_bytes": round(statistics.median(m[2] for m in modules)),
        "module_output_bytes": round(statistics.median(m[3] for m in modules)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--delay", type=float, default=0.3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = {"seeds_size_lock": [], "one_pin_lock": []}
    with tempfile.TemporaryDirectory(prefix="pgr-lock-bench-") as tmp:
        workdir = Path(tmp)
        recover = (ROOT / "playbooks/recover.yml").read_text()
        playbook = ROOT / "playbooks" / f".bench-fact-pass-{os.getpid()}.yml"  # beside recover.yml: same roles
        locks = {"seeds_size_lock": workdir / "seeds.lock", "one_pin_lock": workdir / "one.lock"}
        locks["seeds_size_lock"].write_text(seeds_size_lock())
        locks["one_pin_lock"].write_text("six==1.17.0 \\\n    --hash=sha256:" + "a" * 64 + "\n")
        python = workdir / "python"
        python.write_text(NOTING_PYTHON.replace("NOTES", repr(str(workdir / "module-cpu.jsonl"))))
        python.chmod(0o755)
        inventory = workdir / "inventory.yml"
        subprocess.run([*FLEET, "inventory", "--size", str(args.size), "--out", str(inventory)], check=True)
        subprocess.run([*FLEET, "pct-delay", str(args.delay)], check=True)
        try:
            playbook.write_text(recover[: recover.index(FACT_PASS_END)])
            for lock in locks.values():  # warm-up, not counted
                one_run(playbook, inventory, lock, workdir)
            for _ in range(args.runs):
                for name, lock in locks.items():
                    runs[name].append(one_run(playbook, inventory, lock, workdir))
        finally:
            playbook.unlink(missing_ok=True)
            shutil.rmtree(workdir / "reports", ignore_errors=True)
            subprocess.run([*FLEET, "pct-delay", "0"], check=False)
        lock_bytes = locks["seeds_size_lock"].stat().st_size
    medians = {name: {k: statistics.median(r[k] for r in found) for k in found[0]} for name, found in runs.items()}
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "size": args.size,
        "pct_delay": args.delay,
        "lock_bytes": lock_bytes,
        "medians": medians,
        "runs": runs,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    for name, median in medians.items():
        print(f"{name:16} {median}")


if __name__ == "__main__":
    main()
