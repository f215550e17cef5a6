# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The compile cache step's fingerprints: what a cache root's stamp names and what the caches must be built for
(torch's build and CUDA, triton, the GPU models), where the expected one comes from (the venv's files, the training
venv step's lock, preflight's or the module's own nvidia-smi), and how a stamp is compared and shown; pure. A stamp
is the cache user's text: every value of it is normalized and escaped before it is compared or shown.
"""

from __future__ import annotations

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.nvidia_smi import (
    NvidiaSmiError,
    classify_failure,
    parse_gpus,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.text import printable
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.torch_build import cuda_of, variant

FINGERPRINT_KEYS = ("torch", "variant", "cuda", "triton", "gpus")
GPU_NAME_FIELDS = (("name", "name", "str"),)
STAMP_SHOWN = 100  # characters of one stamp value shown in a message
STAMP_GPUS = 16  # GPU models of one stamp shown in a message


def make_fingerprint(torch, cuda, triton, gpus):
    """``("2.11.0+cu128", "12.8", "3.3.0", ["NVIDIA H200", "NVIDIA H200"])`` -> ``{"torch": "2.11.0+cu128",
    "variant": "cu128", "cuda": "12.8", "triton": "3.3.0", "gpus": ["NVIDIA H200"]}``: the GPU models sorted,
    once each (a kernel is built for a model, not for a count)."""
    return {"torch": torch, "variant": variant(torch), "cuda": cuda, "triton": triton, "gpus": sorted(set(gpus))}


def planned_fingerprint(lock_torch, gpus):
    """What the caches are judged against while the training venv step rebuilds the venv from a lock pinning
    ``lock_torch``: its CUDA from the build variant, triton unknown until the venv is built."""
    return make_fingerprint(lock_torch, cuda_of(variant(lock_torch)), None, gpus)


def normalized(fingerprint):
    """A stamp's fingerprint in the form :func:`make_fingerprint` gives (unknown keys dropped, GPUs sorted).

    A stamp is written by the cache user (not trusted): a value that is neither a string nor None becomes the
    name of its type (``<int>``), so what is compared and shown is always text; :func:`describe` escapes it."""
    found = {key: _stamp_value(fingerprint.get(key)) for key in FINGERPRINT_KEYS if key != "gpus"}
    gpus = fingerprint.get("gpus")
    found["gpus"] = (
        sorted(set(gpus)) if isinstance(gpus, list) and all(isinstance(g, str) for g in gpus) else _stamp_value(gpus)
    )
    return {key: found[key] for key in FINGERPRINT_KEYS}


def _stamp_value(value):
    """A stamp's value as the node keeps it: a string or None as it is, anything else its type's name."""
    return value if value is None or isinstance(value, str) else f"<{type(value).__name__}>"


def shown(value):
    """A fingerprint's value in a message: one line, at most STAMP_SHOWN characters (printable); a value that is
    no string is named by its type (``<dict>``): a stamp is the cache user's text, never the node's."""
    return printable(_stamp_value(value), STAMP_SHOWN)


def describe(fingerprint):
    """``torch 2.11.0+cu128 (CUDA 12.8), triton 3.3.0, NVIDIA H200``; ``torch 2.13.0+cpu (no CUDA), no triton,
    no GPU``. Every value passes through :func:`shown` (a stamp's ``"2.0\\n..."`` stays on its line)."""
    torch = fingerprint.get("torch")
    cuda = fingerprint.get("cuda")
    head = f"torch {shown(torch)} ({f'CUDA {shown(cuda)}' if cuda else 'no CUDA'})" if torch else "no torch"
    triton = f"triton {shown(fingerprint['triton'])}" if fingerprint.get("triton") else "no triton"
    return f"{head}, {triton}, {_gpus_shown(fingerprint.get('gpus')) or 'no GPU'}"


def _gpus_shown(gpus):
    """``NVIDIA H200, NVIDIA H100``; a value that is no list: :func:`shown`; ``""`` for none."""
    if isinstance(gpus, list):
        return ", ".join(shown(g) for g in gpus[:STAMP_GPUS]) + (" and more" if len(gpus) > STAMP_GPUS else "")
    return shown(gpus) if gpus else ""


def differences(stamped, expected):
    """What a stale stamp was built for, against now: ``stamped for torch 2.11.0+cu130, now 2.11.0+cu128``."""
    stamped, expected = normalized(stamped), normalized(expected)
    parts = []
    if stamped["torch"] != expected["torch"]:
        parts.append(f"torch {shown(stamped['torch']) or 'none'}, now {shown(expected['torch']) or 'none'}")
    elif stamped["cuda"] != expected["cuda"]:
        parts.append(f"CUDA {shown(stamped['cuda']) or 'none'}, now {shown(expected['cuda']) or 'none'}")
    if stamped["triton"] != expected["triton"]:
        parts.append(f"triton {shown(stamped['triton']) or 'none'}, now {shown(expected['triton']) or 'none'}")
    if stamped["gpus"] != expected["gpus"]:
        parts.append(f"GPUs {_gpus_shown(stamped['gpus']) or 'none'}, now {_gpus_shown(expected['gpus']) or 'none'}")
    return "stamped for " + ("; ".join(parts) if parts else f"another fingerprint ({describe(stamped)})")


def venv_fingerprint(answer, gpus):
    """The fingerprint of the venv the probe read, or None when it has no torch/version.py."""
    venv = answer["venv"]
    version_py = venv.get("torch_version_py") or {}
    if not isinstance(version_py, dict) or not version_py.get("version"):
        return None
    triton = venv.get("triton") if isinstance(venv.get("triton"), dict) else {}
    return make_fingerprint(str(version_py["version"]), version_py.get("cuda"), triton.get("version"), gpus)


def gpu_names_read(answer):
    """``(names, problem)`` from the nvidia-smi answer of the module's probe: none asked or no nvidia-smi (a CPU
    host) gives no GPU; a failing nvidia-smi is a problem."""
    smi = answer.get("gpus")
    if not isinstance(smi, dict) or smi.get("missing"):
        return [], None
    failure = classify_failure(
        smi.get("rc"), smi.get("stdout") or "", smi.get("stderr") or "", truncated=bool(smi.get("truncated"))
    )
    if failure is None:
        try:
            return [g["name"] for g in parse_gpus(smi.get("stdout") or "", GPU_NAME_FIELDS)], None
        except NvidiaSmiError as error:
            failure = error
    return [], f"the GPU names cannot be read from nvidia-smi: {failure}"


def gpu_names_of(context):
    """The GPU models preflight found (the fact pass asks nvidia-smi once, in preflight's part)."""
    preflight = context["steps"].get("preflight") or {}
    return [g.get("name") for g in preflight.get("gpus") or [] if isinstance(g.get("name"), str)]


def venv_plan_of(spec, context):
    """``(pending, lock torch)`` of the training venv step when it is in the pass for this very venv."""
    facts = context["steps"].get("training_venv")
    if not isinstance(facts, dict) or facts.get("error") or facts.get("path") != spec["venv"]:
        return False, None
    lock = facts.get("lock") or {}
    return bool(facts.get("pending")), lock.get("torch")
