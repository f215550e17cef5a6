#!/usr/bin/python
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_processes
short_description: End every process holding a target's GPUs and wait until their memory is really free
description:
  - Finds every process of the target that holds its GPUs. NVML's compute processes on the target's GPUs are
    listed by HOST pid on the node and mapped to the target by C(/proc/<pid>/cgroup) (C(/lxc/<vmid>/)) and
    C(NSpid). Processes of the target holding C(/dev/nvidia*) are found too, by the devices of their open
    files, as C(fuser) does; NVML may not list those.
  - Never touches processes of other containers or of the node itself (for a CT target), nor protected
    daemons (I(protected)). When such a process holds memory on one of the target's GPUs, the GPUs cannot be
    freed, so the module fails before ending anything and names it. On a bare host, processes of containers
    (Docker, Podman, Kubernetes, containerd, systemd-nspawn, LXC/Incus; told by their cgroup) are not the host's
    own either. Processes matching I(keep_idle) (display servers, monitoring exporters) are left alone while they
    hold no GPU memory, only device files.
  - Ends the job, not only its workers. Each holder's parents are walked up (by host pid, on the node) while they
    belong to the same target; the walk stops at the target's init, at an interactive shell (a login shell, or a
    shell without C(-c) and script, above which is a person's session), at a session or service manager
    (sshd, tmux, screen, cron, systemd...) and at a protected process. The launchers among those parents
    (I(launchers), e.g. C(torchrun), C(python -m torch.distributed.run)) and the shells running the job
    (C(bash -c 'while true; do python train.py; done'), a script) are ended first, with the holders
    (I(end_launchers)).
  - A holder in a systemd service of its own (C(Restart=always) starts it again) cannot be ended by signals, so
    the module fails before ending anything, naming the service and the command that stops it (C(pct exec <vmid> --
    systemctl stop <unit>)). A service counts as the holder's own when its oldest process is the holder or one of
    its parents; a unit name that is not plain (C([A-Za-z0-9:_.@-]+.service)) is never put into a command.
  - Sends SIGTERM, waits up to I(grace) seconds for each process to exit, sends SIGKILL to the survivors, then
    polls C(memory.used) of the target's GPUs until every one is at or below I(memory_threshold_mib). It polls
    every I(poll_interval) seconds and never sleeps a fixed time.
  - Fails naming each process that survives SIGKILL and its state (C(D), uninterruptible sleep, means a GPU
    reset or a node reboot is needed). When memory stays used, it lists the holders again first; a new process
    (a restarted worker) is named with its parent, and only when no process holds the memory does it advise a
    GPU reset.
  - Never ends the run's own processes, whatever they match - the module and its parents, and the controller's
    ansible-playbook and its parents when it runs on this machine (I(controller_pid)); in bare mode with a local
    connection the module runs below ansible-playbook, so the shell and the session that started the run are its
    parents. A holder started from the shell that runs C(ansible-playbook) is ended; the walk up its parents
    stops at that shell, which is named in I(own_run) and as a warning (C(pid N (bash - '...') also runs this
    recover run - not ended)). A holder that is itself one of them blocks the module before anything is ended.
  - The parents of a holder's job that are not ended with it (neither launchers nor shells - a home-made
    supervisor, a Jupyter-like server) are named in I(parents) (C(may start workers again)). Once the memory is
    free, and only when such a parent is left running, the module watches I(settle) seconds for restarts - a new child of one of those parents (seen the moment
    it is forked, seconds before a CUDA worker opens the GPU) or a new holder of the target's GPUs. A parent that
    restarted is ended with its new child, like a launcher (attended, I(end_launchers)), and the watch starts
    again; with I(end_launchers=false) the module fails naming it and the fix; unattended it is left running and
    named in I(needs_window). A new holder nothing explains fails the module naming it, its parent and its
    systemd service.
  - Only the GPUs passed to the target count. For a CT they are the ones C(nvidia-smi) lists inside it, one
    C(pct exec); everything else happens on the node.
  - Unattended (I(unattended), the scheduled drift corrector) it never ends the training job that runs as
    expected, named by I(guard); with no I(guard) it ends no process at all (nothing tells a live job from a
    stray one) and names every holder in I(needs_window). A holder is guarded when it, or one of its parents in the same target, matches an
    entry of I(guard). A guarded holder, the launchers above it and any holder whose job shares a process with it
    are left running and named in I(needs_window), one sentence each, and the module does not fail because of them;
    unguarded holders are ended as usual. The memory wait then covers only the GPUs no guarded holder uses, and new
    workers of the guarded job during the wait or the I(settle) watch are no new holders.
  - Attended (the default) the guard changes nothing - the operator asked for recovery - but I(guarded) still
    names the holders it matches.
version_added: "0.1.0"
author: pve-gpu-recover contributors (@pve-gpu-recover)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - pve_gpu.recover.pve_target
  - pve_gpu.recover.pve_target.run_lock
  - pve_gpu.recover.pve_target.python
attributes:
  check_mode:
    support: full
    details: Lists what would be ended (I(processes), I(launchers)) and ends nothing; C(changed) is true exactly
      when a real run would end a process. Services and restarters that would make a run fail fail check mode too.
  diff_mode:
    support: full
    details: Before is one line per launcher and per process holding the target's GPUs, after is what would be
      left (nothing).
  platform:
    platforms: posix
options:
  state:
    description:
      - C(absent) ends every process of the target holding its GPUs.
    type: str
    choices: [absent]
    default: absent
  protected:
    description:
      - Processes never ended, matched (shell patterns) against C(/proc/<pid>/comm), argv[0] and its basename.
        comm is cut to 15 characters by the kernel; patterns are compared cut the same way.
    type: list
    elements: str
    default: [nvidia-persistenced, nv-hostengine, nv-fabricmanager, nvidia-fabricmanager, "dcgm*"]
  keep_idle:
    description:
      - Processes left alone while they hold no GPU memory (only C(/dev/nvidia*) files), matched like
        I(protected). With GPU memory they are ended like any other (unless protected).
    type: list
    elements: str
    default: [Xorg, X, Xwayland, gnome-shell, kwin_wayland, kwin_x11, sway, weston, mutter, nvidia_gpu_exporter,
      nvidia-gpu-exporter, node_exporter, prometheus-node-exporter, prometheus, telegraf, nvidia-smi]
  launchers:
    description:
      - Parents of a holder that start workers again when they die, ended first with the holders. Matched (shell
        patterns) against comm, argv[0] and its basename, and for a Python interpreter the module of C(-m) and
        the script's basename (C(python3 -m torch.distributed.run), C(python3 /usr/local/bin/torchrun)).
      - A shell running the job (C(-c) or a script) is a launcher too, whatever this list says.
    type: list
    elements: str
    default: [torchrun, torch.distributed.run, torch.distributed.launch, "torch.distributed.elastic*", accelerate,
      accelerate.commands.launch, deepspeed, "deepspeed.launcher*"]
  end_launchers:
    description:
      - End the launchers found among the holders' parents, before the holders (SIGTERM to all of them at once,
        launchers first, then SIGKILL after I(grace)).
      - With C(false) the module fails before ending anything when a holder has one, naming each with its pid
        and how to stop it.
    type: bool
    default: true
  settle:
    description:
      - Seconds to watch for restarts once the memory of the target's GPUs is free (polled every
        I(poll_interval)) - a new child of a parent left running (I(parents)), or a new holder of the GPUs.
        A restart is seen as a new child the moment it is forked, so the window must outlast how long a
        supervisor waits before it restarts a worker; a CUDA worker takes about 4 s from its exec to its GPU
        memory on an H200 (import torch, then CUDA init; docs/hardware.md), which is how long a worker started by
        something outside the job takes to show up as a holder. Only a run that leaves a parent of a holder
        running watches (nothing else could start a worker again); otherwise the step ends when the memory is
        free. 0 skips the watch.
    type: float
    default: 10
  controller_pid:
    description:
      - The pid of the controller's C(ansible-playbook) (the role passes C(PVE_GPU_RECOVER_CONTROLLER_PID), which
        the recover_report callback sets). When that pid names an C(ansible-playbook) on this machine (bare mode),
        it and its parents are never ended. A pid of a controller elsewhere names another program here and is
        ignored. The module's own parents are never ended either way.
    type: int
  grace:
    description:
      - Seconds a process gets to exit after SIGTERM before it gets SIGKILL.
    type: float
    default: 10
  kill_timeout:
    description:
      - Seconds a process gets to exit after SIGKILL before it counts as a survivor.
    type: float
    default: 10
  memory_timeout:
    description:
      - Seconds to wait, once every holder has exited, for the memory of the target's GPUs to be released.
    type: float
    default: 30
  memory_threshold_mib:
    description:
      - A GPU counts as free when its C(memory.used) is at or below this many MiB (an idle H200 shows 0 MiB).
    type: int
    default: 0
  poll_interval:
    description:
      - Seconds between two checks while waiting (one C(nvidia-smi --query-gpu) on the node takes about 25 ms).
    type: float
    default: 0.05
  unattended:
    description:
      - Run as the scheduled drift corrector does - leave the job that I(guard) names running and report it in
        I(needs_window) instead of ending it. Unguarded holders are still ended.
      - The role sets it from C(recover_unattended) (C(ansible-playbook recover.yml -e recover_unattended=true)).
    type: bool
    default: false
  guard:
    description:
      - The training job that runs as expected. Each entry is a dict with exactly one key, C(match) or C(pid_file).
      - C(match) - a Python regular expression searched (C(re.search)) in a process's command line, its argv
        joined with spaces (C(/proc/<pid>/cmdline), read on the node).
      - C(pid_file) - an absolute path INSIDE the target to a file holding the pid of the job's main process
        as the target numbers it (its pid namespace). It is read inside the target (one more C(pct exec) when the
        module runs with such an entry); a missing file names no process (its job does not run). In an unattended
        run a pid file that exists but cannot be read, or holds anything but one pid, fails the module before
        anything is ended.
      - A holder is guarded when it or one of its parents in the target (up to, not including, the target's init)
        matches. Only used to leave processes running when I(unattended) is true; I(guarded) names the matches
        either way.
    type: list
    elements: dict
    default: []
requirements:
  - Runs as root on the node (or the bare host); C(nvidia-smi) on the node and inside the CT.
seealso:
  - module: pve_gpu.recover.gpu_info
notes:
  - Processes are signalled from the node by host pid, after checking the pid still names the same process
    (its start time), so a pid reused in the meantime is never hit.
  - A supervisor that is neither a launcher nor a shell (a Python script of your own, a Ray or Jupyter-like
    parent) is not ended unless it restarts a worker during the I(settle) watch; add its name to I(launchers) so
    that a run ends it first. Session and service managers (sshd, tmux, systemd, supervisord...) stop the walk up
    a holder's parents and are never watched.
"""

EXAMPLES = r"""
- name: End every process holding CT 200's GPUs and wait until their memory is free
  pve_gpu.recover.gpu_processes:
    vmid: 200
    state: absent
  delegate_to: pve1
  register: cleanup

- name: Show what was ended and how long the GPUs took to be free
  ansible.builtin.debug:
    msg: "{{ cleanup.killed | length }} processes ended; GPUs free after {{ cleanup.seconds_to_free }} s"

- name: On a bare GPU host, keep a monitoring daemon alive too
  pve_gpu.recover.gpu_processes:
    protected: [nvidia-persistenced, nv-hostengine, "dcgm*", my-gpu-exporter]

- name: Refuse to end launchers (torchrun, loops); only report them
  pve_gpu.recover.gpu_processes:
    vmid: 200
    end_launchers: false
  delegate_to: pve1

- name: Unattended - end stray holders, but leave the training job (and its torchrun) running
  pve_gpu.recover.gpu_processes:
    vmid: 200
    unattended: true
    guard:
      - match: 'torchrun .*train\.py'
      - pid_file: /run/train/train.pid
  delegate_to: pve1
  register: cleanup

- name: Tell the drift corrector what needs a maintenance window
  ansible.builtin.debug:
    msg: "{{ cleanup.needs_window }}"
  when: cleanup.needs_window | length > 0
"""

RETURN = r"""
processes:
  description: Processes of the target that hold its GPUs (those ended, or that check mode would end).
  returned: always
  type: list
  elements: dict
  sample:
    - {pid: 516, ns_pid: 41, name: python3, owner: "ct:200", gpus: [0], memory_mib: 20998, found_by: [nvml, device]}
killed:
  description: What each ended process needed (empty in check mode).
  returned: always
  type: list
  elements: dict
  sample:
    - {pid: 516, name: python3, signal: SIGTERM, exited_after: 0.21}
    - {pid: 517, name: python3, signal: SIGKILL, exited_after: 10.06}
launchers:
  description: Parents of the holders that restart them (launchers, shells running the job), ended first (or that
    check mode would end), with why each counts (C(reason)) and the holder pids it is a parent of (C(restarts)).
  returned: always
  type: list
  elements: dict
  sample:
    - {pid: 500, ns_pid: 12, name: torchrun, owner: "ct:200", command: "/usr/bin/python3 /usr/local/bin/torchrun
        --nproc-per-node 8 train.py", reason: "a launcher (matches 'torchrun')", restarts: [516]}
protected:
  description: Protected and I(keep_idle) processes found holding the target's GPUs without GPU memory; left alone.
  returned: always
  type: list
  elements: dict
guarded:
  description:
    - The target's holders that I(guard) names (they or a parent of theirs match), each with its C(command)
      (shortened) and C(reason). Attended they are ended like any other (they are in I(processes)); unattended
      they are left running and named in I(needs_window).
  returned: always
  type: list
  elements: dict
  sample:
    - {pid: 516, ns_pid: 41, name: python3, owner: "ct:200", gpus: [0], memory_mib: 20998, found_by: [device, nvml],
       command: python3 train.py, reason: "its parent pid 500 (torchrun, pid 12 inside: 'torchrun train.py') matches
       gpu_processes_guard {match: 'torchrun'}"}
needs_window:
  description:
    - One sentence per holder an unattended run left running (guarded, or sharing its job with a guarded one) - its
      pid, its command shortened, why; ending it needs a maintenance window. Empty when attended and when nothing
      was left running. The module does not fail because of them.
  returned: always
  type: list
  elements: str
  sample:
    - "CT 200 on pve1: pid 516 (python3, pid 41 inside) on GPU 0, 20998 MiB, running 'python3 train.py', is left
      running: its parent pid 500 (torchrun, pid 12 inside: 'torchrun train.py') matches gpu_processes_guard
      {match: 'torchrun'}; ending it needs a window (run recover.yml without recover_unattended)"
kept_gpus:
  description:
    - The indexes of the GPUs the holders in I(needs_window) use. Their memory stays held after the step (the memory
      wait leaves them out); the verify step asserts the memory of the others. Empty when attended.
  returned: always
  type: list
  elements: int
  sample: [0, 1]
parents:
  description:
    - The parents of the ended holders' jobs that were not ended with them (neither launchers nor shells, below
      where the walk stops), each with its C(command) (shortened), the holders it is a parent of (C(parent_of)) and
      a C(note) - C(may start workers again - not ended), or what it started during the I(settle) watch (then it
      is also in I(launchers), ended, or in I(needs_window) when unattended).
  returned: always
  type: list
  elements: dict
  sample:
    - {pid: 450, ns_pid: 40, name: python3, command: python3 supervise.py, parent_of: [516],
       note: "may start workers again: not ended"}
own_run:
  description: One sentence per process of this recover run (the module, ansible-playbook or a parent of theirs)
    where the walk up a holder's parents stopped; never ended.
  returned: always
  type: list
  elements: str
  sample: ["pid 4100 (bash: 'bash nightly.sh') also runs this recover run: not ended"]
changes:
  description: One line per process ended (or that check mode would end), launchers first; a parent ended because
    it restarted its worker is added when that happens.
  returned: always
  type: list
  elements: str
  sample: ["end pid 516 (python3, pid 41 inside) on GPU 0, 20998 MiB"]
watched:
  description: Seconds the module watched for restarts after the memory was free (all rounds; 0 in check mode,
    when nothing was ended, or with I(settle) 0).
  returned: always
  type: float
  sample: 10.02
seconds:
  description: Seconds the module took, its own reads included.
  returned: always
  type: float
  sample: 11.4
seconds_to_free:
  description: Seconds from the first signal until every GPU of the target was verified free (0 when nothing was ended).
  returned: always
  type: float
  sample: 0.38
memory:
  description: Final memory.used of each GPU of the target.
  returned: always
  type: list
  elements: dict
  sample: [{index: 0, uuid: GPU-bf580366-c11c-e730-752a-e9ca8716b7fa, memory_used_mib: 0}]
polls:
  description: Number of nvidia-smi memory queries made while waiting.
  returned: always
  type: int
error:
  description:
    - On failure, what kind of failure it was, stable for code - C(invalid) (an option that cannot work, before
      anything runs), C(gpu_processes) (the GPUs cannot be freed - I(blockers), I(survivors), I(held),
      I(restarted), I(new_holders) say why), and the target's (C(stopped), C(missing), C(timeout), C(probe), ...).
  returned: failure
  type: str
  sample: gpu_processes
cmd:
  description: On failure of a command, the argv that ran (the C(pct exec) wrapper included).
  returned: failure of a command
  type: list
  elements: str
rc:
  description: On failure of a command, its exit code.
  returned: failure of a command
  type: int
stdout_tail:
  description: On failure of a command, the last 20 lines of its stdout.
  returned: failure of a command that printed
  type: str
stderr_tail:
  description: On failure of a command, the last 20 lines of its stderr.
  returned: failure of a command that printed
  type: str
blockers:
  description: On failure, the processes that keep the target's GPUs from being freed (another CT's, the node's, a
    protected one), each with its reason; nothing was ended.
  returned: failure
  type: list
  elements: dict
held:
  description: On failure, the GPUs whose memory stayed above the threshold with no process holding it.
  returned: failure
  type: list
  elements: dict
survivors:
  description: On failure, the processes that outlived SIGKILL, each with its state (C(D) is stuck in the driver).
  returned: failure
  type: list
  elements: dict
restarted:
  description: On failure with I(end_launchers=false), the parents that started new children after the holders
    ended (like I(parents), with the pids they C(started)).
  returned: failure
  type: list
  elements: dict
new_holders:
  description: On failure, processes that took the target's GPUs after the module ended their holders (during
    the memory wait or the I(settle) watch), each with its parent's host pid and its command.
  returned: failure
  type: list
  elements: dict
"""

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.act_runner import run_step_module
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.run_lock import RUN_LOCK_ARGUMENT_SPEC
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import (
    PYTHON_ARGUMENT_SPEC,
    TARGET_ARGUMENT_SPEC,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.acting import GpuProcesses
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.facts import SPEC

ARGUMENT_SPEC = {
    **TARGET_ARGUMENT_SPEC,
    **RUN_LOCK_ARGUMENT_SPEC,
    "state": {"type": "str", "choices": ["absent"], "default": "absent"},
    **SPEC,
    **PYTHON_ARGUMENT_SPEC,
}


def main():
    run_step_module(GpuProcesses(ARGUMENT_SPEC))


if __name__ == "__main__":
    main()
