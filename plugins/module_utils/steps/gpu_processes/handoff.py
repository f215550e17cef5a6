# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the GPU processes step hands to the steps after it: the pids it ends before they run (a venv, a
repository or a cache those processes use is not in use once they are gone). A module of its own so that those
steps import this, not the GPU step (the node compiles every module the fact pass imports, every run)."""

from __future__ import annotations


def ending_pids_of(context):
    """Pids (as the target numbers them) that the GPU step ends before a later step runs: its facts' ``processes``
    and ``launchers`` when it has work (``context["steps"]["gpu_processes"]`` of the fact pass), else none."""
    facts = context["steps"].get("gpu_processes") or {}
    if not facts.get("pending"):
        return []
    found = [p.get("ns_pid") for p in (facts.get("processes") or []) + (facts.get("launchers") or [])]
    return sorted({pid for pid in found if isinstance(pid, int)})
