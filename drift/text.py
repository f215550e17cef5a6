# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Text a container chose, made one safe line before the runner shows it (the journal, the summary's reasons).

The escaper is the project's one, ``plugins/module_utils/node/text.py`` ``printable`` (drift/__init__.py puts the
collection on the path).
"""

from __future__ import annotations

from ansible_collections.pve_gpu.recover.plugins.module_utils.node.text import printable


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
