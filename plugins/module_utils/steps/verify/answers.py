# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the verify step's probes answered, checked before any of it is used: the fact pass's probe part
(:func:`check_answer`: torch/version.py read as text) and the torch probe the acting module runs in the venv's own
python (:func:`torch_answer`). Both come from inside the target: a key of the wrong type, a version that is not
one, too many items, is a VerifyError, never a value a message or a check trusts."""

from __future__ import annotations

import json
import re

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.errors import RecoverError
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.nvidia_smi import shown

# What the answers must look like before any of it is used (they come from inside the target).
VERSION = re.compile(r"^[0-9][0-9A-Za-z.+_-]{0,63}$")
CUDA_VERSION = re.compile(r"^\d{1,3}\.\d{1,3}$")
DRIVER_VERSION = re.compile(r"^\d{2,4}\.\d{1,4}(?:\.\d{1,4})?$")
DEVICE = re.compile(r"^/dev/nvidia\d{1,4}$")
MAX_OUTPUT = 64 * 1024  # bytes of the torch probe's stdout that are read at all
MAX_ITEMS = 64


class VerifyError(RecoverError):
    """The verify settings cannot work, or a probe answered something that is not its answer."""


# -- the fact pass's probe part --------------------------------------------------------------------------------
def check_answer(answer):
    """The fact pass's probe part comes from inside a CT: what is not its answer is a VerifyError."""
    if not isinstance(answer, dict):
        raise VerifyError("the verify probe answered no object", kind="probe")
    for key in ("exists", "python"):
        if not isinstance(answer.get(key), bool):
            raise VerifyError(f"the verify probe answered no {key!r} (bool)", kind="probe")
    version_py = answer.get("torch_version_py")
    if version_py is not None and not isinstance(version_py, dict):
        raise VerifyError("the verify probe answered a torch_version_py that is not an object", kind="probe")
    if answer.get("unsafe") is not None and not isinstance(answer["unsafe"], str):
        raise VerifyError("the verify probe answered an unsafe that is not a sentence", kind="probe")
    if version_py:
        for key, pattern in (("version", VERSION), ("cuda", CUDA_VERSION)):
            value = version_py.get(key)
            if value is not None and not (isinstance(value, str) and pattern.match(value)):
                raise VerifyError(
                    f"the verify probe read torch/version.py's {key} as {shown(value)}, which is not a version",
                    kind="probe",
                )


# -- the torch probe's answer ----------------------------------------------------------------------------------
def _typed(answer, key, kinds, default=None, *, required=False):
    if key not in answer:
        if required:
            raise VerifyError(f"the torch probe answered no {key!r}", kind="probe")
        return default
    value = answer[key]
    if value is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
        raise VerifyError(f"the torch probe answered {key!r} as {shown(value)}, not {kinds[0].__name__}", kind="probe")
    return value


def _version(answer, key, pattern=VERSION, *, required=False):
    value = _typed(answer, key, (str,), required=required)
    if value is not None and not pattern.match(value):
        raise VerifyError(f"the torch probe answered {key!r} as {shown(value)}, which is not a version", kind="probe")
    return value


def _strings(answer, key, *, required=False, pattern=None):
    value = _typed(answer, key, (list,), [], required=required)
    if value is None or len(value) > MAX_ITEMS or not all(isinstance(v, str) for v in value):
        raise VerifyError(
            f"the torch probe answered {key!r} that is not a list of at most {MAX_ITEMS} strings", kind="probe"
        )
    if pattern is not None and not all(pattern.match(v) for v in value):
        raise VerifyError(
            f"the torch probe answered {key!r} with an entry that does not fit {pattern.pattern}", kind="probe"
        )
    return [v[:300] for v in value]


def check_torch_answer(answer):
    """The torch probe's JSON answer (tests/fixtures/h200/torch_facts.json is one), shape-checked, normalized.

    ``{"torch": "2.11.0+cu130", "cuda": "13.0", "available": true, "count": 1, "names": ["NVIDIA H200"],
    "cudnn": 91900, "dist_version": "2.11.0", "triton": "3.6.0"}`` -> ``{"version": "2.11.0+cu130", "cuda":
    "13.0", "available": True, "device_count": 1, "device_names": ["NVIDIA H200"], "cudnn": 91900, ...,
    "failure": None}``. A key of the wrong type, a version that is not one, too many items: VerifyError.
    """
    if not isinstance(answer, dict):
        raise VerifyError(f"the torch probe answered {type(answer).__name__}, not an object", kind="probe")
    error = _typed(answer, "error", (str,))
    phase = _typed(answer, "error_phase", (str,))
    if phase not in (None, "import", "cuda"):
        raise VerifyError(f"the torch probe answered 'error_phase' as {shown(phase)}", kind="probe")
    imported = phase != "import"
    facts = {
        "version": _version(answer, "torch", required=imported),
        "cuda": _version(answer, "cuda", CUDA_VERSION, required=imported),
        "available": _typed(answer, "available", (bool,), required=imported),
        "device_count": _typed(answer, "count", (int,), required=imported),
        "device_names": _strings(answer, "names", required=imported),
        "cudnn": _typed(answer, "cudnn", (int,)),
        "dist_version": _version(answer, "dist_version"),
        "triton": _version(answer, "triton"),
        "error": error[:1000] if error else None,
        "error_phase": phase,
        "warnings": _strings(answer, "warnings"),
        "devices": _strings(answer, "devices", pattern=DEVICE),
        # Set but empty hides every GPU: "" is a value here, not "unset".
        "cuda_visible_devices": _typed(answer, "cuda_visible_devices", (str,)),
        "python_version": _version(answer, "python"),
        "seconds": _typed(answer, "seconds", (int, float)),
        "failure": "import" if phase == "import" else None,
    }
    if imported and facts["version"] is None:
        raise VerifyError("the torch probe answered no torch version and no import error", kind="probe")
    if facts["available"] and facts["device_count"] is None:
        raise VerifyError("the torch probe answered CUDA available without a device count", kind="probe")
    if facts["cuda_visible_devices"] is not None:
        facts["cuda_visible_devices"] = facts["cuda_visible_devices"][:300]
    return facts


def torch_failure(failure, message, timeout):
    """The torch facts of a probe that gave no answer: ``not_found`` (no venv python), ``timeout``, ``crashed``."""
    facts = dict.fromkeys(TORCH_KEYS)
    facts.update(device_names=[], warnings=[], devices=[], failure=failure, error=message, timeout=timeout)
    return facts


TORCH_KEYS = (
    "python",
    "version",
    "cuda",
    "available",
    "device_count",
    "device_names",
    "cudnn",
    "dist_version",
    "triton",
    "error",
    "error_phase",
    "warnings",
    "devices",
    "cuda_visible_devices",
    "python_version",
    "seconds",
    "failure",
    "timeout",
)


def torch_answer(rc, stdout, stderr, *, truncated=False, timeout=None):
    """What the venv's python printed, as checked torch facts (:func:`check_torch_answer`).

    A python that died (an exit code other than 0: a crash in a CUDA library) gives facts with ``failure``
    "crashed" and the last line of its stderr, quoted; an answer that is too long or not JSON is a VerifyError.
    """
    if rc != 0:
        last = next((line.strip() for line in reversed((stderr or "").splitlines()) if line.strip()), "")
        signal = f" (signal {-rc})" if rc < 0 else (f" (signal {rc - 128})" if rc > 128 else "")
        said = f": {shown(last)}" if last else ""
        return torch_failure("crashed", f"exit {rc}{signal}{said}", timeout)
    if truncated or len(stdout.encode()) > MAX_OUTPUT:
        raise VerifyError(f"the torch probe answered more than {MAX_OUTPUT} bytes", kind="probe")
    try:
        # The last line: the venv's site runs before the program, and a .pth file may print (probe.main).
        answer = json.loads(stdout.strip().rsplit("\n", 1)[-1])
    except ValueError:
        raise VerifyError(
            f"the torch probe printed no JSON answer: {shown(stdout.strip()) if stdout.strip() else 'nothing'}",
            kind="probe",
            stderr=stderr,
        ) from None
    return dict(check_torch_answer(answer), timeout=timeout)
