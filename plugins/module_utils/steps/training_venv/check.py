# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Container side, the venv build's check of a new version and its record of an old one: what a version holds, read
from its files (:func:`read_venv`, the same reading as the fact pass's probe part), how it differs from the lock
(:func:`differences`) and its freeze (:func:`freeze_text`).

Shipped with the build script (its ``SHARED``) and imported on a node as any module_util: standard library only,
Python 3.9+, nothing of ours but ct_venv (shipped too).
"""

import os

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import venv as ct_venv

SHARED = (ct_venv,)


def differences(expected, installed, ignore):
    """What keeps ``installed`` from being exactly ``expected`` (versions compared as strings), one line each.

    ``differences({"torch": "2.11.0+cu128", "six": "1.17.0"}, {"torch": "2.11.0+cu130", "pip": "25.2"}, ["pip"])``
    -> ``["torch 2.11.0+cu130, expected 2.11.0+cu128", "six 1.17.0 is missing"]``.
    """
    lines = [
        f"{name} {installed[name]}, expected {version}"
        for name, version in sorted(expected.items())
        if name in installed and installed[name] != version
    ]
    lines += [f"{name} {expected[name]} is missing" for name in sorted(set(expected) - set(installed))]
    extra = set(installed) - set(expected) - set(ignore)
    lines += [f"{name} {installed[name]} is not in the lock" for name in sorted(extra)]
    return lines


def freeze_text(versions):
    """``{"torch": "2.11.0+cu128", "six": "1.17.0"}`` -> ``"six==1.17.0\\ntorch==2.11.0+cu128\\n"``."""
    lines = [f"{name}=={one}" for name, joined in versions.items() for one in joined.split(", ")]
    return "".join(f"{line}\n" for line in sorted(lines))


def read_venv(venv, python=None):
    """What a venv holds, from its files: ``{"records": [(name, version)], "broken": [record], "torch_build"}``.

    ``python`` ("3.11") picks its site-packages; None reads every ``lib/pythonX.Y/site-packages``.
    """
    lib = os.path.join(venv, "lib")
    records, broken, torch_build = [], [], None
    for minor in [python] if python else ct_venv.lib_minors(venv):
        site = os.path.join(lib, f"python{minor}", "site-packages")
        try:
            entries = sorted(e for e in os.listdir(site) if e.endswith((".dist-info", ".egg-info")))
        except OSError:
            continue
        for entry in entries:
            record = os.path.join(site, entry)
            if os.path.isdir(record):
                metadata = os.path.join(record, "METADATA" if entry.endswith(".dist-info") else "PKG-INFO")
            else:
                metadata = record  # a distutils egg-info is one file
            header = ct_venv.metadata_header(metadata)
            if header and header.get("name") and header.get("version"):
                records.append((header["name"], header["version"]))
            else:
                broken.append(entry)
        text = ct_venv.read_small_text(os.path.join(site, "torch", "version.py")) or ""
        version = ct_venv.read_version_py(text, {"__version__": "version"}, ct_venv.string_literal)["version"]
        torch_build = version or torch_build
    return {"records": records, "broken": broken, "torch_build": torch_build}
