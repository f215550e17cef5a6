# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Text a container chose, made safe to show: the one place that escapes it.

A CT (and in bare mode any non-root user) picks process names, command lines, file names and branch names. Shown
raw, a newline forges a line in ``--diff`` output or the journal and an escape sequence rewrites the terminal. Every
message, diff line and report field that carries such text passes it through :func:`printable` first.
"""

from __future__ import annotations

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def printable(text, limit=None):
    """``text`` with every control character written as an escape (``\\n``, ``\\x1b``, ``\\u202e``) and backslashes
    doubled, so the result is one line that shows exactly what was there; cut to ``limit`` characters (plus ``...``)
    when given. Bytes are decoded as UTF-8 with undecodable bytes escaped; None stays None."""
    if text is None:
        return None
    if isinstance(text, bytes):
        text = text.decode("utf-8", "backslashreplace")
    elif not isinstance(text, str):
        text = str(text)
    out = []
    for char in text:
        if char in _NAMED:
            out.append(_NAMED[char])
        elif not char.isprintable():
            # C0/C1 controls, DEL, line and paragraph separators, bidi overrides, zero-width and other format or
            # separator characters: anything that is not plainly itself on one line.
            out.append(f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")
        else:
            out.append(char)
    escaped = "".join(out)
    if limit is not None and len(escaped) > limit:
        return escaped[:limit] + "..."
    return escaped
