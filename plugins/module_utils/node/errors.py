# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The project's one exception type: what failed, what was found, the hint, and the command where one ran.

Every module's ``main()`` has one ``except RecoverError as error: module.fail_json(**error.to_result())``.
Helpers raise it (or a subclass that only names its ``kind`` family) with plain values, never with ``module``.
"""

from __future__ import annotations


def tail(text, lines=20):
    """The last ``lines`` lines of ``text`` (what fail_json shows of a long stderr)."""
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


class RecoverError(Exception):
    """One line for people (``str(error)``), the rest in separate keys of the failed result.

    ``kind`` is stable for code and tests; ``hint`` is what to do; ``cmd``/``rc``/``stdout``/``stderr`` describe
    the command that failed, when one ran; ``details`` are step facts that go along (what was already ended).
    """

    # How ``kind`` is spelled in the result's ``error`` key (a subclass may prefix its family).
    error_prefix = ""

    def __init__(self, message, *, kind, hint=None, cmd=None, rc=None, stdout=None, stderr=None, details=None):
        super().__init__(message)
        self.kind = kind
        self.hint = hint
        self.cmd = cmd
        self.rc = rc
        self.stdout = stdout
        self.stderr = stderr
        self.details = details or {}

    def to_result(self, prefix=""):
        """Keyword arguments for ``module.fail_json``: msg first, then the raw facts in separate keys.

        ``prefix`` (the target's label) starts the message unless it already does.
        """
        message = str(self) if str(self).startswith(prefix) else f"{prefix}{self}"
        result = {"msg": message + (f"; {self.hint}" if self.hint else ""), "error": self.error_prefix + self.kind}
        if self.cmd is not None:
            result["cmd"] = [str(a) for a in self.cmd]
        if self.rc is not None:
            result["rc"] = self.rc
        for key in ("stdout", "stderr"):
            text = getattr(self, key)
            if text:
                result[f"{key}_tail"] = tail(text)
        result.update(self.details)
        return result
