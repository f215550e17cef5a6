# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Training venv probe: what is installed in the venv, read from its files alone.

In a CT this file's source is fed to the CT's python3 on stdin by ``Target.run_probes`` (one ``pct exec``);
on a bare host ``probe()`` runs in the module's own process. So: standard library only, Python 3.9+, no
imports from ansible, and the answer is plain JSON.

It never runs the venv's python and never imports torch (``import torch`` takes seconds on a real node): it
reads ``pyvenv.cfg``, the header of each distribution's METADATA (PKG-INFO for an .egg-info) and
``torch/version.py``, which it parses with regular expressions (never exec: the venv is untrusted input).
It only reads; the module decides what is wrong.
"""

import os
import re
import time

# torch/version.py assigns plain literals (`cuda: Optional[str] = '12.8'`, `debug = False`); an annotation may
# sit between the name and the `=`.
_ASSIGNMENT = re.compile(r"^(\w+)\s*(?::[^=\n]*)?=\s*(.+?)\s*$", re.MULTILINE)
_STRING = re.compile(r"""^(?:'([^'\\]*)'|"([^"\\]*)")$""")
TORCH_VERSION_KEYS = {"__version__": "version", "cuda": "cuda", "git_version": "git_version"}
TORCH_VERSION_KEYS.update({"hip": "hip", "rocm": "rocm", "xpu": "xpu", "debug": "debug"})
_PYTHON_MINOR = re.compile(r"^(\d+)\.(\d+)")
_LIB_PYTHON = re.compile(r"^python(\d+\.\d+)$")


def _read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def _pyvenv(text):
    """``pyvenv.cfg`` as a dict: ``home = /usr/bin`` -> ``{"home": "/usr/bin"}`` (keys lower-cased)."""
    config = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and not key.lstrip().startswith("#"):
            config[key.strip().lower()] = value.strip()
    return config


def _minor(version):
    """``3.11.2`` or ``3.11.2.final.0`` -> ``3.11``; anything else -> None."""
    match = _PYTHON_MINOR.match(version or "")
    return f"{match.group(1)}.{match.group(2)}" if match else None


def _header(path):
    """Name and Version of a METADATA / PKG-INFO file, reading only its header (up to the first blank line).

    Stops as soon as both are known: they are the second and third lines of every real METADATA, and the
    long description after the header can be megabytes. None when the file cannot be read.
    """
    found = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if not line.strip():
                    break
                key, sep, value = line.partition(":")
                key = key.lower()
                if sep and key in ("name", "version") and key not in found:
                    found[key] = value.strip()
                    if len(found) == 2:
                        break
    except OSError:
        return None
    return found


def _distribution(site_packages, entry):
    """One installed distribution from its record directory (or egg-info file), or ``(None, why broken)``."""
    record = os.path.join(site_packages, entry)
    if entry.endswith(".egg-info") and not os.path.isdir(record):
        metadata, names = record, ()  # a distutils install writes the egg-info as one file
    else:
        try:
            names = os.listdir(record)
        except OSError as error:
            return None, f"unreadable: {error.strerror}"
        metadata_name = "METADATA" if entry.endswith(".dist-info") else "PKG-INFO"
        if metadata_name not in names:
            return None, f"no {metadata_name}"
        metadata = os.path.join(record, metadata_name)
    header = _header(metadata)
    if header is None:
        return None, "its metadata cannot be read"
    if not header.get("name") or not header.get("version"):
        return None, "its metadata has no Name or no Version"
    installer = _read(os.path.join(record, "INSTALLER")) if "INSTALLER" in names else None
    return {
        "name": header["name"],
        "version": header["version"],
        "installer": installer.strip() if installer else None,
        "direct_url": "direct_url.json" in names,  # installed from a path or URL, not an index
    }, None


def _literal(text):
    """A version.py value: a quoted string, None, True or False; anything else is kept as its source text."""
    match = _STRING.match(text)
    if match:
        return match.group(1) if match.group(1) is not None else match.group(2)
    return {"None": None, "True": True, "False": False}.get(text, text)


def parse_torch_version_py(text):
    """``__version__ = '2.11.0+cu130'\\ncuda: Optional[str] = '13.0'`` -> ``{"version": "2.11.0+cu130",
    "cuda": "13.0", "git_version": None, "hip": None, "rocm": None, "xpu": None, "debug": None}``."""
    found = dict.fromkeys(TORCH_VERSION_KEYS.values())
    for name, value in _ASSIGNMENT.findall(text):
        if name in TORCH_VERSION_KEYS:
            found[TORCH_VERSION_KEYS[name]] = _literal(value)
    return found


def _site_packages(path, python):
    """The venv's site-packages (the one of its python minor) and every lib/pythonX.Y found."""
    lib = os.path.join(path, "lib")
    try:
        minors = sorted(m.group(1) for m in map(_LIB_PYTHON.match, os.listdir(lib)) if m)
    except OSError:
        minors = []
    if python is None and len(minors) == 1:
        python = minors[0]
    chosen = os.path.join(lib, f"python{python}", "site-packages") if python in minors else None
    return chosen, minors, python


def probe(payload):
    """Answer ``{"path": venv, "timeout": s}`` with the venv's interpreter, distributions and torch build.

    ``{"path", "exists" (pyvenv.cfg read), "directory" (the path is a directory), "real_path" (where it resolves,
    only when it exists), "python" ("3.11"),
    "pyvenv" ({key: value}), "interpreter" ({"path", "exists"}), "lib_pythons" (["3.11"]), "site_packages",
    "distributions" ([{"name", "version", "installer", "direct_url"}]), "broken" ([{"record", "reason"}]),
    "torch_version_py" (parse_torch_version_py() or None), "errors" (what could not be read)}``.
    """
    path = payload["path"]
    deadline = time.monotonic() + float(payload.get("timeout", 60))
    answer = {
        "path": path,
        "exists": False,
        "directory": os.path.isdir(path),
        "python": None,
        "pyvenv": None,
        "interpreter": None,
        "lib_pythons": [],
        "site_packages": None,
        "distributions": [],
        "broken": [],
        "torch_version_py": None,
        "errors": [],
    }
    text = _read(os.path.join(path, "pyvenv.cfg"))
    if text is None:
        return answer
    pyvenv = _pyvenv(text)
    interpreter = os.path.join(path, "bin", "python")
    answer.update(
        exists=True,
        # Where the venv really is (a version behind the symlink): the node compares the files processes run from
        # with it (an unattended run swaps no venv a live process runs from).
        real_path=os.path.realpath(path),
        pyvenv=pyvenv,
        # A venv's bin/python links to its base interpreter; a dangling link means that python is gone.
        interpreter={"path": os.path.realpath(interpreter), "exists": os.path.exists(interpreter)},
    )
    site_packages, minors, python = _site_packages(path, _minor(pyvenv.get("version") or pyvenv.get("version_info")))
    answer.update(python=python, lib_pythons=minors, site_packages=site_packages)
    if site_packages is None:  # a venv without its site-packages is broken, not unreadable: a rebuild fixes it
        answer["broken"].append({"record": f"lib/python{python or 'X.Y'}/site-packages", "reason": "missing"})
        return answer
    try:
        entries = sorted(e for e in os.listdir(site_packages) if e.endswith((".dist-info", ".egg-info")))
    except OSError as error:
        answer["errors"].append(f"cannot list {site_packages}: {error.strerror}")
        return answer
    for done, entry in enumerate(entries):
        if time.monotonic() >= deadline:
            answer["errors"].append(
                f"stopped after {payload.get('timeout')} s having read {done} of {len(entries)} records "
                f"in {site_packages}"
            )
            break
        found, reason = _distribution(site_packages, entry)
        if found is None:
            answer["broken"].append({"record": entry, "reason": reason})
        else:
            answer["distributions"].append(found)
    torch_version = _read(os.path.join(site_packages, "torch", "version.py"))
    if torch_version is not None:
        answer["torch_version_py"] = parse_torch_version_py(torch_version)
    return answer
