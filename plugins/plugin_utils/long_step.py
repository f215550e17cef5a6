# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The action of a long step's module (the venv build, the compile cache's warm-up): its job's end seen at once.

A module answers only when it ends, so a build of up to 30 minutes runs as an Ansible async job whose status file
its module fills with progress (plugins/module_utils/node/progress.py). Ansible's own polling (``poll: N``) sleeps N
seconds before each look: a build that ended is seen up to N seconds late (a warm rebuild whose processes ran for
1 s took 16.5 s with N = 15), and each look costs two round trips (``async_status`` expands ``~`` on the node, then
runs), plus one more to remove the status file at the end.

A role's task asks for this action's way with ``poll: 0`` (Ansible then polls nothing itself) and the task variable
``pve_gpu_recover_follow``, its progress interval in seconds. The action starts the module as Ansible's async job
(``_execute_module(wrap_async=True)``: async_wrapper, under the task's ``async`` time limit), then calls
pve_gpu.recover.step_job_status, which waits ON THE NODE until the job finishes or the interval passes: the end is
seen within a twentieth of a second by the call already waiting, and a 30-minute build costs one call per interval
(120 at 15 s). Each call that finds the job still running prints one line for its target on the console (stderr):
``ct200: training_venv: installing the lock with `uv pip sync` (4m12s): Downloading torch (846.0MiB)``; the drift
runner finds the same line in ansible-runner's events and writes it to the journal (drift/playbook.py). The call
that finds the job finished removes its status file, and the answer it brings, the module's own, is the task's
result.

Anything else is Ansible's ``normal`` action, unchanged: no ``async`` (check mode, pruning alone: one plain call),
or a task of a playbook's own that polls (``poll`` above 0: Ansible's polls, with the progress the report callback
prints) or fires and forgets (``poll: 0`` without the variable).

Only what ansible-core documents for action plugins: ``_execute_module`` (with ``wrap_async``), the task's
``async`` and ``poll``, the shell's ``async_dir``, ``Display``.
"""

from __future__ import annotations

import time

from ansible.errors import AnsibleActionFail, AnsibleConnectionFailure
from ansible.plugins.action.normal import ActionModule as NormalAction
from ansible.utils.display import Display
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.progress import KEY, describe

display = Display()

# The task variable that asks for this action's way: the progress interval, seconds.
FOLLOW = "pve_gpu_recover_follow"
STATUS_MODULE = "pve_gpu.recover.step_job_status"
# After a status call the connection failed, the next waits this long, doubling up to the interval.
RETRY_FIRST = 0.25


def follow_interval(task, value):
    """Seconds between two progress lines when the action follows the job itself, else None (Ansible's way).

    ``task``: ``async_val`` and ``poll`` (templated by Ansible); ``value``: the task's FOLLOW variable, templated.
    """
    if not task.async_val or task.poll or value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = 0.0
    if seconds < 1:
        raise AnsibleActionFail(f"{FOLLOW} is {value!r}: give the progress interval in seconds, at least 1")
    return seconds


def progress_line(host, step, status, elapsed):
    """One line for a job still running: its target, and what its module said last (or that it runs)."""
    progress = status.get(KEY) if isinstance(status.get(KEY), dict) else None
    return f"{host}: {describe(progress or {'step': step, 'phase': 'running', 'elapsed_seconds': elapsed})}"


class LongStepAction(NormalAction):
    """See the module's docstring. Subclassed once per long step's module (plugins/action/<module>.py)."""

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        value = task_vars.get(FOLLOW)
        interval = follow_interval(self._task, None if value is None else self._templar.template(value))
        if interval is None or self._connection.has_native_async:
            return super().run(tmp, task_vars)
        result = super(NormalAction, self).run(tmp, task_vars)  # ActionBase's checks (async, check mode, args)
        started = time.monotonic()
        job = self._execute_module(task_vars=task_vars, wrap_async=True)
        if job.get("failed") or not job.get("ansible_job_id"):
            return dict(result, **job)  # async_wrapper did not start it: its own failure, as Ansible reports it
        return dict(result, **self._follow(job["ansible_job_id"], interval, task_vars, started))

    def _follow(self, jid, interval, task_vars, started, *, clock=time.monotonic, sleep=time.sleep):
        """Status calls until the job finishes; its answer. async_wrapper ends the job at the task's ``async``
        seconds and writes that as its answer; the interval on top is for that answer to be read."""
        host = task_vars.get("inventory_hostname", "?")
        step = self._task.action.rsplit(".", 1)[-1]
        async_dir = self.get_shell_option("async_dir", default="~/.ansible_async")
        limit = self._task.async_val + interval
        delay = RETRY_FIRST
        while True:
            left = limit - (clock() - started)
            if left <= 0:
                return {
                    "failed": True,
                    "ansible_job_id": jid,
                    "msg": f"{host}: {step}'s job {jid} did not answer within the task's async time limit "
                    f"({self._task.async_val} s), though async_wrapper ends it then; look at its status file in "
                    f"{async_dir} on the node and at its processes there before running again",
                }
            args = {"jid": jid, "wait": round(min(interval, left), 3), "async_dir": async_dir}
            try:
                status = self._execute_module(module_name=STATUS_MODULE, module_args=args, task_vars=task_vars)
            except AnsibleConnectionFailure as error:
                # A node that did not answer this once (ssh dropped, the node busy): the job runs on; try again.
                display.vvvv(f"{host}: the status call of job {jid} failed ({error}); trying again in {delay} s")
                sleep(min(delay, max(0.0, left)))
                delay = min(delay * 2, interval)
                continue
            finally:
                self._remove_tmp_path(self._connection._shell.tmpdir)  # made only without pipelining
            delay = RETRY_FIRST
            if status.get("failed"):  # the status call's own failure (no such job): the job's answer is lost
                return dict(status, msg=f"{host}: {step}: {status.get('msg')}; run again to see what the step did")
            if status.get("finished"):
                return dict(status.get("job") or {}, ansible_job_id=jid)
            display.display(progress_line(host, step, status, round(clock() - started, 1)), stderr=True)
