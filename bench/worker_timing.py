#!/usr/bin/env python3
"""How long a restart takes to show, on the machine it runs on (issue 19's settle window is sized from this).

    python3 bench/worker_timing.py --runs 5 > timing.json

For each run, from the moment the process is started (just before fork/exec):

- a CUDA worker (python3, `import torch`, CUDA init, a 1 GiB allocation): when it has `/dev/nvidia*` open (what
  the step's device-file watch sees, polled every 10 ms in /proc/<pid>/fd), when NVML lists it
  (`nvidia-smi --query-compute-apps`), and the worker's own clock: interpreter up, torch imported, memory
  allocated;
- a python supervisor (bench/supervisor.py --delay 0): when its first child appears in /proc (what the step's child
  watch sees), and, after that child is killed, when the next one appears (the restart latency of a supervisor
  that does not wait).

Prints one JSON object: every run and the median of each figure, in seconds.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

WORKER = r"""
import json, os, sys, time
t = {"up": time.time()}
import torch
t["imported"] = time.time()
x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
t["allocated"] = time.time()
print(json.dumps(t), flush=True)
time.sleep(600)
"""
NVIDIA_MAJOR = 195


def has_nvidia_fd(pid):
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            info = os.stat(f"/proc/{pid}/fd/{fd}")
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (info.st_rdev and os.major(info.st_rdev) == NVIDIA_MAJOR) or target.startswith("/dev/nvidia"):
            return True
    return False


def nvml_lists(pid):
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    ).stdout
    return str(pid) in out.split()


def children(pid):
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                text = handle.read()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()
        if fields[0] not in "ZX" and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def wait(predicate, deadline, step=0.01, process=None):
    while time.time() < deadline and (process is None or process.poll() is None):
        value = predicate()
        if value:
            return value, time.time()
        time.sleep(step)
    return None, None


def cuda_worker():
    started = time.time()
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True)
    try:
        _, device = wait(lambda: has_nvidia_fd(worker.pid), started + 120, process=worker)
        _, listed = wait(lambda: nvml_lists(worker.pid), started + 120, step=0.05, process=worker)
        own = json.loads(worker.stdout.readline() or "{}")
    finally:
        worker.kill()
        worker.wait()
    rel = {k: round(v - started, 3) for k, v in own.items()}
    return {
        "device_files_open": round(device - started, 3) if device else None,
        "nvml_lists_it": round(listed - started, 3) if listed else None,
        "interpreter_up": rel.get("up"),
        "torch_imported": rel.get("imported"),
        "allocated": rel.get("allocated"),
    }


def supervisor():
    here = os.path.dirname(os.path.abspath(__file__))
    started = time.time()
    parent = subprocess.Popen(
        [sys.executable, os.path.join(here, "supervisor.py"), "--delay", "0", "--", "sleep", "600"],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        first, seen = wait(lambda: children(parent.pid), started + 30, step=0.005)
        killed = time.time()
        os.kill(first[0], signal.SIGKILL)
        _, again = wait(lambda: [c for c in children(parent.pid) if c != first[0]], killed + 30, step=0.005)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
    return {
        "first_child": round(seen - started, 3) if seen else None,
        "restart_after_kill": round(again - killed, 3) if again else None,
    }


def median(runs, key):
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    workers = [cuda_worker() for _ in range(args.runs)]
    supervisors = [supervisor() for _ in range(args.runs)]
    result = {
        "what": "seconds from a process's start (fork/exec) to each event",
        "cuda_worker": {"runs": workers, "median": {k: median(workers, k) for k in workers[0]}},
        "supervisor": {"runs": supervisors, "median": {k: median(supervisors, k) for k in supervisors[0]}},
    }
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
