# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Ending processes and the waits around it: SIGTERM, ``grace``, SIGKILL (:func:`end_processes`), the GPUs'
memory polled until it is free (:func:`wait_for_memory`), the parents left running watched for restarts
(:func:`watch_jobs`). What they read and send is injected, so the escalation is unit tested without processes;
:func:`signal_process` is the real sender."""

from __future__ import annotations

import contextlib
import os
import signal
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.process import read_stat
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.text import printable
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.gpu_processes.plan import busy_gpus


def signal_process(info, signum):
    """Signal the process of ``info`` only if its pid still names it (same start time).

    The signal goes to the whole thread group, so a zombie leader whose threads still run is ended too. Only
    ``stat`` is read (never the cmdline, which a process stuck in the driver can block).
    """
    now = read_stat(info.pid)
    if now is not None and now[2] == info.start_time:
        with contextlib.suppress(ProcessLookupError):
            os.kill(info.pid, signum)


def end_processes(entries, *, grace, kill_timeout, poll_interval, alive, send, clock=time.monotonic, sleep=time.sleep):
    """SIGTERM every entry, SIGKILL what outlives ``grace``; return ``(killed, survivors)``.

    ``alive(info)`` and ``send(info, signum)`` are injected so the escalation is unit tested without processes.
    ``killed`` items say which signal was needed and after how many seconds the process was gone.
    """
    started = clock()
    pending = {e["info"].pid: e for e in entries}
    killed = []

    def reap(signal_name):
        for pid, entry in list(pending.items()):
            if not alive(entry["info"]):
                killed.append(
                    {
                        "pid": pid,
                        "name": printable(entry["info"].comm),
                        "signal": signal_name,
                        "exited_after": round(clock() - started, 3),
                    }
                )
                del pending[pid]

    for signum, signal_name, wait in ((signal.SIGTERM, "SIGTERM", grace), (signal.SIGKILL, "SIGKILL", kill_timeout)):
        for entry in pending.values():
            send(entry["info"], signum)
        deadline = clock() + wait
        reap(signal_name)
        while pending and clock() < deadline:
            sleep(poll_interval)
            reap(signal_name)
        if not pending:
            break
    return killed, list(pending.values())


def wait_for_memory(
    query, uuids, *, threshold, timeout, poll_interval, clock=time.monotonic, sleep=time.sleep, interrupt=None
):
    """Poll ``query()`` (memory rows) until the target's GPUs are free; return ``(rows, polls, free)``.

    ``interrupt()``, when given, is asked after each poll that found memory still used: a truthy answer (a new
    holder took the GPUs: waiting longer cannot help) ends the wait at once, not free.
    """
    deadline = clock() + timeout
    polls = 0
    while True:
        rows = query()
        polls += 1
        if not busy_gpus(rows, uuids, threshold):
            return rows, polls, True
        if clock() >= deadline or (interrupt is not None and interrupt()):
            return rows, polls, False
        sleep(poll_interval)


def watch_jobs(restarts, new_holders, *, window, poll_interval, clock=time.monotonic, sleep=time.sleep):
    """Ask ``restarts()`` (new children of the parents left running), then ``new_holders()``, every
    ``poll_interval`` for ``window`` seconds; return ``(restarts, holders)`` at the first non-empty answer, or
    ``({}, [])`` when the window ends with none (the last ask is at or after its end)."""
    deadline = clock() + window
    while True:
        found = restarts()
        if found:
            return found, []
        holders = new_holders()
        if holders or clock() >= deadline:
            return {}, holders
        sleep(poll_interval)
