# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
name: bench_profile
type: aggregate
short_description: Per-task wall time and module executions of one playbook run, for bench/converged.py
description:
  - Writes JSON to the file named by C(BENCH_PROFILE) when the playbook ends; does nothing without it.
  - A module execution is a task result (or a loop item) of an action that is not controller-only and was not
    skipped. Benchmark code, not part of the product.
author: pve-gpu-recover contributors
"""

import json
import os
import time

from ansible.plugins.callback import CallbackBase

# Actions that run inside ansible-playbook: no module is executed for them.
LOCAL = {"assert", "debug", "fail", "set_fact", "meta", "validate_argument_spec", "include_role", "import_role"}


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "bench_profile"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self.tasks = []
        self.current = None
        self.started = time.monotonic()

    def _close(self):
        if self.current is not None:
            self.current["seconds"] = round(time.monotonic() - self.current.pop("_t"), 4)
            self.tasks.append(self.current)
            self.current = None

    def v2_playbook_on_task_start(self, task, is_conditional):
        self._close()
        action = task.action.rsplit(".", 1)[-1]
        self.current = {"task": task.get_name(), "action": action, "executions": 0, "_t": time.monotonic()}

    def _count(self, result):
        if self.current is not None and self.current["action"] not in LOCAL and not result._result.get("results"):
            self.current["executions"] += 1

    def v2_runner_on_ok(self, result):
        self._count(result)

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._count(result)

    def v2_runner_item_on_ok(self, result):
        self._count(result)

    def v2_runner_item_on_failed(self, result):
        self._count(result)

    def v2_playbook_on_stats(self, stats):
        self._close()
        path = os.environ.get("BENCH_PROFILE")
        if path:
            with open(path, "w", encoding="utf-8") as handle:
                json.dump({"tasks": self.tasks, "seconds": round(time.monotonic() - self.started, 4)}, handle)
