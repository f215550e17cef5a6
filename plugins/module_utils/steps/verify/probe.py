# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Verify probe: what the venv's torch says about itself, read two ways. Standard library only, Python 3.9+.

* ``probe(payload)``, the fact pass's part: the CT's python3 runs it (its source on stdin, next to the other
  steps' parts, one ``pct exec``); on a bare host it runs in the module's own process. It reads the venv's
  ``torch/version.py`` AS TEXT (``ct_venv.assignments``, never exec: the venv is untrusted input), which is what
  ``torch.__version__`` and ``torch.version.cuda`` will say, without the seconds ``import torch`` costs.
* run as a script by the venv's OWN python (``<venv>/bin/python -I -B -`` with this source on stdin: no bytecode
  is written, so a verify leaves the venv's files as they were; the verify module does it, through Target, with
  a deadline): :func:`torch_facts` imports torch and asks CUDA, all in one process - torch.__version__,
  torch.version.cuda, torch.cuda.is_available(), device_count(), the device names, torch.backends.cudnn.version(),
  triton's version (from its metadata, never imported), plus what explains a failure (the warnings CUDA's
  initialization raised, the /dev/nvidiaN nodes, CUDA_VISIBLE_DEVICES). Anything torch or CUDA prints goes to
  stderr; stdout carries only the JSON answer, every string in it shortened.

It only reads; the module decides what is wrong.
"""

import os
import sys
import time

try:  # shipped with this part in the fact pass (SHARED); the venv's own python running torch_facts() lacks it
    from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import venv as ct_venv
except ImportError:
    ct_venv = None

SHARED = (ct_venv,) if ct_venv else ()  # container-side modules Target.run_probes ships with this part

TORCH_VERSION_KEYS = {"__version__": "version", "cuda": "cuda", "git_version": "git_version"}
DEVICE_GLOB = "/dev/nvidia[0-9]*"
TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton")
SHORT = 300  # characters kept of an error or warning
MAX_WARNINGS = 10
MAX_DEVICES = 64


# -- the fact pass's part: torch/version.py as text ------------------------------------------------------------
def parse_torch_version_py(text):
    """``__version__ = '2.11.0+cu130'\\ncuda: Optional[str] = '13.0'`` -> ``{"version": "2.11.0+cu130", "cuda":
    "13.0", "git_version": None}``; a value that is not a plain, non-empty string literal is None."""
    return ct_venv.read_version_py(text, TORCH_VERSION_KEYS, lambda source: ct_venv.string_literal(source) or None)


def site_packages(venv):
    """The venv's site-packages directory (ct_venv.site_packages: the one of the minor its pyvenv.cfg names,
    or the only lib/pythonX.Y's when it names none), or None."""
    config = ct_venv.read_config(ct_venv.read_small_text(os.path.join(venv, "pyvenv.cfg")) or "")
    return ct_venv.site_packages(venv, ct_venv.config_minor(config))[0]


def probe(payload):
    """Answer ``{"venv": "/opt/venvs/train"}`` with what its torch says without importing it.

    ``{"venv", "exists" (pyvenv.cfg read), "python" (bin/python exists), "site_packages", "torch_version_py"
    (parse_torch_version_py() of torch/version.py, or None when there is none), "unsafe"
    (``ct_venv.venv_unsafe``)}``.
    """
    venv = payload["venv"]
    answer = {
        "venv": venv,
        "exists": os.path.isfile(os.path.join(venv, "pyvenv.cfg")),
        "python": os.path.exists(os.path.join(venv, "bin", "python")),
        "site_packages": None,
        "torch_version_py": None,
        # Why a user other than root could change the venv, whose python the verify module runs as root: the
        # fact pass makes it a problem, so verify is never pending and that python never runs.
        "unsafe": ct_venv.venv_unsafe(venv),
    }
    found = site_packages(venv)
    if found is None:
        return answer
    answer["site_packages"] = found
    text = ct_venv.read_small_text(os.path.join(found, "torch", "version.py"))
    if text is not None:
        answer["torch_version_py"] = parse_torch_version_py(text)
    return answer


# -- the venv's own python: import torch, ask CUDA -------------------------------------------------------------
def short(text):
    """One line of at most SHORT characters: what the answer keeps of an error or a warning."""
    line = " ".join(str(text).split())
    return line if len(line) <= SHORT else line[: SHORT - 3] + "..."


def _distribution_version(names):
    """The version of the first of ``names`` that is installed (its metadata only: nothing is imported)."""
    # Imported here, in the venv's own python: importlib.metadata pulls in email, zipfile and csv, which the fact
    # pass would otherwise pay for in every CT on every run without using them (so are glob, json and warnings).
    from importlib import metadata  # noqa: PLC0415 (see above)

    for name in names:
        try:
            version = metadata.version(name)
        except Exception:  # not installed, or its metadata is broken: not ours to judge here
            version = None
        if version:
            return version
    return None


def torch_facts():
    """``{"torch", "cuda", "available", "count", "names", "cudnn", "dist_version", "triton", "error",
    "error_phase" ("import" or "cuda"), "warnings", "devices", "cuda_visible_devices", "python", "seconds"}``.

    The first eight keys are those of tests/fixtures/h200/torch_facts.json (a real H200 capture). Nothing here
    raises: what fails is recorded as ``error`` (its phase says whether torch could be imported at all).
    """
    import glob  # noqa: PLC0415 (see _distribution_version)
    import warnings  # noqa: PLC0415 (see _distribution_version)

    started = time.monotonic()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    answer = {
        "torch": None,
        "cuda": None,
        "available": None,
        "count": None,
        "names": [],
        "cudnn": None,
        "dist_version": _distribution_version(("torch",)),
        "triton": _distribution_version(TRITON_DISTRIBUTIONS),
        "error": None,
        "error_phase": None,
        "warnings": [],
        "devices": sorted(glob.glob(DEVICE_GLOB))[:MAX_DEVICES],
        "cuda_visible_devices": short(visible) if visible is not None else None,
        "python": sys.version.split()[0],
        "seconds": None,
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            import torch  # noqa: PLC0415 (imported here, in the venv's own python, and only here)
        except Exception as error:  # ImportError, OSError of a missing CUDA library, anything torch raises
            answer.update(error=short(f"{type(error).__name__}: {error}"), error_phase="import")
        else:
            answer["torch"] = str(torch.__version__)
            answer["cuda"] = torch.version.cuda
            try:
                answer["cudnn"] = torch.backends.cudnn.version()
            except Exception:  # a missing cuDNN is CUDA's failure to report below, not the answer's
                answer["cudnn"] = None
            try:
                answer["available"] = bool(torch.cuda.is_available())
                answer["count"] = int(torch.cuda.device_count())
                if answer["available"]:
                    answer["names"] = [
                        str(torch.cuda.get_device_name(i)) for i in range(min(answer["count"], MAX_DEVICES))
                    ]
            except Exception as error:
                answer.update(error=short(f"{type(error).__name__}: {error}"), error_phase="cuda")
    answer["warnings"] = [short(w.message) for w in caught[:MAX_WARNINGS]]
    answer["seconds"] = round(time.monotonic() - started, 3)
    return answer


def main():
    """Run as the venv's python: the answer on stdout, everything else (torch's, CUDA's) on stderr."""
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)  # file descriptor level: a C library writing to stdout lands on stderr too
    try:
        answer = torch_facts()
    finally:
        sys.stdout.flush()
        os.dup2(real_stdout, 1)
        os.close(real_stdout)
    import json  # noqa: PLC0415 (see _distribution_version)

    # On a line of its own: the venv's site (a package's .pth file) may have printed before this program ran.
    sys.stdout.write("\n" + json.dumps(answer))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
