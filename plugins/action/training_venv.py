# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""training_venv's action: a real build runs as an async job this action follows, its end seen at once
(plugins/plugin_utils/long_step.py); anything else is Ansible's normal action."""

from __future__ import annotations

from ansible_collections.pve_gpu.recover.plugins.plugin_utils.long_step import LongStepAction as ActionModule

__all__ = ["ActionModule"]
