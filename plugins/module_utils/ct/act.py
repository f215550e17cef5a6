# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Container side, shared: how an acting script fails and what of a command's output its answer carries.

The acting scripts (compile cache, training code, training venv) import it (``SHARED``): ``Target.run_probes``
ships its source with theirs in the same ``pct exec``, and on a node it is imported as usual. So: standard
library only, Python 3.9+, nothing of ours imported.
"""

import errno

TAIL_CHARS = 4000
MASK = "********"  # what a secret becomes in an answer (Ansible's own no_log mask)
# A URL's scheme (RFC 3986): a letter, then letters, digits, "+", "." or "-".
_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_SCHEME = _LETTERS | frozenset("0123456789+.-")


class ActError(Exception):
    """One failure of an acting script: ``kind`` for code, the message for people, the command when one ran."""

    def __init__(self, kind, message, *, cmd=None, rc=None, stdout="", stderr=""):
        super().__init__(message)
        self.kind = kind
        self.cmd = cmd
        self.rc = rc
        self.stdout = stdout
        self.stderr = stderr


def tail(text, lines):
    """The last ``lines`` lines of ``text``, at most TAIL_CHARS characters (the answer travels as one JSON line)."""
    return "\n".join((text or "").rstrip("\n").splitlines()[-lines:])[-TAIL_CHARS:]


def failure(error, lines):
    """``{"error", "message", "cmd", "rc", "stdout_tail", "stderr_tail"}`` of an answer for ``error``: an ActError
    (its command's last ``lines`` lines), or an OSError (``no_space`` when the file system is full, else
    ``os_error``, with the file it names)."""
    if isinstance(error, ActError):
        found = {"error": error.kind, "message": str(error), "cmd": error.cmd, "rc": error.rc}
        return dict(found, stdout_tail=tail(error.stdout, lines), stderr_tail=tail(error.stderr, lines))
    kind = "no_space" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "os_error"
    where = f" ({error.filename})" if error.filename else ""
    found = {"error": kind, "message": f"{error.strerror or error}{where}", "cmd": None, "rc": None}
    return dict(found, stdout_tail="", stderr_tail="")


def redact(text, secrets=()):
    """``text`` without the credentials in it: each of ``secrets`` (passwords, secret environment values) and the
    user information of any URL replaced by MASK, so that what a tool printed (uv, pip, a proxy's error) can go
    into an answer, a report and a log.

    ``redact("Failed to fetch https://bob:t0ken@idx/simple (proxy http://u:p@proxy:3128)", ["t0ken"])`` ->
    ``"Failed to fetch https://********@idx/simple (proxy http://********@proxy:3128)"``; None stays None.
    """
    if not isinstance(text, str):
        return text
    for secret in sorted({s for s in secrets if isinstance(s, str) and s}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return mask_userinfo(text)


def mask_userinfo(text):
    """``text`` with the user information of every URL in it (``scheme://userinfo@``: up to the first ``@``, never
    past a ``/`` or a space) replaced by MASK. In linear time: what it reads is a target's untrusted output, up to
    MBs (a backtracking pattern took seconds on 20 KB of letters)."""
    kept, done = [], 0
    found = text.find("://")
    while found != -1:
        start = found + 3
        end = start
        while end < len(text) and text[end] not in "/@" and not text[end].isspace():
            end += 1
        first = found
        while first > done and text[first - 1] in _SCHEME:
            first -= 1
        while first < found and text[first] not in _LETTERS:
            first += 1
        if first < found and end > start and end < len(text) and text[end] == "@":
            kept += [text[done:start], MASK, "@"]
            done = end + 1
        found = text.find("://", max(found + 1, done))
    kept.append(text[done:])
    return "".join(kept)


def redact_answer(answer, secrets=()):
    """An acting script's answer with :func:`redact` applied to every string in it (the command's argv included)."""
    if isinstance(answer, dict):
        return {key: redact_answer(value, secrets) for key, value in answer.items()}
    if isinstance(answer, list):
        return [redact_answer(value, secrets) for value in answer]
    return redact(answer, secrets)
