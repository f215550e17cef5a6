# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a torch version string says about its build: the variant in its local tag and the CUDA it names.

Its own small module because the venv, compile-cache and verify steps all read it, and the fact pass imports
(compiles, on the node, every run) only the modules of the steps it runs: verify must not pull in the others.
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# pylint: disable=disallowed-name

from __future__ import annotations

import re

_VARIANT = re.compile(r"^(?P<variant>cu\d+|cpu|xpu|rocm\d+(?:\.\d+)*)(?:\.|$)")
_CUDA_VARIANT = re.compile(r"^cu(\d+)(\d)$")


def variant(version):
    """The build variant in a version's local tag: ``2.11.0+cu128`` -> ``cu128``, ``2.13.0+cpu`` -> ``cpu``,
    ``2.11.0+rocm6.4`` -> ``rocm6.4``, ``2.1.0+cu121.with.pypi.cudnn`` -> ``cu121``; ``2.11.0`` -> None."""
    _, plus, local = (version or "").partition("+")
    match = _VARIANT.match(local) if plus else None
    return match.group("variant") if match else None


def cuda_of(build_variant):
    """The CUDA version a build variant names: ``cu128`` -> ``12.8``, ``cu130`` -> ``13.0``; ``cpu`` -> None."""
    match = _CUDA_VARIANT.match(build_variant or "")
    return f"{int(match.group(1))}.{match.group(2)}" if match else None
