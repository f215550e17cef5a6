# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Text a container chose, made one safe line before the runner shows it (the journal, the summary's reasons).

The escaper is the project's one, ``module_utils/pve_text.py`` ``printable``: loaded from this checkout by path,
since the runner is plain Python on the controller where ``ansible.module_utils`` does not hold the project's files.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PVE_TEXT = Path(__file__).resolve().parent.parent / "module_utils" / "pve_text.py"


def _load(path=PVE_TEXT):
    spec = importlib.util.spec_from_file_location("pve_gpu_recover_pve_text", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


printable = _load().printable


def shown(text):
    """``text`` as it is when every character shows as itself on one line, else :func:`printable`'s escape of it.

    Text a module already escaped is printable and stays as it is (never escaped twice); raw text with a newline,
    a terminal escape or a bidi override is escaped whole.
    """
    text = str(text)
    return text if text.isprintable() else printable(text)


def one_line(text, limit=500):
    """``"boom\\n on two lines"`` -> ``"boom\\\\n on two lines"``: one line that shows what was there (see
    :func:`shown`), outer whitespace stripped, cut to ``limit`` characters."""
    text = shown(str(text).strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."
