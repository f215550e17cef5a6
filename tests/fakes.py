"""Test doubles of the target's runner and a harness that runs a library/ module's main() in-process."""

import ast
import inspect
import json
import subprocess
import sys
import threading

import pytest
import yaml
from ansible.module_utils import _internal as ansible_internal
from ansible.module_utils.common import warnings as ansible_warnings
from ansible.module_utils.testing import patch_module_args
from ansible.release import __version__ as ansible_core_version
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import probes as node_probes
from ansible_collections.pve_gpu.recover.plugins.module_utils.node import target as node_target
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.command import CommandResult

# The ansible-core that runs the tests, (major, minor): some behaviour differs between the ends of the range.
ANSIBLE_CORE = tuple(int(part) for part in ansible_core_version.split(".")[:2])


class FakeRunner:
    """Answers each expected argv in order with (rc, stdout, stderr[, seconds[, timed_out]]) or raises an exception.

    Any other argv, or a call beyond the list, fails the test: round trips are the cost of this project, so
    every test pins exactly which commands run and how many. A call from another thread (the fact pass's node
    reads run beside its probe) is matched by its argv among the calls still expected, since threads interleave;
    one that matches none is kept and fails ``assert_done`` (what a thread raises may never reach the test).
    """

    def __init__(self, *calls):
        self.calls = list(calls)
        self.stdin = []
        self.lock = threading.Lock()
        self.unexpected = []

    def __call__(self, argv, *, stdin=None, timeout=None, env=None):
        argv = as_pinned(argv, stdin)
        with self.lock:
            if threading.current_thread() is threading.main_thread():
                assert self.calls, f"unexpected extra call {argv}"
                index = 0
            else:
                index = next((i for i, (want, _) in enumerate(self.calls) if want == argv), None)
                if index is None:
                    self.unexpected.append(argv)
                    raise AssertionError(f"unexpected call {argv} from thread {threading.current_thread().name}")
            want, answer = self.calls.pop(index)
            self.stdin.append(stdin)
        assert argv == want
        if isinstance(answer, Exception):
            raise answer
        rc, out, err, *rest = answer
        return CommandResult(
            argv=argv,
            rc=rc,
            stdout=out,
            stderr=err,
            seconds=rest[0] if rest else 0.01,
            timed_out=bool(rest[1:]) and rest[1],
        )

    def assert_done(self):
        assert self.unexpected == [], f"unexpected calls from other threads: {self.unexpected}"
        assert self.calls == [], f"expected calls not made: {[c[0] for c in self.calls]}"


def as_pinned(argv, stdin):
    """The argv a test pins for a call: a probes call (``python -I -S -c PROBES_MAIN``, its parts as JSON on stdin) is
    pinned as ``[..., python, "-I", "-", json.dumps(payloads)]``, so each test still asserts every payload exactly
    (tests/unit/plugins/module_utils/node/test_target.py asserts the real argv and stdin)."""
    if len(argv) < 4 or argv[-4:] != ["-I", "-S", "-c", node_target.PROBES_MAIN]:
        return argv
    payloads = json.loads(stdin)["payloads"]
    return [*argv[:-4], "-I", "-", json.dumps(payloads)]


def run_probes_program(python, parts, prefix=()):
    """What a CT's python answers to ``parts`` (``{name: (module, payload)}``): ``[*prefix, python, -I, -S, -c,
    PROBES_MAIN]`` run for real with Target.run_probes' own stdin (probes_input: the shared modules, then the
    parts), the way a ``pct exec`` runs it. ``prefix`` puts a wrapper in front (``unshare ...``)."""
    done = subprocess.run(
        [*prefix, *node_target.probes_argv(str(python))],
        input=node_target.probes_input(parts),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def not_shippable(module):
    """What the part ``module``, or a container-side module it ships, imports that a CT's python lacks: neither the
    standard library nor a container-side module it ships (``SHARED``, at any depth); empty for a part that runs in
    any CT."""
    shipped = node_probes.shared_modules([module])
    imported = set()
    for each in (module, *shipped):
        tree = ast.parse(inspect.getsource(each))
        imported |= {alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
        imported |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    names = {m.__name__ for m in shipped}
    return {name for name in imported - names if name.split(".")[0] not in sys.stdlib_module_names}


def run_module(module, args, runner, monkeypatch, capsys, *, check_mode=False):
    """Run ``module.main()`` with ``args`` and the fake runner; return the JSON it exited with."""
    monkeypatch.setattr(node_target, "run_local", runner)
    # module.warn() collects process-wide and keeps each text once, as if every module run so far were one: a run
    # in a test is its own, or a warning an earlier test's run gave would be missing from this one's result.
    monkeypatch.setattr(ansible_warnings, "_global_warnings", {})
    # Once a test imports the controller's code (the action plugin's tests), ansible-core 2.19+ sends warn() to the
    # controller's display instead of the module's result: a module runs on the node, never in the controller.
    monkeypatch.setattr(ansible_internal, "is_controller", False)
    if check_mode:
        args = dict(args, _ansible_check_mode=True)
    with patch_module_args(args), pytest.raises(SystemExit):
        module.main()
    runner.assert_done()
    result = json.loads(capsys.readouterr().out)
    assert_documented(module, result)
    return result


# Keys every module may return that Ansible itself documents (the common return values).
COMMON_KEYS = {"changed", "failed", "msg", "invocation", "warnings", "deprecations", "diff"}


def assert_documented(module, result):
    """Every key ``module`` returned is in its RETURN (docs that say what the code does)."""
    documented = set(yaml.safe_load(module.RETURN) or {})
    undocumented = sorted(set(result) - documented - COMMON_KEYS)
    assert undocumented == [], f"{module.__name__} returns keys its RETURN does not document: {undocumented}"
