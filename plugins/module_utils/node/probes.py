# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The probe program: probe parts (and acting scripts) run in the target's Python, several in ONE process.

In a CT, :data:`PROBES_MAIN` is the fixed program of ``python3 -I -S -c`` (:func:`probes_argv`); the parts' sources,
the container-side modules they share and their payloads come on its stdin as one JSON document
(:func:`probes_input`). On a bare host the parts run in the module's own process, in a thread waited for a deadline
(:func:`run_parts_bounded`). plugins/module_utils/node/target.py's ``Target.run_probes`` chooses.
"""

from __future__ import annotations

import inspect
import json
import threading
import time


def probe_name(module):
    """``...module_utils.steps.preflight.probe`` -> ``preflight``: how messages name a probe part (its step's name)."""
    parts = module.__name__.split(".")
    return parts[-2] if len(parts) > 1 and parts[-1] in ("probe", "script") else parts[-1]


def run_part(function, payload):
    """One probe part's result: its answer, or the error it raised, and how long it took."""
    started = time.monotonic()
    try:
        return {"answer": function(payload), "seconds": round(time.monotonic() - started, 3)}
    except Exception as error:  # one broken part must not hide the answers of the others
        return {"error": f"{type(error).__name__}: {error}", "seconds": round(time.monotonic() - started, 3)}


def run_parts_bounded(parts, seconds, label, clock=time.monotonic):
    """The bare host's run_probes: each part of ``parts`` in order in a daemon thread, waited for ``seconds``.

    A part that has not answered by then (and every part after it) gets ``{"error": "wedged: ...", "wedged":
    True}``; the thread is left behind (a daemon: the module's exit ends it; a wait on a hung NFS or FUSE mount
    is killable).
    """
    answers = {}
    worker = threading.Thread(
        target=lambda: answers.update((n, run_part(m.probe, p)) for n, (m, p) in parts.items()),
        name="probe parts",
        daemon=True,
    )
    started = clock()
    worker.start()
    worker.join(seconds)
    if not worker.is_alive():
        return answers
    done = dict(answers)  # a copy: the stuck thread may still add to answers
    for name in parts:
        if name not in done:
            done[name] = {
                "error": f"wedged: no answer within {seconds} s on {label} (a hung NFS/FUSE mount or a device stuck "
                f"in the driver: look for processes in state D); the part was abandoned",
                "wedged": True,
                "seconds": round(clock() - started, 3),
            }
    return done


def probes_argv(python):
    """``[python, "-I", "-S", "-c", PROBES_MAIN]``: the probe program's argv, fixed whatever the payloads (pure).

    ``-S``: the parts need the standard library only, so the CT's ``site`` (its site-packages and their ``.pth``
    files, which a CT's own packages may break or make slow) never runs before them; it also spares every CT's
    read the import of ``site`` (docs/benchmarks.md, the fleet)."""
    return [python, "-I", "-S", "-c", PROBES_MAIN]


# Sources read so far (module_source), by module name.
_SOURCES = {}
_SOURCES_LOCK = threading.Lock()


def module_source(module):
    """``inspect.getsource(module)``, read once per process and under a lock: the passes of one node's targets run in
    threads (target_facts' ``batch``), and two threads reading sources from AnsiballZ's zip at once made inspect
    fail with "could not get source code" (linecache's cache is not safe from threads; seen at 16 CTs)."""
    with _SOURCES_LOCK:
        if module.__name__ not in _SOURCES:
            _SOURCES[module.__name__] = inspect.getsource(module)
        return _SOURCES[module.__name__]


def probes_input(parts):
    """The stdin of PROBES_MAIN for ``parts`` (``{name: (module, payload)}``): one JSON document holding the
    container-side modules the parts declare in ``SHARED`` (each once, a module's own ``SHARED`` before it), then
    each part's source and payload. Data, never argv: a hashed lock of a full ML stack is larger than one argument
    may be (MAX_ARG_STRLEN, 128 KiB)."""
    return json.dumps(
        {
            "shared": {m.__name__: module_source(m) for m in shared_modules(m for m, _payload in parts.values())},
            "sources": {name: module_source(module) for name, (module, _payload) in parts.items()},
            "payloads": {name: payload for name, (_module, payload) in parts.items()},
        }
    )


def shared_modules(modules):
    """The container-side modules ``modules`` declare in ``SHARED``, and those their own ``SHARED`` declare, at any
    depth: each once, after every module it needs (pure). A part names only what it imports itself."""
    found = []

    def add(module, seen):
        for needed in getattr(module, "SHARED", ()):
            if needed not in found and needed not in seen:
                add(needed, (*seen, needed))
                found.append(needed)

    for module in modules:
        add(module, ())
    return found


# What the CT's python runs (``-c``; the parts come on stdin, see probes_input): stub modules for ``ansible`` and the
# collection's module_utils, always, so that nothing of the CT's own Python path (an Ansible, a copy of this
# collection) is ever imported by a part; the shared modules, each registered under its own dotted name, so that a
# part's ``from ansible_collections.pve_gpu.recover.plugins.module_utils.ct import fs as ct_fs`` finds it; then each
# part's source in a module of its own and probe(payload) of each, in order; the answers as one JSON object on
# stdout. Standard library only, Python 3.9+.
PROBES_MAIN = """
import json, sys, time


def stub(dotted):
    names = dotted.split(".")
    for depth in range(1, len(names) + 1):
        name = ".".join(names[:depth])
        if name not in sys.modules:
            sys.modules[name] = type(sys)(name)
            if depth > 1:
                setattr(sys.modules[".".join(names[: depth - 1])], names[depth - 1], sys.modules[name])
    return sys.modules[dotted]


answers = {}
given = json.loads(sys.stdin.buffer.read())
payloads = given["payloads"]
stub("ansible.module_utils")
stub("ansible_collections.pve_gpu.recover.plugins.module_utils")
for dotted, source in given["shared"].items():
    exec(compile(source, "<shared " + dotted + ">", "exec"), stub(dotted).__dict__)
for name, source in given["sources"].items():
    started = time.monotonic()
    try:
        module = type(sys)("probe_" + name)
        exec(compile(source, "<probe " + name + ">", "exec"), module.__dict__)
        answer = {"answer": module.probe(payloads[name])}
    except Exception as error:
        answer = {"error": type(error).__name__ + ": " + str(error)}
    answer["seconds"] = round(time.monotonic() - started, 3)
    answers[name] = answer
sys.stdout.write(json.dumps(answers))
"""
