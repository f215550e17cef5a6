#!/usr/bin/python
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
module: step_job_status
short_description: Wait on the node for a long step's async job to end, and answer its status
description:
  - The status call of a long step (the venv build of M(pve_gpu.recover.training_venv), the warm-up of
    M(pve_gpu.recover.compile_cache)) run as an Ansible async job. The step's action plugin calls it, one call per
    progress interval, until the job ends. Not meant for a playbook's own tasks.
  - Like M(ansible.builtin.async_status), it reads the job's status file, but it waits on the node until the job
    finishes or I(wait) seconds pass, so the end of a job is seen within a twentieth of a second by one module
    execution, and a long job costs one execution per interval, not one per poll of a fixed period.
  - A job that finished answers C(finished=true) and, under C(job), the module's own result as
    M(ansible.builtin.async_status) reads it; its status file is removed, as async_status's C(mode=cleanup) would. A
    job still running answers C(started=true), C(finished=false) and the progress its module wrote
    (C(pve_gpu_recover_progress), plugins/module_utils/node/progress.py).
version_added: "2.5.0"
author: pve-gpu-recover contributors (@pve-gpu-recover)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: It reads the job's status in check mode too, and leaves a finished job's status file in place.
  diff_mode:
    support: none
  platform:
    platforms: posix
options:
  jid:
    description:
      - The job id the async start answered (C(ansible_job_id), C(j<digits>.<pid>)).
    type: str
    required: true
  wait:
    description:
      - Seconds to wait on the node for the job to finish before answering that it still runs.
    type: float
    default: 0
  async_dir:
    description:
      - The directory of async status files, as the connection's shell names it (C(~) is the remote user's home).
    type: path
    default: ~/.ansible_async
seealso:
  - module: ansible.builtin.async_status
"""

EXAMPLES = r"""
# The step's action plugin makes this call; by hand it reads a job the same way.
- name: Wait up to 15 s for the venv build job to end
  pve_gpu.recover.step_job_status:
    jid: "{{ build.ansible_job_id }}"
    wait: 15
  delegate_to: pve1
"""

RETURN = r"""
started:
  description: Set while the job runs (as M(ansible.builtin.async_status) says it).
  returned: while the job runs
  type: bool
  sample: true
finished:
  description: Whether the job ended.
  returned: always
  type: bool
  sample: false
job:
  description: The job's answer, the module's own result (or async_wrapper's, when it ended the module at the time
    limit), as M(ansible.builtin.async_status) gives it.
  returned: when the job finished
  type: dict
  sample: {"changed": true, "changes": ["torch 2.11.0+cu130 -> 2.11.0+cu128"]}
ansible_job_id:
  description: The job id.
  returned: always
  type: str
  sample: j955916282008.11713
pve_gpu_recover_progress:
  description: What the job's module said last (step, target, phase, line, elapsed_seconds), while it runs.
  returned: while the job runs and its module wrote progress
  type: dict
  sample: {"step": "training_venv", "phase": "installing the lock with `uv pip sync`", "line": "Downloading torch"}
"""

import contextlib
import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import progress as node_progress


def answer(jid, status):
    """The status call's answer for a status read from the job file (see :func:`node_progress.read_job`)."""
    if node_progress.job_finished(status):
        return {"finished": True, "ansible_job_id": jid, "job": status}
    progress = (status or {}).get(node_progress.KEY)
    running = {"started": True, "finished": False, "ansible_job_id": jid}
    return dict(running, **{node_progress.KEY: progress}) if isinstance(progress, dict) else running


def main():
    module = AnsibleModule(
        argument_spec={
            "jid": {"type": "str", "required": True},
            "wait": {"type": "float", "default": 0},
            "async_dir": {"type": "path", "default": "~/.ansible_async"},
        },
        supports_check_mode=True,
    )
    jid = module.params["jid"]
    if not node_progress.JOB_NAME.match(jid):
        module.fail_json(msg=f"job id {jid!r} is not one async_wrapper gives (j<digits>.<pid>)", finished=True)
    path = os.path.join(module.params["async_dir"], jid)
    status = node_progress.wait_for_job(path, module.params["wait"])
    if status is None:
        module.fail_json(msg=f"could not find job {jid} in {path}", ansible_job_id=jid, started=True, finished=True)
    result = answer(jid, status)
    if result["finished"] and not module.check_mode:  # check mode changes nothing, its own bookkeeping neither
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # async_status's cleanup, in the same call
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
