#!/usr/bin/env python3
"""GPU holder of the pve-gpu-recover lab: a real process that "holds" GPU memory until it dies.

    python3 gpu_holder.py --gpu INDEX|UUID [--gpu ...] --mib N [--ignore-term] [--name NAME]
                          [--fork-child] [--supervise [--max-restarts N] [--restart-delay S]]

It stands for a training process with a CUDA context (or a driver daemon) so that recovery code meets the same
evidence as on a real node:
  * the `nvidia-smi` stand-in lists it under --query-compute-apps with its HOST pid and counts its memory,
    as NVML does even when the process runs in a container;
  * it keeps file descriptors on /dev/nvidia<minor> of each held GPU, /dev/nvidiactl and /dev/nvidia-uvm
    (O_PATH, so no driver is needed to open them), so `fuser -v /dev/nvidia*` and /proc/*/fd scans find it;
  * SIGTERM kills it (default action) unless --ignore-term, SIGKILL always does; its memory is then free
    because the stand-in only counts holders whose process is alive, not a zombie, and has the registered
    start time: nothing to clean up, exactly like a CUDA context that dies with its process;
  * --name NAME makes it look like NAME in /proc/PID/comm (truncated to 15 chars by the kernel, e.g.
    nvidia-persistenced -> "nvidia-persiste") and as argv[0] in /proc/PID/cmdline, to pose as a daemon
    that recovery must not kill (nvidia-persistenced, nv-hostengine, nv-fabricmanager).

  * --fork-child: once it holds, it forks a child that inherits its GPU file descriptors (like a DataLoader
    worker) and pauses too; the child holds device files only (no memory of its own, NVML does not list it),
    so only a /proc/*/fd scan finds it, and it outlives its parent unless it is ended too;
  * --supervise: it becomes a launcher that holds nothing itself (torchrun's elastic agent, a `while true`
    loop): it starts the holder described by the other options as its child and starts it again, after
    --restart-delay seconds, whenever that child dies (at most --max-restarts times; default: for ever).
    --ignore-term makes the supervisor ignore SIGTERM too, and its workers inherit that; --name names the
    supervisor (e.g. torchrun), its workers run as the interpreter. A supervisor ended with its worker starts
    nothing more. It is registered like a holder without GPUs (`"supervisor": true`), so the lab's cleanup
    ends it, first, with the holders.

GPU indexes are those of the holder's own view (a container's GPU 0 may be the node's GPU 5). Like a CUDA
program, it fails (exit 1) when the driver is unusable in its view, the GPU is lost, or the memory is not free.
Once registered it prints exactly one line, `held <hostpid>`, and waits in signal.pause(). With --fork-child the
line is `held <hostpid> child <child hostpid>`; a supervisor prints its first worker's line followed by
` supervisor <its own hostpid>` (`held 516 supervisor 500`), and nothing for the workers it starts later. The
first word after `held` is always the pid of the process holding the GPU memory.

The view config is found through $PVE_GPU_LAB_CONFIG (tests may pass `--lab-config PATH` first instead).
"""

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import gpulab  # noqa: E402  (found next to this script, wherever the lab copied it)

PR_SET_NAME = 15
TASK_COMM_LEN = 16  # comm keeps 15 characters plus the terminating NUL


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_holder.py", description="Hold GPU memory in the lab until killed.")
    parser.add_argument("--lab-config", help=argparse.SUPPRESS)
    parser.add_argument("--gpu", action="append", required=True, help="view index or UUID; repeat for more GPUs")
    parser.add_argument("--mib", type=int, required=True, help="MiB held on each GPU")
    parser.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM (only SIGKILL ends it)")
    parser.add_argument("--name", help="process name in /proc/PID/comm and argv[0]")
    parser.add_argument("--fork-child", action="store_true", help="fork a child that inherits the GPU file descriptors")
    parser.add_argument(
        "--supervise", action="store_true", help="hold nothing; start the holder as a child, again when it dies"
    )
    parser.add_argument("--max-restarts", type=int, help="with --supervise: restarts at most (default: for ever)")
    parser.add_argument("--restart-delay", type=float, help="with --supervise: seconds before a restart (0.1)")
    args = parser.parse_args(argv)
    if args.mib < 0:
        parser.error("--mib must be >= 0")
    if not args.supervise and (args.max_restarts is not None or args.restart_delay is not None):
        parser.error("--max-restarts and --restart-delay need --supervise")
    args.max_restarts = -1 if args.max_restarts is None else args.max_restarts
    args.restart_delay = 0.1 if args.restart_delay is None else args.restart_delay
    if args.restart_delay < 0:
        parser.error("--restart-delay must be >= 0")
    return args


def worker_argv(script_args: list[str]) -> list[str]:
    """The holder a supervisor starts: its own arguments without the supervisor's (--supervise, --name...)."""
    own = {"--supervise": 0, "--name": 1, "--max-restarts": 1, "--restart-delay": 1}
    argv, words = [], iter(script_args)
    for word in words:
        name = word.split("=", 1)[0]
        if name in own:
            if own[name] and "=" not in word:
                next(words, None)
            continue
        argv.append(word)
    return argv


class Refused(Exception):
    """Why the holder cannot hold (message for stderr, exit code), like a CUDA program failing to start."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def take_name(name: str, script_args: list[str]) -> None:
    """Become `name`: re-exec the interpreter with argv[0]=name (cmdline), then set comm with PR_SET_NAME.

    The PID stays the same across exec, so a caller holding the Popen object keeps the right process. The
    re-exec happens only while argv[0] differs, which ends the recursion.
    """
    argv0 = Path("/proc/self/cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
    if argv0 != name:
        interpreter = str(Path("/proc/self/exe").readlink())
        # Python locates its stdlib from argv[0]; a bare NAME is not on PATH, so say where home is.
        home = (
            sys.base_prefix if sys.base_prefix == sys.base_exec_prefix else f"{sys.base_prefix}:{sys.base_exec_prefix}"
        )
        env = {**os.environ, "PYTHONHOME": os.environ.get("PYTHONHOME", home)}
        os.execve(interpreter, [name, str(Path(__file__).resolve()), *script_args], env)  # noqa: S606
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(name.encode()[: TASK_COMM_LEN - 1])
    if libc.prctl(PR_SET_NAME, buf, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NAME) failed")


def claim(view_cfg: dict, wanted: list[str], mib: int) -> list[gpulab.GpuView]:
    """The view's GPUs named by index or UUID, once the driver is usable there and `mib` MiB are free on each."""
    failure = gpulab.driver_check(view_cfg)
    if failure:
        # What CUDA's cuInit reports when nvidia-smi would fail the same way.
        raise Refused(f"CUDA driver initialization failed: {failure[1].splitlines()[0]}")
    snap = gpulab.snapshot(view_cfg)
    if (snap.fault or {}).get("mode") == "no_permission":
        raise Refused("CUDA driver initialization failed: insufficient permissions")
    gpus = []
    for ident in wanted:
        match = [g for g in snap.gpus if str(g.index) == ident or g.gpu["uuid"].lower() == ident.lower()]
        if not match:
            raise Refused(f"no GPU {ident!r} in view {snap.view!r} ({len(snap.gpus)} GPUs)", 2)
        g = match[0]
        if g.lost:
            raise Refused(f"GPU {g.gpu['pci.bus_id']} is lost: unspecified launch failure")
        if mib > g.free_mib:
            raise Refused(f"CUDA out of memory on GPU {g.index}: tried to hold {mib} MiB, {g.free_mib} MiB free")
        if g not in gpus:
            gpus.append(g)
    return gpus


def open_device_files(gpus: list[gpulab.GpuView], dev_dir: str = "/dev") -> list[int]:
    """O_PATH descriptors on the device nodes a CUDA process keeps open; missing nodes are skipped.

    O_PATH never calls the driver's open(), so this works without a driver and without device cgroup access.
    """
    names = ["nvidiactl", "nvidia-uvm", *(f"nvidia{g.minor}" for g in gpus)]
    fds = []
    for name in names:
        try:
            fds.append(os.open(Path(dev_dir) / name, os.O_PATH))
        except FileNotFoundError:
            continue
    return fds


def fork_child(proc_root) -> int:
    """Fork a child that keeps every descriptor (the GPU files among them) and pauses; return its host pid."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: say where it is, then hold on to what it inherited
        os.close(read_end)
        # Not the caller's pipes: whoever reads the holder's output to its end must not wait for this child too.
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        try:
            os.write(write_end, f"{gpulab.find_host_pid(proc_root)}\n".encode())
        except (OSError, LookupError):
            os._exit(2)
        os.close(write_end)
        while True:
            signal.pause()
    os.close(write_end)
    with os.fdopen(read_end) as answer:
        line = answer.readline()
    if not line.strip().isdigit():
        os.waitpid(pid, 0)
        raise LookupError("the forked child could not find its host pid")
    return int(line)


def supervise(args: argparse.Namespace, script_args: list[str]) -> int:
    """Start the holder as a child, and again whenever it dies: a launcher that restarts its worker.

    Prints the first worker's `held ...` line with ` supervisor <own host pid>` appended; returns when a worker
    could not start the first time (its exit code), or after --max-restarts restarts.
    """
    try:
        view_cfg = gpulab.load_view_config(args.lab_config)
        host_pid = gpulab.find_host_pid(view_cfg["proc_root"])
        stat = gpulab.read_proc_stat(view_cfg["proc_root"], host_pid)
        if stat is None:
            raise LookupError(f"pid {host_pid} is not in {view_cfg['proc_root']}")
    except (OSError, ValueError, LookupError) as exc:
        sys.stderr.write(f"gpu_holder: cannot read the lab state: {exc}\n")
        return 2
    # Registered without GPUs (NVML does not list it, it holds no memory) so that whatever ends the lab's holders
    # (labctl kill_holders, oldest first) ends the supervisor before its workers, and nothing is started again.
    gpulab.register_holder(
        view_cfg["state_dir"], host_pid, stat[1], {}, view=view_cfg["view"], ns_pid=os.getpid(), supervisor=True
    )
    # After --name re-executed it as NAME, sys.executable (found from argv[0]) no longer says where it is.
    interpreter = sys.executable if not args.name and sys.executable else str(Path("/proc/self/exe").readlink())
    worker = [interpreter, str(Path(__file__).resolve()), *worker_argv(script_args)]
    restarts, announced = 0, False
    while True:
        proc = subprocess.Popen(worker, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()  # read every worker's line: one left unread would fail it with EPIPE
        proc.stdout.close()
        if not announced:
            if not line.startswith("held "):
                return proc.wait() or 1
            sys.stdout.write(f"{line.strip()} supervisor {host_pid}\n")
            sys.stdout.flush()
            announced = True
        code = proc.wait()
        if 0 <= args.max_restarts <= restarts:
            return code if code > 0 else 0
        restarts += 1
        time.sleep(args.restart_delay)


def main(argv: list[str] | None = None) -> int:
    script_args = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(script_args)
    if args.name:
        take_name(args.name, script_args)
    # Before anything can be observed: a caller that sees "held" may signal at once. A supervisor's workers
    # inherit an ignored SIGTERM.
    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.ignore_term else signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if args.supervise:
        return supervise(args, script_args)
    try:
        view_cfg = gpulab.load_view_config(args.lab_config)
        gpus = claim(view_cfg, args.gpu, args.mib)
        host_pid = gpulab.find_host_pid(view_cfg["proc_root"])
        stat = gpulab.read_proc_stat(view_cfg["proc_root"], host_pid)
        if stat is None:
            raise LookupError(f"pid {host_pid} is not in {view_cfg['proc_root']}")
    except (OSError, ValueError, LookupError) as exc:
        sys.stderr.write(f"gpu_holder: cannot read the lab state: {exc}\n")
        return 2
    except Refused as exc:
        sys.stderr.write(f"gpu_holder: {exc}\n")
        return exc.code
    fds = open_device_files(gpus, view_cfg.get("dev_dir") or "/dev")
    gpulab.register_holder(
        view_cfg["state_dir"],
        host_pid,
        stat[1],  # start time: a later process reusing the pid is not this holder
        # --mib 0: device files open but no compute context, like nvidia-persistenced: NVML does not list it.
        {g.gpu["uuid"]: args.mib for g in gpus} if args.mib else {},
        view=view_cfg["view"],
        ns_pid=os.getpid(),
        device_fds=len(fds),
    )
    child = ""
    if args.fork_child:
        try:
            child = f" child {fork_child(view_cfg['proc_root'])}"
        except (OSError, LookupError) as exc:
            sys.stderr.write(f"gpu_holder: cannot fork the child: {exc}\n")
            return 2
    sys.stdout.write(f"held {host_pid}{child}\n")
    sys.stdout.flush()
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
