#!/usr/bin/env python3
"""How long the NVIDIA driver takes to free a dead process's GPU memory: the floor under gpu_processes.

    python3 bench/gpu_free_latency.py --repeat 3 --gib 20 [--poll 0.02] > result.json

For each signal (SIGTERM to a normal holder, SIGKILL to one ignoring SIGTERM) and each repetition: start
bench/cuda_holder.py, wait until its memory shows in nvidia-smi, send the signal, and poll
`nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits` every POLL seconds until memory.used is
back at its idle value. Prints one JSON document with every measurement and the medians. Needs a GPU.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def used_mib(device):
    out = subprocess.run(
        ["nvidia-smi", f"--id={device}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out.strip())


def measure(signum, gib, device, poll, timeout=60):
    idle = used_mib(device)
    argv = [sys.executable, os.path.join(HERE, "cuda_holder.py"), "--gib", str(gib), "--device", str(device)]
    if signum == signal.SIGKILL:
        argv.append("--ignore-term")
    holder = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    if not holder.stdout.readline().startswith("held"):
        sys.exit(f"gpu_free_latency: the CUDA holder did not start (exit {holder.wait()})")
    busy = used_mib(device)
    sent = time.monotonic()
    holder.send_signal(signum)
    polls = 0
    while True:
        polls += 1
        now = used_mib(device)
        if now <= idle:
            freed = time.monotonic() - sent
            break
        if time.monotonic() - sent > timeout:
            freed = None
            break
        time.sleep(poll)
    holder.wait()
    return {
        "signal": signal.Signals(signum).name,
        "idle_mib": idle,
        "busy_mib": busy,
        "freed_after_s": freed,
        "polls": polls,
        "exit": holder.returncode,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gib", type=float, default=20)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--poll", type=float, default=0.02)
    args = parser.parse_args()
    runs = [
        measure(s, args.gib, args.device, args.poll)
        for _ in range(args.repeat)
        for s in (signal.SIGTERM, signal.SIGKILL)
    ]
    medians = {
        name: statistics.median(r["freed_after_s"] for r in runs if r["signal"] == name and r["freed_after_s"])
        for name in ("SIGTERM", "SIGKILL")
    }
    json.dump(
        {"runs": runs, "median_freed_after_s": medians, "poll_s": args.poll, "gib": args.gib}, sys.stdout, indent=1
    )
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
