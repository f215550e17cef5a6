# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Training venv build: build the locked venv beside the old one, check it, swap it in atomically. It ACTS.

Unlike a probe part, ``probe(payload)`` here changes the target. It is called the same way so that it costs one
``pct exec``: ``Target.run_probe``/``run_probes`` ship this file's source to the target's python on stdin; on a bare
host ``probe()`` runs in the module's own process. So: standard library only, Python 3.9+, nothing of ours but the
container-side modules of ``SHARED`` (the module parses the lock and sends what it means as data), the answer is
plain JSON.

Layout (a venv embeds its own path, so a working venv is never moved while jobs may use it):

* every version is built at ``<path>.<stamp>`` and stays there; ``<path>`` is a symlink to the current one
  (relative: ``train -> train.20261203T101500Z``);
* while it is built, ``<path>.<stamp>/.pve-gpu-recover-building`` marks it unfinished; the marker goes only once
  the check passed. A marked ``<path>.<stamp>`` that is not the link's target is a leftover of an interrupted run
  and the next run removes it (nothing else is ever removed as a leftover);
* ``<path>.<stamp>.lock.txt`` is the lock the version was built from;
* the swap is a temporary symlink renamed over ``<path>`` (rename(2): atomic; a job sees the old or the new);
* the old venv: a version behind the link stays where it is; a real directory at ``<path>`` (made before this
  tool) is renamed to ``<path>.<stamp>-previous`` (it works again only once renamed back). Its freeze goes to
  ``<old dir>.freeze.txt`` before the swap;
* retention (``keep``): the newest ``keep`` finished versions stay, the current one counted; older ones go with
  their lock file (their freeze file stays: the record of what they held), unless a live process uses them.
  ``-previous`` directories are never removed;
* ``<path>.cache`` is the build's package cache (uv's and pip's), root's alone: uv hard-links a new version's files
  from it (the same file system), so a rebuild of cached pins downloads and copies nothing. Retention never removes
  it; past ``cache_max_bytes`` of files no kept version links, it is dropped after the build.

Names, plans and writing are layout.py's (venv_layout), the commands' environment and what their failures mean
commands.py's (venv_commands), reading a version check.py's (venv_check). Every command runs through the one runner
(ct_run.run: a session of its own, its process group killed at the build's deadline) and ends with this script
(ct_run.end_with_me): the ``timeout`` around the pct exec ends what the build started too. Wheels only (``--only-
binary``), but the packages the payload's ``build_from_source`` names: building a source distribution runs the
package's own code as root. Every interpreter of the new venv runs with ``-I``.

Any failure removes what this run built and answers ``{"error": kind, "message": sentence, "stderr_tail", "cmd",
"rc"}``; ``<path>`` is then untouched.

The build's network settings (the payload's ``network``: proxies and other variables, a CA bundle, the system's
certificates, index credentials) reach the commands' environment only (``venv_commands.network_env``); index
credentials go to a netrc file in the build's private directory (mode 0600, removed with it), never into an argv.
Every answer is masked (``ct_act.redact``: each secret, and the user information of any URL) before it leaves the
target.

Unattended (``window_check`` in the payload), the last thing before the swap is a look at the live processes: when
one runs from the current venv (a job started while the new one was built), the new version is removed, ``<path>``
is left as it was and the answer is ``{"needs_window": {"path", "users": [{"pid", "name"}]}, "cleaned",
"left_behind"}``, not an error: swapping it needs a window.
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# pylint: disable=disallowed-name

import os
import re
import shutil
import tempfile
import time

from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import act as ct_act
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import progress as ct_progress
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import run as ct_run
from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import venv as ct_venv
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import check as venv_check
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import commands as venv_commands
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.training_venv import layout as venv_layout

# Container-side modules Target.run_probes ships with this part; ct_venv decides what builds the venv, as the
# probe part's fact pass did before anything changed; ct_progress tells what a long build is at; ct_run runs every
# command.
SHARED = (ct_act, ct_progress, ct_run, ct_venv, venv_check, venv_commands, venv_layout)
TAIL_LINES = 40
PYTHON_CHECK = "import sys; print(tuple(sys.version_info[:2]))"
_PYTHON_TUPLE = re.compile(r"\((\d+), (\d+)\)")


# -- acting ----------------------------------------------------------------------------------------------------
class Build:
    """One build of ``payload``: see the module docstring for the layout it keeps."""

    def __init__(self, payload):
        self.path = os.path.normpath(str(payload["path"]))
        self.stamp = str(payload["stamp"])
        if not os.path.isabs(self.path) or self.path == "/":
            raise ct_act.ActError("invalid", f"path must be an absolute path below /, got {self.path!r}")
        if not venv_layout.STAMP.match(self.stamp):
            raise ct_act.ActError("invalid", f"stamp must look like 20261203T101500Z, got {self.stamp!r}")
        self.lock = str(payload["lock"])
        self.python = payload.get("python")
        self.uv = payload.get("uv") or "uv"
        self.keep = payload.get("keep")
        self.expected = dict(payload["expected"])
        self.ignore = list(payload.get("ignore") or [])
        self.drop_tooling = list(payload.get("drop_tooling") or [])
        # The packages that may be built from their source distribution (canonical names); none by default.
        self.build_from_source = sorted(
            {ct_venv.canonical_name(str(n)) for n in payload.get("build_from_source") or []}
        )
        self.timeout = float(payload.get("timeout", 1800))
        self.deadline = time.monotonic() + self.timeout
        self.parent = os.path.dirname(self.path)
        self.new = venv_layout.version_dir(self.path, self.stamp)
        self.lock_file = venv_layout.lock_path(self.new)
        self.cache = venv_layout.cache_dir(self.path)
        self.cache_max = payload.get("cache_max_bytes")  # None: the cache is never dropped
        self.private = None  # a root-only directory holding the lock the installer reads (made by execute)
        # A pylock.toml is read by uv only under that name (``pylock.toml`` or ``pylock.*.toml``).
        self.lock_name = "pylock.toml" if payload.get("lock_format") == "pylock" else "lock.txt"
        network = dict(payload.get("network") or {})
        self.netrc = network.get("netrc")  # index credentials, written beside the lock the installer reads
        ca_bundle = network.get("ca_bundle")
        if ca_bundle and not os.path.isfile(ca_bundle):
            raise ct_act.ActError(
                "ca_bundle",
                f"the CA bundle {ca_bundle} is not a file in the target; put the PEM file of the CA there, or fix "
                "training_venv_ca_bundle (a path inside the target)",
            )
        self.env = venv_commands.build_env(network)
        self.created = False  # this run made self.new (so a failure removes it)
        self.swapped = False  # self.new is the current venv (so nothing of it is ever removed)
        self.cleaned = []
        self.window_check = bool(payload.get("window_check"))  # unattended: never swap under a live process
        self.prune_only = bool(payload.get("prune_only"))  # in spec, only old versions beyond keep to remove
        # Told only when the module has somewhere to send it (an async job); masked as every answer is.
        secrets = [str(secret) for secret in (network.get("secrets") or [])]
        ct_progress.start(payload.get("progress"), redact=lambda text: ct_act.redact(text, secrets))

    # -- commands ------------------------------------------------------------------------------------------
    def run(self, argv, what):
        """Run ``argv`` (no shell) within the build's deadline; ct_act.ActError when it cannot start or runs out of
        time, else ``(rc, stdout, stderr)``.

        Through the one runner (ct_run.run): in a session of its own in ``/`` (no project, .python-version or
        uv.toml of some working directory is read), its whole process group killed at the deadline; ended with
        this script (ct_run.end_with_me, :func:`probe`). While it runs, ``what`` and its latest output line are
        told as progress (ct_progress.follow_output).
        """
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise ct_act.ActError("timeout", f"the build ran out of its {self.timeout:g} s before {what}", cmd=argv)
        done = ct_run.run(argv, remaining, self.env, on_output=ct_progress.follow_output(what))
        if done.get("missing"):
            raise ct_act.ActError("not_found", f"cannot run `{argv[0]}` for {what}: {done['stderr']}", cmd=argv)
        if done.get("timed_out"):
            raise ct_act.ActError(
                "timeout",
                f"{what} did not finish within the build's {self.timeout:g} s (build_timeout) and was killed",
                cmd=argv,
                stderr=done["stderr"] + done["stdout"],
            )
        return done["rc"], done["stdout"], done["stderr"]

    def must_run(self, argv, what):
        rc, out, err = self.run(argv, what)
        if rc != 0:
            kind, hint = venv_commands.classify_failure(err + out)
            if kind in ("not_on_index", "install_failed"):  # not a network's failure, which pip words alike
                self.refuse_source_build(argv, what, rc, err + out)
            line = venv_commands.failure_line(err or out)
            if kind == "tls":  # pip names the certificate only in a warning before its last error
                said = venv_commands.TLS_FAILURE.search(err + out).group(0)
                line = line if said in line else f"{line} ({said})"
            raise ct_act.ActError(
                kind, f"{what} failed (exit {rc}): {line}; {hint}", cmd=argv, rc=rc, stderr=err or out
            )
        return out

    def refuse_source_build(self, argv, what, rc, text):
        """A failed install that found only a source distribution of a pin it may not build: ActError
        ``no_wheel`` naming the package and the setting that allows it."""
        missing = venv_commands.wheel_missing(text)
        if missing is None or ct_venv.canonical_name(missing[0]) in self.build_from_source:
            return
        name, version = missing
        pip_says = "" if "sync" in argv else " (or none at all: pip does not tell them apart)"
        raise ct_act.ActError(
            "no_wheel",
            f"{what} failed (exit {rc}): {name} {version} has no wheel for this target on the lock's indexes, only a "
            f"source distribution{pip_says}; nothing is built from source as root unless it is named in "
            f"training_venv_build_from_source: add {ct_venv.canonical_name(name)} there to build it in the target, "
            "or compile the lock for a version that has a wheel for this python and platform",
            cmd=argv,
            rc=rc,
            stderr=text,
        )

    # -- the steps -----------------------------------------------------------------------------------------
    def current(self):
        """``(kind, directory)`` of ``path``: ("link", its target), ("dir", path) or ("absent", None)."""
        if os.path.islink(self.path):
            return "link", os.path.realpath(self.path)
        if os.path.isdir(self.path):
            return "dir", self.path
        if os.path.lexists(self.path):
            raise ct_act.ActError(
                "layout",
                f"{self.path} is a file, not a venv or a link to one; move it away and run again",
            )
        return "absent", None

    def clean_leftovers(self, current):
        """Remove what interrupted runs left: marked version directories, their lock files, temporary links."""
        try:
            names = os.listdir(self.parent)
        except FileNotFoundError:
            return
        entries = []
        for name in names:
            full = os.path.join(self.parent, name)
            real_dir = os.path.isdir(full) and not os.path.islink(full)
            entries.append((name, real_dir, real_dir and os.path.exists(os.path.join(full, venv_layout.MARKER))))
        for leftover in venv_layout.plan_leftovers(self.path, entries, current):
            venv_layout.remove(leftover)
            venv_layout.remove(venv_layout.lock_path(leftover))
            self.cleaned.append(leftover)
        base = re.escape(os.path.basename(self.path))
        temporary_link = re.compile(rf"^{base}\.{venv_layout.STAMP_PATTERN}\.link$")
        orphan_lock = re.compile(rf"^{base}\.{venv_layout.STAMP_PATTERN}\.lock\.txt$")
        for name in names:
            full = os.path.join(self.parent, name)
            if temporary_link.match(name) and os.path.islink(full):
                venv_layout.remove(full)  # made for a swap that never happened
            elif orphan_lock.match(name) and not os.path.isdir(full[: -len(".lock.txt")]):
                venv_layout.remove(full)  # the lock of a version that is gone

    def builder(self):
        """``("uv", path)`` when uv can be run, else ``("venv+pip", why uv is not used)`` (ct_venv.builder, what
        the fact pass's probe part found beforehand)."""
        return ct_venv.builder(self.uv, self.env.get("PATH"))

    def base_python(self):
        """The interpreter ``-m venv`` runs with: ``python3.X`` for a pinned minor, else ``python3``."""
        name = ct_venv.python_name(self.python)
        found = ct_venv.base_python(self.python, self.env.get("PATH"))
        if not found:
            raise ct_act.ActError(
                "python",
                f"{name} is not on PATH in the target; install python{self.python or '3'} there "
                "(or give the role a uv, which finds installed pythons elsewhere too)",
            )
        return found

    def make_venv_with_uv(self, uv):
        python = self.python or "python3"
        # --allow-existing: the directory exists already, holding the marker that says "unfinished".
        self.must_run([uv, "venv", "--allow-existing", "--python", python, self.new], f"`uv venv` with {python}")
        # uv runs the new venv's python with -I -B itself (its interpreter query).
        wheels_only = venv_commands.wheels_only(self.expected, self.build_from_source)
        self.prepare_cache()
        self.must_run(
            [
                uv,
                "pip",
                "sync",
                "--python",
                f"{self.new}/bin/python",
                "--require-hashes",
                *wheels_only,
                self.install_lock(),
            ],
            "installing the lock with `uv pip sync`",
        )
        version = self.must_run([uv, "--version"], "`uv --version`").split()
        return {"name": "uv", "path": uv, "version": version[1] if len(version) > 1 else None}

    def make_venv_with_pip(self, why_not_uv):
        if self.lock_name == "pylock.toml":
            raise ct_act.ActError(
                "no_builder",
                f"the lock is a pylock.toml, which only uv installs here, and there is no uv ({why_not_uv}); give the "
                "role a uv (training_venv_uv_wheel, or training_venv_uv: its path inside the target)",
            )
        python = self.base_python()
        # Without pip: venv would run the new python for ensurepip without -I; it is run next, isolated.
        what, argv = f"`{python} -m venv`", [python, "-I", "-m", "venv", "--without-pip", self.new]
        rc, out, err = self.run(argv, what)
        if rc == 0:
            what = "`python -m ensurepip` in the new venv"
            argv = [f"{self.new}/bin/python", "-I", "-m", "ensurepip", "--upgrade", "--default-pip"]
            rc, out, err = self.run(argv, what)
        if rc != 0:
            text = err + out
            if venv_commands.NO_VENV_MODULE.search(text):
                raise ct_act.ActError(
                    "no_builder",
                    f"no way to build a venv: no uv ({why_not_uv}) and `{python} -m venv` fails because "
                    f"ensurepip/venv is missing; install it in the target (`apt install python3-venv`) or give "
                    f"the role a uv (training_venv_uv: the path of uv inside the target)",
                    cmd=argv,
                    rc=rc,
                    stderr=text,
                )
            kind, hint = venv_commands.classify_failure(text)
            raise ct_act.ActError(
                kind if kind != "install_failed" else "venv_failed",
                f"{what} failed (exit {rc}): {venv_commands.failure_line(text)}; {hint}",
                cmd=argv,
                rc=rc,
                stderr=text,
            )
        pip = [f"{self.new}/bin/python", "-I", "-B", "-m", "pip"]  # -B: pip's own modules stay uncompiled, as uv
        wheels_only = venv_commands.wheels_only(self.expected, self.build_from_source)
        self.prepare_cache()
        self.must_run(
            [*pip, "install", "--no-deps", "--require-hashes", "--no-input", *wheels_only, "-r", self.install_lock()],
            "installing the lock with pip",
        )
        version = self.must_run([*pip, "--version"], "`pip --version`").split()
        present = {ct_venv.canonical_name(n) for n, _ in venv_check.read_venv(self.new)["records"]}
        drop = [name for name in self.drop_tooling if name in present]
        if drop:  # `-m venv` seeds pip/setuptools; with tooling=exact the lock decides whether they stay
            self.must_run([*pip, "uninstall", "--yes", *drop], f"removing {', '.join(drop)} (not in the lock)")
        return {
            "name": "venv+pip",
            "path": python,
            "version": version[1] if len(version) > 1 else None,
            "fallback": why_not_uv,
        }

    def check(self):
        """The new venv's interpreter runs, is the expected minor, and it holds exactly the lock."""
        # -B: the check leaves no __pycache__ behind (what runs inside a venv to look at it writes nothing).
        check = [f"{self.new}/bin/python", "-I", "-B", "-c", PYTHON_CHECK]
        out = self.must_run(check, "running the new venv's python")
        found = _PYTHON_TUPLE.search(out)
        if not found:
            raise ct_act.ActError("check", f"the new venv's python printed {out.strip()!r}, not its version")
        minor = f"{found.group(1)}.{found.group(2)}"
        if self.python and minor != self.python:
            raise ct_act.ActError("check", f"the new venv's python is {minor}, expected {self.python}")
        venv = venv_check.read_venv(self.new, minor)
        problems = [f"{record} has no readable Name/Version" for record in venv["broken"]]
        installed = ct_venv.installed_versions(venv["records"], venv["torch_build"], self.expected)
        problems += venv_check.differences(self.expected, installed, self.ignore)
        if problems:
            raise ct_act.ActError("check", f"the new venv is not the lock: {'; '.join(problems)}")
        return minor

    def save_freeze(self, old_dir, freeze_to):
        venv = venv_check.read_venv(old_dir)
        installed = ct_venv.installed_versions(venv["records"], venv["torch_build"], self.expected)
        venv_layout.write_atomic(freeze_to, venv_check.freeze_text(installed))

    def swap(self, kind, old_dir):
        """Point ``path`` at the new version; a real directory there is first renamed aside (and back on failure)."""
        link = f"{self.new}.link"
        os.symlink(os.path.basename(self.new), link)
        moved_to = None
        try:
            if kind == "dir":
                # A directory cannot be replaced by rename(2); for an instant <path> is absent (once per target).
                moved_to = venv_layout.previous_dir(self.path, self.stamp)
                os.rename(old_dir, moved_to)
            os.replace(link, self.path)
        except BaseException:
            venv_layout.remove(link)
            if moved_to and not os.path.lexists(self.path):
                os.rename(moved_to, self.path)
            raise
        venv_layout.fsync_dir(self.parent)
        return moved_to

    def retention(self, current):
        """Remove finished versions beyond ``keep`` that no live process uses (nor has as its working directory),
        never ``current``; say what was skipped.

        Runs after the swap (or alone, ``prune_only``): what fails here is reported in ``retention_skipped``, never
        as a failed build.
        """
        if self.keep is None:
            return [], []
        pattern = venv_layout.version_pattern(self.path)
        finished = []
        try:
            names = os.listdir(self.parent)
        except OSError as error:
            return [], [{"path": self.parent, "pids": [], "reason": f"cannot list: {error.strerror}"}]
        for name in names:
            full = os.path.join(self.parent, name)
            real_dir = os.path.isdir(full) and not os.path.islink(full)
            if pattern.match(name) and real_dir and not os.path.exists(os.path.join(full, venv_layout.MARKER)):
                finished.append(full)
        candidates, _ = venv_layout.plan_retention(finished, current, self.keep, {})
        remove, skipped = venv_layout.plan_retention(
            finished, current, self.keep, venv_layout.processes_using(candidates, cwd=True)
        )
        removed = []
        for version in remove:
            try:
                venv_layout.remove(version)
                venv_layout.remove(venv_layout.lock_path(version))
                removed.append(version)
            except OSError as error:
                skipped.append({"path": version, "pids": [], "reason": f"cannot remove: {error.strerror}"})
        return removed, skipped

    def install_lock(self):
        """The lock the installer reads: a copy in a directory of root's own (mkdtemp: mode 0700), since another
        user able to write the venv's parent could swap ``<version>.lock.txt`` between its writing and its
        reading."""
        if self.private is None:
            self.private = tempfile.mkdtemp(prefix="pve-gpu-recover-build-")
            venv_layout.create_new(os.path.join(self.private, self.lock_name), self.lock, 0o600)
            if self.netrc:  # the index credentials: uv and pip (requests) read the file NETRC names
                venv_layout.create_new(os.path.join(self.private, "netrc"), self.netrc, 0o600)
                self.env["NETRC"] = os.path.join(self.private, "netrc")
        return os.path.join(self.private, self.lock_name)

    def drop_private(self):
        if self.private is not None:
            shutil.rmtree(self.private, ignore_errors=True)
            self.private = None

    def discard(self):
        """Remove what this run built; None when done, else the path left behind (its marker says unfinished)."""
        left = None
        if self.swapped:
            return None
        for path in (self.new, self.lock_file, f"{self.new}.link"):
            if path == self.new and not self.created:
                continue
            try:
                venv_layout.remove(path)
            except OSError:
                left = left or path
        return left

    def prepare_cache(self):
        """The build's package cache beside the versions (venv_layout.cache_dir), root's alone, for uv (linked into
        the new version: UV_LINK_MODE=hardlink, on the venv's own file system) and pip (it copies). Made just
        before the install, and kept when the install fails: a retry reuses what was downloaded."""
        for path in (self.cache, os.path.join(self.cache, "uv"), os.path.join(self.cache, "pip")):
            problem = venv_layout.own_directory(path)
            if problem:
                raise ct_act.ActError(
                    "layout",
                    f"{problem}, not the build's own package cache (a directory of root's, mode 0700); move it "
                    "away and run again",
                )
        self.env.update(UV_CACHE_DIR=os.path.join(self.cache, "uv"), UV_LINK_MODE="hardlink")
        self.env["PIP_CACHE_DIR"] = os.path.join(self.cache, "pip")

    def bound_cache(self):
        """``{"path", "own_bytes", "dropped"}``: what the cache holds that no kept version links, and whether that
        passed ``cache_max_bytes`` and the cache was dropped (the next build downloads again). Never a failure."""
        try:
            own = venv_layout.own_bytes(self.cache)
            dropped = self.cache_max is not None and own > self.cache_max
            if dropped:
                venv_layout.remove(self.cache)
        except OSError:
            own, dropped = None, False
        return {"path": self.cache, "own_bytes": own, "dropped": dropped}

    def prune(self):
        """Retention alone (the venv is in spec, old versions are beyond ``keep``): nothing is built."""
        started = time.monotonic()
        _, current = self.current()
        removed, skipped = self.retention(current)
        return {
            "pruned": True,
            "removed": removed,
            "retention_skipped": skipped,
            "seconds": round(time.monotonic() - started, 3),
        }

    def execute(self):
        if self.prune_only:
            return self.prune()
        started = time.monotonic()
        kind, old_dir = self.current()
        self.clean_leftovers(old_dir)
        if os.path.lexists(self.new):
            raise ct_act.ActError("layout", f"{self.new} exists already (a build in the same second?); run again")
        os.makedirs(self.parent, exist_ok=True)
        os.mkdir(self.new)
        self.created = True
        venv_layout.create_new(
            os.path.join(self.new, venv_layout.MARKER),
            f"being built since {self.stamp}; removed when the build is checked\n",
        )
        venv_layout.write_atomic(self.lock_file, self.lock)
        name, where = self.builder()
        builder = self.make_venv_with_uv(where) if name == "uv" else self.make_venv_with_pip(where)
        python = self.check()
        if self.window_check and old_dir and os.path.isdir(old_dir):
            found = venv_layout.processes_using([old_dir, self.path])  # the link's path: a job started by it
            users = sorted({pid for pids in found.values() for pid in pids})
            if users:  # a job started from it while this one was built: swapping it needs a window
                return {
                    "needs_window": {
                        "path": old_dir,
                        "users": [{"pid": pid, "name": venv_layout.comm_of(pid)} for pid in users],
                    },
                    "cleaned": self.cleaned,
                    "left_behind": self.discard(),
                    "seconds": round(time.monotonic() - started, 3),
                }
        os.unlink(os.path.join(self.new, venv_layout.MARKER))
        previous = None
        if old_dir and os.path.isdir(old_dir):
            moved = kind == "dir"
            freeze_to = venv_layout.freeze_path(venv_layout.previous_dir(self.path, self.stamp) if moved else old_dir)
            self.save_freeze(old_dir, freeze_to)
            previous = {
                "path": venv_layout.previous_dir(self.path, self.stamp) if moved else old_dir,
                "freeze": freeze_to,
            }
        moved_to = self.swap(kind, old_dir)
        self.swapped = True
        if previous:
            previous["moved"] = bool(moved_to)
            previous["note"] = (
                f"moved from {self.path}: a venv embeds its path, so it works again only once renamed back "
                f"(rm {self.path} && mv {moved_to} {self.path})"
                if moved_to
                else f"unchanged in place; to go back: ln -sfn {os.path.basename(old_dir)} {self.path}"
            )
        removed, skipped = self.retention(self.new)
        return {
            "path": self.path,
            "cache": self.bound_cache(),
            "current": self.new,
            "previous": previous,
            "builder": builder,
            "python": python,
            "lock_file": self.lock_file,
            "cleaned": self.cleaned,
            "removed": removed,
            "retention_skipped": skipped,
            "seconds": round(time.monotonic() - started, 3),
        }


def probe(payload):
    """ACTS: build the venv of ``payload`` beside the old one, check it, swap it in; answer what was done.

    ``payload``: ``{"path", "lock" (its text), "python" ("3.11" or None), "stamp" ("20261203T101500Z"), "uv" (path
    or name), "keep" (int or None), "timeout" (s), "expected" ({canonical name: version}, the lock's pins),
    "ignore" (tooling names not compared), "drop_tooling" (seeded tooling a pip build removes), "window_check"
    (unattended: no swap while a live process uses the current venv; optional), "prune_only" (build nothing, only
    remove versions beyond ``keep``; optional), "lock_format" ("pylock" for a pylock.toml; optional), "network"
    ({"environment", "secret_environment", "ca_bundle", "system_certs", "netrc", "secrets"}: the build's network,
    steps/training_venv/network.py; optional; every answer masks each of "secrets")}``.

    Success: ``{"path", "current", "previous" ({"path", "freeze", "moved", "note"} or None), "builder" ({"name",
    "path", "version"[, "fallback"]}), "python", "lock_file", "cleaned", "removed", "retention_skipped",
    "seconds"}``. Failure: ``{"error", "message", "cmd", "rc", "stdout_tail", "stderr_tail", "cleaned",
    "left_behind"}``. Not swapped because a live process uses the current venv (``window_check``):
    ``{"needs_window", "cleaned", "left_behind", "seconds"}``. ``prune_only``: ``{"pruned": true, "removed",
    "retention_skipped", "seconds"}``.
    """
    ct_run.end_with_me()  # the commands it starts, in sessions of their own, end with it
    secrets = [str(secret) for secret in ((payload.get("network") or {}).get("secrets") or [])]
    try:
        build = Build(payload)
    except (KeyError, TypeError, ValueError) as error:
        return {"error": "invalid", "message": f"the build payload is incomplete: {error}", "cleaned": []}
    except ct_act.ActError as error:
        return ct_act.redact_answer({"error": error.kind, "message": str(error), "cleaned": []}, secrets)
    try:
        return ct_act.redact_answer(build.execute(), secrets)
    except (ct_act.ActError, OSError) as error:
        failure = ct_act.failure(error, TAIL_LINES)
    finally:
        build.drop_private()
    failure.update(cleaned=build.cleaned, left_behind=build.discard())
    return ct_act.redact_answer(failure, secrets)
