#!/usr/bin/env python3
"""A real CUDA process holding GPU memory until it dies: the thing gpu_processes exists to end.

    python3 bench/cuda_holder.py --gib 20 [--device 0 [--device 1]] [--ignore-term]

Allocates and touches GIB GiB on each device with torch (plain cudaMalloc through the caching allocator), prints
`held <pid>` once the memory is in use, then waits for a signal. --ignore-term ignores SIGTERM, like a job stuck
in a signal-blocking section. Run on a machine with a GPU (the hardware runs of docs/hardware.md).
"""

import argparse
import os
import signal
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=20)
    parser.add_argument("--device", type=int, action="append")
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument(
        "--fork-child",
        action="store_true",
        help="after allocating, fork a child that inherits the GPU files (a DataLoader worker)",
    )
    args = parser.parse_args()
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch  # noqa: PLC0415  (5 s to import: only after the arguments are known to be fine)

    held = []
    for device in args.device or [0]:
        tensor = torch.empty(int(args.gib * 2**30), dtype=torch.uint8, device=f"cuda:{device}")
        tensor.fill_(1)
        held.append(tensor)
    torch.cuda.synchronize()
    if args.fork_child and os.fork() == 0:
        while True:  # the child never touches CUDA; it only keeps the inherited /dev/nvidia* descriptors open
            signal.pause()
    sys.stdout.write(f"held {os.getpid()}\n")
    sys.stdout.flush()
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
