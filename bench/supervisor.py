#!/usr/bin/env python3
"""A parent that restarts its worker, named like no launcher: the generic supervisor of issue 19.

    python3 bench/supervisor.py --delay 2 -- python3 bench/cuda_holder.py --gib 8
    python3 bench/supervisor.py --never -- python3 bench/cuda_holder.py --gib 8     # starts it once, never again

Starts the command as its child; when the child exits, waits --delay seconds and starts it again (a home-made retry
loop, supervisord's program, a Jupyter server's kernel restarter, a Ray-style parent), or with --never stays alive
and starts nothing (a Jupyter server whose kernel died). Prints `start <pid> <unix time>` for every child and
`exit <pid> <code> <unix time>` for every exit, flushed, so a log shows what restarted when.
"""

import argparse
import signal
import subprocess
import sys
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay", type=float, default=2.0, help="seconds between a child's exit and the next start")
    parser.add_argument("--never", action="store_true", help="start the command once and never again")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to supervise after --")
    while True:
        child = subprocess.Popen(command)
        print(f"start {child.pid} {time.time():.3f}", flush=True)
        code = child.wait()
        print(f"exit {child.pid} {code} {time.time():.3f}", flush=True)
        if args.never:
            while True:
                signal.pause()
        time.sleep(args.delay)


if __name__ == "__main__":
    sys.exit(main())
