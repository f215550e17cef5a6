# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The runner's one exception: main() prints it and exits 1."""

from __future__ import annotations


class DriftError(Exception):
    """One sentence: what is wrong, what was found, what to do. main() prints it and exits 1."""


class LockHeld(DriftError):
    pass
