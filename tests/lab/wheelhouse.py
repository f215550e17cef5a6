# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Real wheels, PEP 503 indexes and hashed lock files for the venv tests (test code, standard library only).

* :func:`build_wheel` makes a small but valid wheel (METADATA, WHEEL, RECORD with hashes) of any name and version,
  e.g. ``torch 2.11.0+cu128`` whose ``torch/version.py`` reads like the real build's: what the venv step needs to
  tell build variants apart, without a multi-GB download. Importing its package raises, so a test that passes
  proves nothing imported it.
* :func:`write_index` lays out a PEP 503 "simple" index (``<root>/simple/<project>/index.html`` linking
  ``<root>/files/<wheel>#sha256=...``) that any static HTTP server serves to uv and pip.
* :func:`lock_text` writes a lock as ``uv pip compile --generate-hashes`` does: uv's header, the index options,
  ``name==version`` pins with ``--hash=sha256:...`` of every wheel.
"""

from __future__ import annotations

import base64
import hashlib
import html
import os
import re
import shutil
import zipfile
from pathlib import Path

GUARD = 'raise ImportError("pve-gpu-recover test wheel: nothing may import it")\n'


def canonical_name(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def torch_version_py(version, cuda=None):
    """``torch/version.py`` as a torch build of ``version`` ships it (cuda None for +cpu)."""
    return (
        "from typing import Optional\n\n"
        "__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'xpu']\n"
        f"__version__ = '{version}'\n"
        "debug = False\n"
        f"cuda: Optional[str] = {cuda!r}\n"
        "git_version = '0000000000000000000000000000000000000000'\n"
        "hip: Optional[str] = None\n"
        "xpu: Optional[str] = None\n"
    )


def build_wheel(directory, name, version, files=None, *, requires=(), padding=0):
    """A py3-none-any wheel of ``name`` ``version`` in ``directory``; returns its path.

    ``files`` maps paths inside the wheel to text (default: the package's ``__init__.py`` that refuses import);
    ``padding`` adds that many bytes of incompressible data (a wheel that takes a while to download, or fills a
    small disk).
    """
    module = canonical_name(name).replace("-", "_")
    files = dict(files or {f"{module}/__init__.py": GUARD})
    if padding:
        files[f"{module}/_padding.bin"] = os.urandom(padding)
    dist_info = f"{module}-{version}.dist-info"
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    metadata += [f"Requires-Dist: {requirement}" for requirement in requires]
    files[f"{dist_info}/METADATA"] = "\n".join(metadata) + "\n\n"
    files[f"{dist_info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: pve-gpu-recover-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for inner, content in files.items():
        data = content.encode() if isinstance(content, str) else content
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{inner},sha256={digest},{len(data)}")
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = "\n".join(record) + "\n"
    path = Path(directory) / f"{module}-{version}-py3-none-any.whl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for inner, content in files.items():
            wheel.writestr(inner, content)
    return path


def wheel_project(path):
    """The canonical project name of a wheel file: ``torch-2.11.0+cu128-py3-none-any.whl`` -> ``torch``."""
    return canonical_name(Path(path).name.split("-", 1)[0])


def write_index(root, wheels):
    """A PEP 503 simple index of ``wheels`` under ``root`` (wheels are hard-linked or copied into root/files)."""
    root = Path(root)
    (root / "files").mkdir(parents=True, exist_ok=True)
    projects = {}
    for wheel in map(Path, wheels):
        target = root / "files" / wheel.name
        if not target.exists():
            try:
                os.link(wheel, target)
            except OSError:
                shutil.copy2(wheel, target)
        projects.setdefault(wheel_project(wheel), []).append(target)
    (root / "simple").mkdir(exist_ok=True)
    links = "".join(f'<a href="{p}/">{p}</a>\n' for p in sorted(projects))
    (root / "simple" / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    for project, files in projects.items():
        page = root / "simple" / project
        page.mkdir(exist_ok=True)
        anchors = "".join(
            f'<a href="../../files/{html.escape(f.name)}#sha256={sha256(f)}">{html.escape(f.name)}</a>\n'
            for f in sorted(files)
        )
        (page / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{anchors}</body></html>\n")
    return root


def lock_text(pins, *, index_url, extra_index_urls=(), python_version="3.11"):
    """A lock as ``uv pip compile --generate-hashes`` writes it.

    ``pins``: ``[(name, version, [wheel files])]``; every file's sha256 becomes a ``--hash`` line.
    """
    lines = [
        "# This file was autogenerated by uv via the following command:",
        f"#    uv pip compile --generate-hashes --python-version {python_version} requirements.in -o requirements.lock",
        f"--index-url {index_url}",
        *(f"--extra-index-url {url}" for url in extra_index_urls),
        "",
    ]
    for name, version, wheels in sorted(pins, key=lambda pin: canonical_name(pin[0])):
        hashes = [f"    --hash=sha256:{sha256(w)}" for w in wheels]
        lines.append(" \\\n".join([f"{canonical_name(name)}=={version}", *hashes]))
    return "\n".join(lines) + "\n"
