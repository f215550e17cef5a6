#!/usr/bin/python
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
module: compile_cache
short_description: Keep a target's torch.compile caches built for the torch, triton, CUDA and GPUs in use
description:
  - Each cache root (I(roots), by default C(/tmp/torchinductor_<user>) and C(~<user>/.triton/cache), torch's and
    triton's own defaults) holds a stamp file, I(stamp_name), naming the fingerprint the cache was built for -
    torch's exact version with its build variant (C(2.11.0+cu128)), CUDA, triton and the GPU models.
  - The expected fingerprint is read from the venv I(venv) inside the target - C(torch/version.py) as text,
    triton's dist-info METADATA, never C(import torch) - and the GPU models from C(nvidia-smi). It reads all of it
    again even when the fact pass of M(pve_gpu.recover.target_facts) just did, since those facts can be seconds old and the venv
    may just have been rebuilt.
  - Per root - stamped with the expected fingerprint, C(fresh), kept; stamped with another, C(stale), emptied and
    stamped anew; without a stamp, C(unstamped), adopted (stamped as it is) unless I(venv_pending) says the venv is
    rebuilt in this run, which makes every cache stale; absent, C(missing), nothing to do; and C(refused) when it
    could take more than a cache with it. A root refused by its setting (below - C(/), a home directory, a root
    inside another) fails the task before anything is deleted. A root refused for what was found at its path - a
    symlink on the way or one it resolves through, a directory above it others may write, a root another user
    created first in C(/tmp), a file in its place, which any user of the target may have put there - is refused
    alone, so that no user can fail every run. It is left as it is (neither purged nor stamped), named in
    I(refused) with C(problem) false and as a warning (unattended also in I(needs_window)), no warm-up runs while
    one is refused, and the other roots are handled as usual; it is no change, so a converged target stays
    C(changed=false).
  - Refused roots - C(/), C(/usr), C(/etc), C(/var), C(/opt), C(/srv), any path with fewer than 2 components, a
    home directory of a user of the target (or a directory containing one), anything inside C(/usr), C(/etc),
    C(/bin), C(/sbin), C(/lib*), C(/boot), C(/dev), C(/proc), C(/sys), a root that contains C(..), a root that is
    not a directory, and a root inside another root.
  - A root is opened from C(/) one component at a time with C(O_NOFOLLOW), as the probe reads it and again in the
    script just before it acts, and refused alone when a component is a symlink (give the
    directory itself), when a directory above it may be written by a group or by every user without the sticky
    bit, or is owned by a user other than root and I(user) (either could put any directory in its place), and when
    a component is owned by a user who could not have put it there (in a sticky directory such as C(/tmp), a root
    of another user than I(user) or root; in a directory of I(user), anything not theirs).
  - Everything after that check works through the root's file descriptor and the directory descriptors below it,
    never by path again; the script acts only on the very directory the read judged (its device and inode), else
    it fails with C(changed). A purge never follows a symlink (a link is removed itself and its target survives;
    links that lead out of the root are named in the result), never enters another mount (compared by mount id,
    so a bind mount of the same filesystem too) and never enters a directory whose parent a non-root user owns
    unless that user owns it too (they could have moved it in from where they may not delete); those are left
    alone and named (C(mounts), C(left)).
  - No root is purged while a live process of the target uses it (its cwd, an open file or a mapped file lies in
    it, as C(/proc) shows) - never under a running compile. recover.yml runs this step after the GPU step, which
    ends the target's GPU holders first. Attended, such a root fails the task before anything is deleted.
    Unattended (I(unattended)), it is left as it is (neither purged nor stamped) and named in I(needs_window),
    the other roots are handled as usual, no warm-up runs, and the task does not fail because of it; the acting
    script, which looks at the processes again just before the purge, leaves a root it finds in use the same way.
  - When I(warmup) is given, it runs once after a purge (or when every root is missing or empty) - alone, as
    I(user), with a deadline, C(TORCHINDUCTOR_COMPILE_THREADS=1), the venv first on C(PATH) and the first root as
    C(TORCHINDUCTOR_CACHE_DIR). The roots it creates are stamped. Its failure fails the task with its exit code and
    the tail of its stderr.
  - Purge, stamps and warm-up run in ONE C(pct exec) (a script sent to the target's python on stdin), followed
    in the same call by a new read; a root still out of spec then fails the task. A converged run costs one
    C(pct exec), the read.
version_added: "0.4.0"
author: pve-gpu-recover contributors (@pve-gpu-recover)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - pve_gpu.recover.pve_target
  - pve_gpu.recover.pve_target.run_lock
  - pve_gpu.recover.pve_target.python
attributes:
  check_mode:
    support: full
    details: Reads and judges exactly as a real run does and changes nothing (no purge, no stamp, no warm-up);
      C(changed), C(changes) and the diff are those of a real run. Processes in I(ending_pids) count as gone, as
      they will be once the GPU step has run.
  diff_mode:
    support: full
    details: One line per root - before, the fingerprint its stamp names (or C(unstamped), C(missing),
      C(refused (...))); after, the expected fingerprint (a refused root - as before). Every value of a stamp
      (written by the cache user) is shown escaped and cut to 100 characters; one that is no string by its type.
  platform:
    platforms: posix
options:
  state:
    description:
      - C(present) makes every cache root fresh - built for the expected fingerprint, and stamped so.
    type: str
    choices: [present]
    default: present
  user:
    description:
      - The user training runs as. It names the default roots (C({user}), C({home}) in I(roots)), and the
        warm-up runs as this user.
    type: str
    default: root
  venv:
    description:
      - The venv whose torch and triton the caches are for, inside the target.
    type: path
    default: /opt/venvs/train
  roots:
    description:
      - The cache directories, inside the target. C({user}) becomes I(user) and C({home}) its home directory (as
        the target's passwd says).
      - Give the directories your jobs use - C(TORCHINDUCTOR_CACHE_DIR), C(TRITON_CACHE_DIR) - when they set
        them. The first root is the warm-up's C(TORCHINDUCTOR_CACHE_DIR).
      - Only these directories are ever purged, and only what lies inside them.
    type: list
    elements: str
    default: ["/tmp/torchinductor_{user}", "{home}/.triton/cache"]
  stamp_name:
    description:
      - File name of the stamp inside each root (JSON - C(fingerprint), C(stamped_by), C(stamped_at)).
    type: str
    default: .pve-gpu-recover-stamp
  warmup:
    description:
      - A command (an argv list, no shell) that compiles what training compiles first, e.g.
        C([/opt/venvs/train/bin/python, /srv/train/warmup.py]). Empty - no warm-up.
    type: list
    elements: str
    default: []
  warmup_timeout:
    description:
      - Seconds the warm-up may take; its whole process group is killed then and the task fails.
    type: int
    default: 900
  warmup_env:
    description:
      - Environment variables of the warm-up, on top of C(PATH) (the venv's C(bin) first), C(HOME), C(USER),
        C(LOGNAME), C(LANG=C.UTF-8), C(VIRTUAL_ENV) and C(TORCHINDUCTOR_CACHE_DIR) (the first root), which they may
        replace. C(TORCHINDUCTOR_COMPILE_THREADS) is always C(1) and may not be set here.
    type: dict
    default: {}
  venv_pending:
    description:
      - The training venv step rebuilds I(venv) in this run (the role passes the fact pass's
        C(compile_cache.venv_changes)). Every existing root is then stale - purged and stamped for the venv as it
        is read when this module runs - and no unstamped root is adopted.
    type: bool
    default: false
  venv_pending_torch:
    description:
      - With I(venv_pending), the torch build (local tag included) of the lock the venv is rebuilt from (the role
        passes the fact pass's C(compile_cache.expected.torch)). Check mode rebuilds no venv, so the venv in the
        target (none yet, on a fresh one) is not what the caches will be for - they are judged against this, as
        the fact pass judged them. A real run reads the venv as rebuilt.
    type: str
  ending_pids:
    description:
      - Pids, as the target numbers them, that the GPU step ends before this one (the role passes the fact pass's
        C(compile_cache.ending_pids)). Only check mode counts them as gone, since the GPU step ended nothing then;
        a real run refuses to purge a root that any live process uses.
    type: list
    elements: int
    default: []
  unattended:
    description:
      - The scheduled drift corrector's mode - a stale root in use by a live process is left for a maintenance
        window (I(needs_window)) instead of failing the task. The role sets it from C(recover_unattended).
    type: bool
    default: false
requirements:
  - In the target, Python 3.9+ and, for the GPU models, C(nvidia-smi) (without it, no GPU is assumed).
seealso:
  - module: pve_gpu.recover.target_facts
  - module: pve_gpu.recover.training_venv
  - module: pve_gpu.recover.gpu_processes
notes:
  - The stamp is what makes a cache trusted. A cache this module did not stamp is adopted once (the step assumes
    it was built for the venv as it is) unless the venv is rebuilt in the same run.
  - A purge that is cut short leaves a C(purging) marker as the stamp, so the next run purges again instead of
    adopting half a cache.
  - Run as an async job (C(async) with C(poll), as the role runs a real warm-up), the module puts the progress of
    the purge and the warm-up (the phase, the warm-up's last output line, the elapsed time) into the job's status
    file while it runs; each of Ansible's polls shows it (plugins/module_utils/node/progress.py).
"""

EXAMPLES = r"""
- name: Keep CT 200's torch.compile caches built for its venv and GPUs
  pve_gpu.recover.compile_cache:
    vmid: 200
  delegate_to: pve1

- name: Caches of user alice in a directory her jobs set, warmed up after a purge
  pve_gpu.recover.compile_cache:
    vmid: 200
    user: alice
    venv: /opt/venvs/train
    roots: [/scratch/alice/inductor, "{home}/.triton/cache"]
    warmup: [/opt/venvs/train/bin/python, /srv/train/warmup.py]
    warmup_env: {CUDA_VISIBLE_DEVICES: "0"}
  delegate_to: pve1

- name: Only report which caches are stale (run with --check --diff)
  pve_gpu.recover.compile_cache:
    vmid: 200
  delegate_to: pve1
  check_mode: true
  register: cache_drift
"""

RETURN = r"""
cache_roots:
  description:
    - One entry per root, in the order of I(roots) - C(path) (expanded), C(real_path) (where it resolves to),
      C(exists), C(size_bytes), C(files), C(stamp) (the fingerprint its stamp names, or null), C(stamp_error),
      C(verdict) (C(fresh), C(stale), C(unstamped), C(missing), C(refused), or C(unknown) when the expected
      fingerprint cannot be read), C(reason), C(escapes) (symlinks in it that lead out of it, C(link) and
      C(target)), C(escapes_count), C(mounts) (other mounts inside it, bind mounts too, never entered), C(left)
      (other directories never entered - C(path), C(why)), C(id) (its device and inode as read), C(busy)
      (processes using it that the GPU step ends first).
    - A stale root an unattended run leaves because a live process uses it also has C(window) (true) and C(live)
      (those processes - C(pid) as the target numbers it, C(name), C(how)).
    - After a real run also C(size_before), C(size_after) (bytes), C(purged) (C(files), C(bytes), C(links),
      C(links_out), C(mounts_left), C(left); null when not purged) and C(stamped).
    - The result has no top-level C(path) key - Ansible would add the stats of a node file of that name.
  returned: always
  type: list
  elements: dict
  sample:
    - path: /tmp/torchinductor_root
      real_path: /tmp/torchinductor_root
      exists: true
      size_bytes: 152000000
      verdict: stale
      reason: stamped for torch 2.11.0+cu130, now 2.11.0+cu128
      stamp: {torch: 2.11.0+cu130, variant: cu130, cuda: "13.0", triton: 3.3.0, gpus: [NVIDIA H200]}
      size_before: 152000000
      size_after: 96
      purged: {files: 1204, bytes: 152000000, links: 1, links_out: [{link: /tmp/torchinductor_root/h, target: /etc/hostname}], mounts_left: [], left: []}
      stamped: true
needs_window:
  description:
    - Unattended only - one sentence per stale root left as it is because a live process uses it (found by the
      module's read or by the acting script just before the purge), and per root refused alone (I(refused) with
      C(problem) false, where a person must remove what was found there); the task does not fail because of them.
      Empty otherwise.
  returned: always
  type: list
  elements: str
  sample:
    - "CT 200 on pve1: compile cache /tmp/torchinductor_root is stale (stamped for torch 2.11.0+cu130, now
      2.11.0+cu128; 152 MB) but in use by pid 4711 (python3: cwd, mapped): not purged under a live process; purging
      it needs a window (stop the job, or run recover.yml without recover_unattended)"
expected:
  description:
    - The fingerprint the caches must be built for - C(torch) (exact, local tag included), C(variant), C(cuda),
      C(triton), C(gpus) (the GPU models, sorted, once each); null when the venv has no torch.
    - It is also what the stamps written by this run name.
  returned: always
  type: dict
  sample: {torch: 2.11.0+cu128, variant: cu128, cuda: "12.8", triton: 3.3.0, gpus: [NVIDIA H200]}
venv:
  description: The venv the caches are judged for.
  returned: always
  type: str
  sample: /opt/venvs/train
user:
  description: The user whose caches they are.
  returned: always
  type: str
  sample: root
refused:
  description:
    - The roots refused, C(path), C(reason) and C(problem). C(problem) true - refused by the setting (C(/), a home
      directory, a root inside another) - fails the task; nothing is deleted then. C(problem) false - refused for
      what was found at the path (a symlink, a directory others may write, a squatted C(/tmp) root, a file) - is
      a warning (unattended also a line of I(needs_window)) - that root is left as it is, no warm-up runs, the
      other roots are handled as usual.
  returned: always
  type: list
  elements: dict
  sample: [{path: /root, reason: it is the home directory of root, problem: true}]
warmup:
  description:
    - The warm-up - null without I(warmup). C(argv), C(planned), C(ran); after it ran also C(rc), C(seconds),
      C(size_before) and C(size_after) (bytes in every root), C(filled) (it added to the caches),
      C(stdout_tail), C(stderr_tail).
  returned: always
  type: dict
  sample: {argv: [/opt/venvs/train/bin/python, /srv/train/warmup.py], planned: true, ran: true, rc: 0, seconds: 19.2,
           size_before: 0, size_after: 151000000, filled: true}
size_before:
  description: Bytes in every root before the run.
  returned: always
  type: int
size_after:
  description: Bytes in every root after the run (null in check mode and when nothing was done).
  returned: always
  type: int
changes:
  description: What the run changes (or, in check mode, would change), one line each; empty when converged.
  returned: always
  type: list
  elements: str
  sample:
    - purge /tmp/torchinductor_root (stamped for torch 2.11.0+cu130, now 2.11.0+cu128; 152 MB)
    - stamp /tmp/torchinductor_root for torch 2.11.0+cu128 (CUDA 12.8), triton 3.3.0, NVIDIA H200
    - "stamp /root/.triton/cache (unstamped: adopted as built for torch 2.11.0+cu128 (CUDA 12.8), triton 3.3.0,
      NVIDIA H200; 12 MB)"
seconds:
  description: Seconds the module took.
  returned: always
  type: float
error:
  description:
    - On failure, what kind of failure it was, stable for code. From the module - C(invalid) (options),
      C(problems) (a root refused by its setting, a root in use, no torch in the venv, an unknown user), C(probe)
      (the target's answer is not in the expected shape), C(verify) (a root still
      out of spec after acting). From the script - C(refused), C(unsafe) (a root it cannot open without trusting a
      user who could have changed it) and C(changed) (a root changed since it was read),
      C(busy) (a process started using a root), C(warmup_failed), C(warmup_timeout), C(warmup_not_found),
      C(warmup_user), C(warmup_empty) (the warm-up filled no root), C(no_space), C(os_error). And the target's
      (C(stopped), C(missing), C(probe), C(timeout), ...).
  returned: failure
  type: str
  sample: warmup_failed
cmd:
  description: On failure of a command, the argv that ran (the C(pct exec) wrapper, or the warm-up's argv).
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
done:
  description: On a failure of the script, what it had done by then (C(roots), as in I(cache_roots), and C(warmup)).
  returned: failure of the script
  type: dict
"""

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.act_runner import run_step_module
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.run_lock import RUN_LOCK_ARGUMENT_SPEC
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import (
    PYTHON_ARGUMENT_SPEC,
    TARGET_ARGUMENT_SPEC,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache.acting import CompileCache
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.compile_cache.facts import SPEC

ARGUMENT_SPEC = {
    **TARGET_ARGUMENT_SPEC,
    **RUN_LOCK_ARGUMENT_SPEC,
    "state": {"type": "str", "choices": ["present"], "default": "present"},
    **SPEC,
    "venv_pending": {"type": "bool", "default": False},
    "venv_pending_torch": {"type": "str"},
    "ending_pids": {"type": "list", "elements": "int", "default": []},
    **PYTHON_ARGUMENT_SPEC,
}


def main():
    run_step_module(CompileCache(ARGUMENT_SPEC))


if __name__ == "__main__":
    main()
