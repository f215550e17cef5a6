#!/usr/bin/env python3
"""How fast a restarted CUDA worker shows itself: in the process table, and on the GPU (issue 19's settle window).

    python3 bench/worker_start_latency.py --runs 5 --out latency.json

For each run, on a machine with a GPU and torch:

* **exec -> first GPU allocation.** A worker (python + ``import torch`` + CUDA init + a 1 GiB tensor) is started;
  the times from its exec to its import done, to its allocation done (its own clock) and to its pid in
  ``nvidia-smi --query-compute-apps`` (polled every 50 ms) are recorded.
* **exec -> first child.** The worker forks a DataLoader-like child right after it allocates: the time from exec to
  that child in the process table.
* **a supervisor's restart.** A python supervisor restarts its worker ``--restart-delay`` s after it dies; the
  worker is SIGKILLed and the times from the kill to the supervisor's new child in /proc and to the new worker's
  GPU memory in ``nvidia-smi`` are recorded. The first is what a process-table watch sees; the second is what a
  watch of the GPU alone would wait for.

All clocks are CLOCK_MONOTONIC (shared by every process of the machine). Prints a JSON summary (min, median, max).
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
import os, sys, time, signal
t = {"start": time.monotonic()}
import torch
t["imported"] = time.monotonic()
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
t["allocated"] = time.monotonic()
if os.fork() == 0:
    signal.pause()
    os._exit(0)
print(__import__("json").dumps(t), flush=True)
signal.pause()
"""

SUPERVISOR = r"""
import subprocess, sys, time
delay = float(sys.argv[1])
while True:
    subprocess.run([sys.executable, "-c", sys.argv[2]], stdout=subprocess.DEVNULL)
    time.sleep(delay)
"""


def gpu_pids():
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True, check=False
    ).stdout
    return {int(line) for line in out.split() if line.strip().isdigit()}


def children(pid):
    """The pids whose parent is ``pid``, from /proc/<pid>/stat (the children file is not on every kernel)."""
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.add(int(name))
    return found


def wait_for(predicate, timeout=120, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return time.monotonic(), value
        time.sleep(interval)
    raise TimeoutError("nothing seen within the deadline")


def one_worker():
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True)
    try:
        first_child_at, _ = wait_for(lambda: children(proc.pid), interval=0.01)
        on_gpu_at, _ = wait_for(lambda: proc.pid in gpu_pids())
        own = json.loads(proc.stdout.readline())
        return {
            "exec_to_import_s": own["imported"] - started,
            "exec_to_allocated_s": own["allocated"] - started,
            "exec_to_first_child_s": first_child_at - started,
            "exec_to_nvidia_smi_s": on_gpu_at - started,
        }
    finally:
        for pid in children(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


def one_restart(delay):
    worker = "import torch, signal; x = torch.ones(1 << 30, dtype=torch.uint8, device='cuda'); signal.pause()"
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(delay), worker], start_new_session=True)
    try:
        _, first = wait_for(lambda: children(sup.pid))
        (worker_pid,) = first
        wait_for(lambda: worker_pid in gpu_pids())
        killed = time.monotonic()
        os.kill(worker_pid, signal.SIGKILL)
        child_at, _ = wait_for(lambda: children(sup.pid) - {worker_pid}, interval=0.01)
        gpu_at, _ = wait_for(lambda: (children(sup.pid) - {worker_pid}) & gpu_pids())
        return {"delay_s": delay, "kill_to_new_child_s": child_at - killed, "kill_to_gpu_s": gpu_at - killed}
    finally:
        os.killpg(sup.pid, signal.SIGKILL)
        sup.wait()


def summary(rows, key):
    values = [row[key] for row in rows]
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3), "max": round(max(values), 3)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--delays", type=float, nargs="*", default=[0, 2])
    parser.add_argument("--out")
    args = parser.parse_args()
    workers = [one_worker() for _ in range(args.runs)]
    restarts = [one_restart(delay) for delay in args.delays for _ in range(max(1, args.runs // 2))]
    result = {
        "workers": workers,
        "restarts": restarts,
        "summary": {
            **{key: summary(workers, key) for key in workers[0]},
            **{
                f"{key}@{delay:g}s": summary([r for r in restarts if r["delay_s"] == delay], key)
                for delay in args.delays
                for key in ("kill_to_new_child_s", "kill_to_gpu_s")
            },
        },
    }
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
