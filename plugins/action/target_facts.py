"""target_facts' action: the controller's share of the fact pass, so that a converged run is this one task.

Before the module runs, on the controller and at no remote cost: the inventory is checked (``pve_vmid`` a CT id,
``pve_node`` set beside it), the run is named (``run_id``: one id for every target of one ansible-playbook run)
and the lock's ``owner``, ``controller`` and ``controller_pid`` are filled in when the task leaves them out. Each of
these was a task of its own (a set_fact, an assert, two ``pipe`` lookups), and every task costs a worker process.

The steps' settings are read here too (``steps_from_variables``): from their roles' variables, in Python, where a
Jinja mapping of them cost each of Ansible's workers a template compile per step (``_settings_from_variables``).
So are the pass's own options, where the task asks (``options_from_variables``, the preflight role's task): from the
preflight role's variables, where a template per option cost every target a Jinja compile and render in its worker,
12 of its 18 (docs/benchmarks.md, the fleet).

Then the module runs exactly as Ansible's ``normal`` action runs it, with its AnsiballZ payload kept between runs.

One ssh connection per node, whatever the fork count: with ``ControlMaster=auto`` every fork that reaches a node
before its master socket exists opens a connection of its own (8 forks, 8 connections: docs/benchmarks.md, the
fleet). So the first fork to find no socket takes a lock beside it and runs its module, which opens the master;
the lock is let go the moment the socket appears (a watcher thread), and the forks that waited on it then share
that master. No remote call is added: a converged run pays one ``stat`` per target. A fork that had to wait and
still finds no socket (the first one's node did not answer) connects alone at once, so an unreachable node's
targets still fail in parallel, not one timeout after another. Where the ControlPath is not a plain path (ssh's
``%`` tokens), a password is in play, the connection is not ssh or its internals changed, this does nothing and
Ansible connects as it always does.

One module execution per node, not per target (``per_node``, on by default): the forks of one run whose targets share
a node and its connection post their options to a queue in the run's own temp directory (``local_tmp``, so never
another run's); the first to take the node's lock waits until every host of the play batch has posted (to its own
node's queue or another's) or none has for a while (GATHER_IDLE_COVERED where the forks cover the batch, else
GATHER_IDLE; GATHER_LONGEST at most, longer for a batch of hundreds), then reads, in one execution, every target of
its node that has posted by then (``batch``: the passes run side by side on the node; what each target shares with
the reading fork's own options travels once, batch_items), writes each its result and lets go, and each waiting
fork returns its own. Every target keeps its own task, result, report, ``--limit`` and failure; each one's options
are the ones Ansible templated for it, so nothing of another host's is guessed. A lone target (one host in the play
batch, a bare host, or one fork at a time) runs exactly as before and marks its arrival all the same, as does a
host that fails the checks above: no read waits for a host that will not post. Forks that arrive while a
read runs are the next read's. A read that did not answer the targets it carried (its own options failed the module
before it read them, it raised) queues them again for the next fork; an unreachable node answers each of them
unreachable at once; a fork that leaves its wait (a task timeout) takes its request back; any failure of the queue
itself reads the target alone, and once (a fork that cannot wait for the node's lock after a reader claimed its
request waits for that reader's answer instead). The queue only ever saves time.

Building the payload is the largest controller cost of a converged run (recursive_finder parses every module_utils
file the module reaches with ``ast``: about 0.45 s of a 2.7 s run, docs/benchmarks.md), and Ansible caches it only
inside one ansible-playbook process. This action keeps the payload Ansible built in ``pve-gpu-recover-ansiballz``
beside Ansible's own local temp directories (``local_tmp``), under a key made of everything that goes into it
(ansible-core's version and location, the controller's Python, the module's bytes and every file of every
``module_utils`` directory), and puts it back where Ansible looks before it would build it again. A changed file is
a new key, so a stale payload is never used; the store keeps the newest KEEP keys. Anything unexpected (a store
that is not the user's own, a read-only home, any exception of the store) leaves the action exactly as ``normal``:
it only ever saves time.

Where Ansible keeps its cache (``<local_tmp>/ansiballz_cache``) and how it names a payload there
(``<fqn>-<compression>-<extension set>``) are ansible-core internals, so the store is used only on the ansible-core
versions it was written and tested for, KNOWN_ANSIBLE (the project's supported range: ``make test`` runs the unit
tests, these included, on both ends); on any other version Ansible builds the payload itself, as it always does.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import json
import os
import platform
import re
import secrets
import shutil
import stat
import sys
import tempfile
import threading
import time

import ansible
from ansible import constants as C
from ansible import context as ansible_context
from ansible.errors import AnsibleConnectionFailure, AnsibleError, AnsibleValueOmittedError
from ansible.module_utils.parsing.convert_bool import boolean
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.action.normal import ActionModule as NormalAction
from ansible.plugins.loader import lookup_loader
from ansible.template import Templar, trust_as_template
from ansible.utils.display import Display
from ansible_collections.pve_gpu.recover.plugins.module_utils import pve_steps
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_steps import (
    BATCH_SAME_AS_TASK,
    StepSpecError,
    settings_from_variables,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.pve_target import DEFAULT_TIMEOUT, KILL_GRACE

display = Display()

STORE_NAME = "pve-gpu-recover-ansiballz"
# ansible-core versions (major, minor) whose AnsiballZ cache the store was written and tested for: 2.19 to 2.21.
KNOWN_ANSIBLE = frozenset({(2, 19), (2, 20), (2, 21)})
KEEP = 4  # payload keys kept: one per version of the code a controller still runs, about 0.3 MB each
# The run's id, shared by the ansible-playbook process's workers through its own temp directory (local_tmp).
RUN_ID_FILE = "pve-gpu-recover-run-id"
# A CT id as plugins/module_utils/pve_target.py checks it again on the node.
VMID_MIN = 100
VMID_MAX = 999999999
# The pid of ansible-playbook, set by the recover_report callback in that process (the drift runner clears any
# value it inherited, so it never names the wrong process).
CONTROLLER_PID_ENV = "PVE_GPU_RECOVER_CONTROLLER_PID"
# The queue of the targets of one node waiting for the fact pass, in the run's own temp directory (NodeQueue).
QUEUE_DIR = "pve-gpu-recover-node-passes"
# A fork that reads its node's targets first waits for the others: until every host of the play batch has come
# (to any node), or none has come for an idle time, never longer than GATHER_LONGEST in all, or GATHER_PER_HOST per
# host of the batch where that is longer. Ansible's linear strategy starts the forks of a task one after another,
# round-robin over the nodes in an inventory like the lab's (the collection's per_node strategy starts each node's
# hosts at once, threads of one worker, at most forks of them): 64 take about 2 s on 2 busy cores, and over 5 s
# (gaps of 0.2 s and more) when those cores are shared with the 64 CTs' probes, so a wait for the node's own
# targets alone, a short idle time or a fixed bound split a node's targets into two reads or more. Idle time:
# GATHER_IDLE_COVERED when the forks cover the batch (a host that has not come by then is not coming: skipped, or
# failed before its action), GATHER_IDLE when they do not (the rest of the batch comes only as reads end: waiting
# is for nothing).
GATHER_IDLE = 0.15
GATHER_IDLE_COVERED = 1.0
GATHER_LONGEST = 10.0
GATHER_PER_HOST = 0.1
# Seconds beyond a claimed read's own bounds (ssh's connection, the module's start) that a fork whose request another
# fork claimed waits for its answer before it reads its target itself (_result_wait).
RESULT_WAIT_SLACK = 60
# Every step's module, imported with this action: ansible-playbook imports the action before it forks the task's
# workers (the linear strategy asks it whether it bypasses the host loop), so each worker finds them imported
# instead of importing them again to read their settings (settings_from_variables).
STEP_MODULES = tuple(pve_steps.load_step(name) for name in pve_steps.STEP_NAMES)
# What the workers template first: a filter (Ansible loads every builtin filter plugin on the first one) and a
# lookup (the env lookup of roles/gpu_processes/vars/main.yml); see warm_templating.
WARM_TEMPLATE = "{{ (lookup('ansible.builtin.env', 'HOME') | default('') | string | length > 0) | bool }}"
# The lookups a worker would otherwise load for itself: the venv step's lock (roles/training_venv/vars/main.yml's
# _training_venv_lock reads a lock file, or compiles a requirements list); see warm_templating.
WARM_LOOKUPS = ("ansible.builtin.file", "pve_gpu.recover.uv_lock")
# A run id names report files and lock records: a path component of safe characters only.
RUN_ID_SHAPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def warm_templating(template=WARM_TEMPLATE, modules=None, lookups=WARM_LOOKUPS):
    """Template one expression in this process, once, where it runs tasks (an ansible or ansible-playbook process:
    Ansible's task queue is imported): it imports this action before it forks the task's workers (STEP_MODULES), and
    what Ansible sets up on its first template (Jinja's lexer, the builtin filter plugins it loads all at once, the
    lookup plugin) is then inherited by every worker instead of set up again in each: about 7 ms of each worker's
    CPU (docs/benchmarks.md, the fleet). The ``lookups`` are loaded too: the file lookup of the venv step's lock was
    about 2 ms of each worker's. Elsewhere (ansible-doc, a sanity test's import) it does nothing. Anything
    unexpected leaves it undone: it only ever saves time. Returns whether it templated and loaded them all."""
    if "ansible.executor.task_queue_manager" not in (sys.modules if modules is None else modules):
        return False
    try:
        Templar(loader=DataLoader()).template(trust_as_template(template))
    except Exception as error:  # by design: see above
        display.vvv(f"target_facts: templating not warmed ({type(error).__name__}: {error})")
        return False
    for name in lookups:
        try:
            if lookup_loader.get(name) is None:
                raise AnsibleError("no such lookup")
        except Exception as error:  # by design: see above
            display.vvv(f"target_facts: lookup {name} not loaded before the forks ({type(error).__name__}: {error})")
            return False
    return True


warm_templating()


def inventory_problem(host, vmid_set, vmid, node_set, node):
    """The inventory mistake that names ``host``'s target wrongly, as one sentence, or None.

    ``vmid_set``: whether the inventory sets ``pve_vmid`` (even to null: a CT that lost its id must not become its
    node); ``vmid`` its value as templated; ``node_set`` whether ``pve_node`` is set and ``node`` its value. A CT
    id is an integer from 100 to 999999999 written in digits, and a CT needs its node: without pve_node the fact
    pass would run on the CT's own inventory name. Unset, the target is a bare GPU host.
    """
    if not vmid_set:
        return None
    digits = re.fullmatch(r"[0-9]+", str(vmid)) is not None and not isinstance(vmid, bool)
    if digits and VMID_MIN <= int(vmid) <= VMID_MAX and node_set:
        return None
    return (
        f"{host}: pve_vmid must be a Proxmox CT id (an integer from {VMID_MIN} to {VMID_MAX}) with pve_node naming "
        f"its node; got pve_vmid={json.dumps(str(vmid))}, pve_node={node if node_set else 'unset'}. "
        "Fix the inventory."
    )


# Role variables renamed in 2.0.0 (CHANGELOG.md): one left in an inventory would be ignored without a word.
RENAMED_VARIABLES = {"training_venv_python": "training_venv_python_version"}


def renamed_variable_problem(host, names):
    """The first renamed role variable among ``names`` (the host's variables) with its new name; ``""`` if none."""
    for old, new in RENAMED_VARIABLES.items():
        if old in names:
            return f"{host}: {old} was renamed {new} in pve_gpu.recover 2.0.0 (CHANGELOG.md); rename it"
    return ""


# options_from_variables: each option of the pass that the task leaves out and the preflight role's variable it is
# read from, as the role's task passed them before 2.4.0: ``"{{ preflight_<option> }}"``, and for these two
# ``"{{ ... | default(omit, true) }}"`` (a false or empty value is left out: the action names the run and its owner).
OPTION_VARIABLES = {
    "run_id": "preflight_run_id",
    "owner": "preflight_lock_owner",
    "lock_ttl": "preflight_lock_ttl",
    "lock_dir": "preflight_lock_dir",
    "python": "preflight_python",
    "timeout": "preflight_timeout",
    "per_node": "preflight_per_node",
    "steps": "preflight_steps",
}
FALSE_IS_UNSET = frozenset({"run_id", "owner"})


def options_from_variables(given, variable, host):
    """The options of the pass that ``given`` (the task's own) leaves out, read from the variables (pure), each as the
    preflight role's task templated it before 2.4.0: ``vmid`` is ``pve_vmid`` (``default(omit)``), ``node_name`` is
    ``pve_node`` (``default(inventory_hostname)``: ``host``), ``steps_from_variables`` is preflight and
    ``preflight_steps_from_variables``, ``check_run`` is the run's check mode (``ansible_check_mode``), the others
    are OPTION_VARIABLES. ``variable(name)`` is the variable's templated value (KeyError when it is not set, or
    templates to ``omit``: the option is left out, as a template of it would have left it; StepSpecError when it
    cannot be templated: raised again, naming the variable and the option). Raises StepSpecError for steps to read
    that are not a list."""
    found = {}

    def value(option, name):
        return pve_steps.variable_value(variable, name, f"the fact pass's {option}")

    def read(option, name, default=pve_steps.UNSET):
        if option in given:
            return
        read_value = value(option, name)
        read_value = default if read_value is pve_steps.UNSET else read_value
        if read_value is not pve_steps.UNSET and not (option in FALSE_IS_UNSET and not read_value):
            found[option] = read_value

    read("vmid", "pve_vmid")
    read("node_name", "pve_node", default=host)
    for option, name in OPTION_VARIABLES.items():
        read(option, name)
    if "steps_from_variables" not in given:
        more = value("steps_from_variables", "preflight_steps_from_variables")
        more = [] if more is pve_steps.UNSET else more
        if not isinstance(more, list):
            raise StepSpecError(
                f"preflight_steps_from_variables must be a list of step names, not {more!r}", kind="invalid_step"
            )
        found["steps_from_variables"] = [pve_steps.preflight_facts.NAME, *more]
    read("check_run", "ansible_check_mode", default=False)
    return found


def per_node_source(args, variable, template):
    """What says whether a task of this action reads its node's targets together, not yet read as a boolean (pure):
    its ``per_node`` (``template``: templated as Ansible templates a task's options), else, where the task reads its
    options from the role's variables (``options_from_variables``), what options_from_variables reads
    (``variable``: its reader), else the option's default, true. The strategy (plugins/strategy/per_node.py) asks
    before the action runs; the action reads the same."""
    if "per_node" in args:
        return template(args["per_node"])
    if boolean(template(args.get("options_from_variables", False)), strict=False):
        found = pve_steps.variable_value(variable, OPTION_VARIABLES["per_node"], "the fact pass's per_node")
        return True if found is pve_steps.UNSET else found  # as options_from_variables reads it
    return True


def variable_reader(templar, task_vars):
    """``variable(name)``: the task variable ``name`` templated by ``templar``; KeyError when it is not set or
    templates to ``omit``, StepSpecError (Jinja's first line) when it cannot be templated. The one reader of the
    role variables the action reads in Python (options_from_variables, pve_steps.settings_from_variables)."""

    def variable(name):
        if name not in task_vars:
            raise KeyError(name)
        try:
            return templar.template(task_vars[name])
        except AnsibleValueOmittedError as error:
            raise KeyError(name) from error
        except AnsibleError as error:
            said = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise StepSpecError(said, kind="invalid_step") from error

    return variable


def unreachable_message(node, error):
    """What an unreachable node's result says: the node by its inventory name, then Ansible's own sentence."""
    return f"the node {node} could not be reached: {error}"


def control_socket(argv):
    """The master socket an ssh command line names (``-o ControlPath=...``; str or bytes arguments); None when it
    names none, ``none``, or one with ssh's ``%`` tokens (only ssh knows what they expand to)."""
    for arg in argv:
        text = arg.decode("utf-8", "surrogateescape") if isinstance(arg, bytes) else str(arg)
        for prefix in ("ControlPath=", "-oControlPath="):
            if text.startswith(prefix):
                path = text[len(prefix) :].strip().strip('"')
                return None if "%" in path or path.lower() == "none" or not path else path
    return None


def lock_beside(socket):
    """An open descriptor of ``<socket>.pve-gpu-recover.lock`` (created 0600, never through a link) to flock."""
    return os.open(f"{socket}.pve-gpu-recover.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def master_watch(socket, descriptor, interval=0.01):
    """Let go of the lock ``descriptor`` holds as soon as ``socket`` exists (this fork's connection opened the
    master) or when the returned callable is called (its module run ended, whatever happened), whichever is first."""
    done = threading.Event()
    guard = threading.Lock()
    state = {"open": True}

    def release():
        done.set()
        with guard:
            if state["open"]:
                state["open"] = False
                os.close(descriptor)  # releases the lock

    def watch():
        while not done.wait(interval):
            if os.path.exists(socket):
                break
        release()

    threading.Thread(target=watch, name="pve-gpu-recover-ssh-master", daemon=True).start()
    return release


def run_id_problem(run_id):
    """Why ``run_id`` (given by the task: ``preflight_run_id``) cannot name a run, or None."""
    if isinstance(run_id, str) and RUN_ID_SHAPE.fullmatch(run_id):
        return None
    return (
        f"run_id {json.dumps(str(run_id))} cannot name a run: it names the run's report files and lock records, so "
        "it must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit "
        "(preflight_run_id, or unset to let the fact pass name the run)"
    )


def new_run_id(now=None):
    """``20261204T101500Z-3f2a1c``: the UTC time and 24 random bits (two runs in one second still differ)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(3)


def shared_run_id(directory):
    """The id of this ansible-playbook run: made by the first worker that asks, read by every other one.

    ``directory`` is the process's own temp directory (``local_tmp``), which every worker of one run shares and no
    other run does. The id is published with link(2), which fails when another worker won the race, so every
    worker reads the same complete id. Returns None when the directory cannot be used.
    """
    path = os.path.join(directory, RUN_ID_FILE)
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read()
    except FileNotFoundError:
        pass
    except OSError:
        return None
    try:
        fd, temporary = tempfile.mkstemp(dir=directory, prefix=".run-id-")
    except OSError:
        return None
    try:
        with os.fdopen(fd, "w", encoding="ascii") as handle:
            handle.write(new_run_id())
        with contextlib.suppress(FileExistsError):  # another worker published first: its id is the run's
            os.link(temporary, path)
        with open(path, encoding="ascii") as handle:
            return handle.read()
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temporary)


def controller_defaults(environ=None, parent_pid=None):
    """The lock's record of who runs this, for the options the task leaves out: ``owner`` (USER@host, as the
    preflight role documents it), ``controller`` (this host's name) and ``controller_pid``.

    ``controller_pid`` is CONTROLLER_PID_ENV's, else this worker's parent (``parent_pid``, default os.getppid():
    Ansible forks its workers from ansible-playbook): never absent, since two runs under one run id, owner and
    controller are told apart by it alone (plugins/module_utils/pve_lock.py, "One run").
    """
    environ = os.environ if environ is None else environ
    host = platform.node() or "unknown"
    user = environ.get("USER") or _login_name() or "unknown"
    pid = environ.get(CONTROLLER_PID_ENV, "")
    return {
        "owner": f"{user}@{host}",
        "controller": host,
        "controller_pid": int(pid) if pid.isdigit() else (parent_pid or os.getppid()),
    }


def _login_name():
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return None


def known_ansible(version):
    """Whether ansible-core ``version`` (``2.19.14``, ``2.21.0rc1``) is one the payload store knows (KNOWN_ANSIBLE)."""
    match = re.match(r"([0-9]+)\.([0-9]+)(?:\.|$)", str(version))
    return bool(match) and (int(match[1]), int(match[2])) in KNOWN_ANSIBLE


def guarded(what, function, *args):
    """``function(*args)``, or None after any exception, said at -vvv: the store only ever saves time, so nothing it
    does may fail the task (Ansible then builds the payload as it always does)."""
    try:
        return function(*args)
    except Exception as error:  # by design: no failure of the store is a failure of the run
        display.vvv(f"target_facts: AnsiballZ payload not {what}: {type(error).__name__}: {error}")
        return None


def payload_key(module_path, utils_dirs, *, ansible_version=None, python=None):
    """A hex digest of everything an AnsiballZ payload of ``module_path`` is built from; pure but for reading."""
    digest = hashlib.sha256()
    digest.update(f"{ansible_version or ansible.__version__}\0{os.path.dirname(ansible.__file__)}\0".encode())
    digest.update(f"{python or sys.version}\0".encode())
    for path in [module_path, *sorted(python_files(utils_dirs))]:
        digest.update(path.encode() + b"\0")
        with open(path, "rb") as handle:
            digest.update(hashlib.sha256(handle.read()).digest())
    return digest.hexdigest()[:32]


def python_files(dirs):
    """Every ``.py`` file under ``dirs`` (recursively), missing directories skipped."""
    found = []
    for top in dirs:
        for root, subdirs, files in os.walk(top):
            subdirs[:] = [d for d in subdirs if d != "__pycache__"]
            found += [os.path.join(root, f) for f in files if f.endswith(".py")]
    return found


def module_fqn(module_path):
    """The name Ansible's payload cache files a module under: ``ansible_collections.pve_gpu.recover.plugins.modules.
    target_facts`` for a collection's module (ansible-core's own rule, an internal), ``ansible.legacy.<name>`` for
    one found on a library path."""
    from ansible.executor.module_common import _get_ansible_module_fqn  # noqa: PLC0415 (an internal: known versions)

    try:
        return _get_ansible_module_fqn(module_path)
    except ValueError:
        return f"ansible.legacy.{os.path.splitext(os.path.basename(module_path))[0]}"


def private_dir(path):
    """``path`` made if missing (mode 0700); whether it is a directory of this user that nobody else can write."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022


def cached_names(directory, fqn):
    """The payload files Ansible's cache holds for module ``fqn`` (one per compression and extension set)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(f"{fqn}-") and not n.endswith(".lock"))


def copy_atomically(source, target):
    """``source`` to ``target`` through a temporary file in its directory: a reader never sees half a payload."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as out, open(source, "rb") as src:
            shutil.copyfileobj(src, out)
        os.replace(temporary, target)
    except BaseException:
        os.unlink(temporary)
        raise


def restore(store, key, local_cache, fqn):
    """Put the kept payloads of ``key`` where Ansible looks for them; how many were put back."""
    kept = os.path.join(store, key)
    names = [n for n in cached_names(kept, fqn) if not os.path.exists(os.path.join(local_cache, n))]
    if names:
        os.makedirs(local_cache, mode=0o700, exist_ok=True)
    for name in names:
        copy_atomically(os.path.join(kept, name), os.path.join(local_cache, name))
    return len(names)


def keep(store, key, local_cache, fqn, limit=KEEP):
    """Keep the payloads Ansible built for ``fqn`` under ``key``, then drop all but the ``limit`` newest keys;
    how many payloads were kept."""
    kept = os.path.join(store, key)
    names = [n for n in cached_names(local_cache, fqn) if not os.path.exists(os.path.join(kept, n))]
    if not names:
        return 0
    os.makedirs(kept, mode=0o700, exist_ok=True)
    for name in names:
        copy_atomically(os.path.join(local_cache, name), os.path.join(kept, name))
    os.utime(kept)
    keys = sorted((os.path.join(store, k) for k in os.listdir(store)), key=os.path.getmtime, reverse=True)
    for old in keys[limit:]:
        shutil.rmtree(old, ignore_errors=True)
    return len(names)


def write_json_atomically(path, value):
    """``value`` as JSON at ``path`` through a temporary file beside it: a reader never sees half of it."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(value, default=str))  # dumps: the C encoder (dump's is Python's)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def batch_items(others, own):
    """The module's ``batch`` for the waiting targets whose options are ``others``: of each, the options whose value
    differs from the task's own (``own``), and under BATCH_SAME_AS_TASK the names of those whose value is the same,
    which the module takes from its own options; so what every target shares (a hashed lock of over 100 KB) travels
    to the node once, not once per target (pure). An option a target leaves out stays out: the module gives it its
    default, as that target's own task would. Values are compared as the module receives them, as JSON: ``1``,
    ``1.0``, ``"1"`` and ``true`` all differ."""
    shared = {name: as_json(value) for name, value in task_options(own).items()}
    items = []
    for options in others:
        same = sorted(n for n, value in options.items() if shared.get(n) is not None and shared[n] == as_json(value))
        item = {name: value for name, value in options.items() if name not in same}
        if same:
            item[BATCH_SAME_AS_TASK] = same
        items.append(item)
    return items


def as_json(value):
    """``value`` as one JSON text, keys sorted: two values are the same option for the module when these are. None
    for a value that cannot be written so (a dict whose keys mix numbers and strings): never shared, it travels."""
    try:
        return json.dumps(value, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return None


def task_options(args):
    """The module options of a task's ``args``: not ``batch`` (the action's, per read), nor the ``_ansible_*`` keys
    Ansible writes into them when it runs the module, which a retried task (``retries``/``until``) still has."""
    return {name: value for name, value in args.items() if name != "batch" and not name.startswith("_ansible_")}


class NodeQueue:
    """The targets of one node waiting for their fact pass in one run of one task (module docstring).

    A directory (mode 0700) with ``requests/`` (each waiting target's module options, posted by its fork),
    ``results/`` (each one's result, written by the fork that read it) and ``lead`` (the lock that fork holds while
    it reads). A fork that takes the lock and finds no result of its own claims every request posted by then: the
    fork before it wrote a result for each request it claimed before it let go, so its own is among them.

    ``arrivals``: a directory the queues of every node of this task share, where each fork marks its host as it
    posts; ``expected``: the hosts of the fork's play batch. The gathering then knows when no fork is left to come:
    it counts the marks of those hosts only, so a batch that shrank (a host failed the controller's checks) or a
    host marked by an earlier batch or retry of the task never makes it wait for one that will not come (a retry
    finds its own mark there and waits an idle time at most). Without them, it waits for this node's own requests.
    """

    def __init__(self, directory, arrivals=None, expected=(), idle=GATHER_IDLE):
        self.directory = directory
        self.arrivals = arrivals
        self.expected = {self.mark(host) for host in expected}
        self.idle = idle
        for part in ("requests", "results"):
            os.makedirs(os.path.join(directory, part), mode=0o700, exist_ok=True)
        if arrivals:
            os.makedirs(arrivals, mode=0o700, exist_ok=True)

    def post(self, options, name=None, host=None):
        """Queue one target's ``options`` (again, under ``name``); the name its result will be found under. ``host``:
        the inventory host that arrives with them (its first post)."""
        name = name or f"{time.monotonic_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}"
        write_json_atomically(os.path.join(self.directory, "requests", f"{name}.json"), options)
        if host is not None and self.arrivals:
            # Marked once the request is there, so a gathering that saw every mark claims every request. A mark
            # that cannot be made costs only a longer wait, never an error after the request is queued (its
            # fork would read its target alone while another read it too).
            with contextlib.suppress(OSError):
                self.mark_arrival(self.arrivals, host)
        return name

    @staticmethod
    def mark(host):
        """The file name that marks ``host``'s arrival (any inventory name, as a safe file name)."""
        return hashlib.sha256(str(host).encode()).hexdigest()[:32]

    @classmethod
    def mark_arrival(cls, arrivals, host):
        """Mark ``host`` as come in the ``arrivals`` directory (made if missing); OSError when it cannot be."""
        os.makedirs(arrivals, mode=0o700, exist_ok=True)
        os.close(os.open(os.path.join(arrivals, cls.mark(host)), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))

    def arrived(self):
        """How many have come: hosts of the play batch to any node (``arrivals``), else this node's waiting
        requests."""
        if self.arrivals and self.expected:
            return len(self.expected.intersection(os.listdir(self.arrivals)))
        return len(self.waiting())

    def withdraw(self, name):
        """Take ``name``'s request off the queue if no fork claimed it: a target whose fork left is never read.
        Whether it was still there (False: a reader has claimed it, and answers it or queues it again)."""
        try:
            os.unlink(os.path.join(self.directory, "requests", f"{name}.json"))
        except FileNotFoundError:
            return False
        return True

    def await_result(self, name, longest, clock=time.monotonic, sleep=time.sleep):
        """The result of ``name``, which a reader has claimed, waited for ``longest`` seconds at most. None when
        none came by then, or when the reader queued the request again (it did not answer it): taken back here,
        so no other fork reads it either."""
        deadline = clock() + longest
        while True:
            found = self.result(name)
            if found is not None:
                return found
            if self.withdraw(name) or clock() >= deadline:
                return None
            sleep(0.05)

    def hold(self):
        """Wait for the node's lock and hold it (one fork reads the node's targets at a time): its descriptor, to
        close to let go; None when it cannot be had (the target is then read alone)."""
        try:
            descriptor = os.open(os.path.join(self.directory, "lead"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        except OSError:
            os.close(descriptor)
            return None
        return descriptor

    def waiting(self):
        """The names of the requests no fork has claimed yet, oldest first."""
        return sorted(
            n[: -len(".json")] for n in os.listdir(os.path.join(self.directory, "requests")) if n.endswith(".json")
        )

    def gather(self, idle=None, longest=None, clock=time.monotonic, sleep=time.sleep):
        """Wait while more targets are still coming: until all ``expected`` have, or none came for ``idle``
        seconds (default: the queue's), at most ``longest`` in all (default: GATHER_LONGEST, or GATHER_PER_HOST
        per expected host where that is longer). How many of this node's are waiting then."""
        idle = self.idle if idle is None else idle
        if longest is None:
            longest = max(GATHER_LONGEST, GATHER_PER_HOST * len(self.expected))
        started = last_change = clock()
        count = self.arrived()
        expected = len(self.expected) if self.arrivals and self.expected else float("inf")
        while count < expected and clock() - last_change < idle and clock() - started < longest:
            sleep(0.01)
            now = self.arrived()
            if now != count:
                count, last_change = now, clock()
        return len(self.waiting())

    def claim(self):
        """Every waiting request, taken off the queue: ``[(name, options)]``, oldest first (one that cannot be read
        is dropped: its fork, finding no result, reads its target itself)."""
        claimed = []
        for name in self.waiting():
            path = os.path.join(self.directory, "requests", f"{name}.json")
            try:
                with open(path, encoding="utf-8") as handle:
                    claimed.append((name, json.load(handle)))
            except (OSError, ValueError):
                pass
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return claimed

    def answer(self, name, result):
        write_json_atomically(os.path.join(self.directory, "results", f"{name}.json"), result)

    def result(self, name):
        """The result written for ``name``, taken off the queue; None when there is none (yet, or readable)."""
        path = os.path.join(self.directory, "results", f"{name}.json")
        try:
            with open(path, encoding="utf-8") as handle:
                found = json.load(handle)
        except (OSError, ValueError):
            return None
        os.unlink(path)
        return found


class ActionModule(NormalAction):
    """``normal``, after the controller's checks and defaults, with the module's payload restored before and kept
    after (module docstring)."""

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        options_problem = self._options_from_variables(task_vars)
        args = self._task.args
        given = args.get("run_id")
        problem = run_id_problem(given) if given not in (None, "") else None
        kind = "invalid"
        # A run id the task gives names the run; one that cannot is never used (it would name the report's file).
        run_id = given if given not in (None, "") and problem is None else self._run_id()
        if options_problem:
            problem, kind = options_problem, "invalid"
        if problem is None and "pve_vmid" in task_vars:
            kind = "inventory"
            # The inventory's own variables, not the options: a task may pass a vmid of its own (the module checks
            # that), but pve_vmid set without pve_node, or set to null, names its target wrongly.
            problem = inventory_problem(
                task_vars.get("inventory_hostname"),
                True,
                self._templar.template(task_vars["pve_vmid"]),
                "pve_node" in task_vars,
                self._templar.template(task_vars["pve_node"]) if "pve_node" in task_vars else None,
            )
        if not problem:
            problem = renamed_variable_problem(task_vars.get("inventory_hostname"), task_vars)
            kind = "inventory" if problem else kind
        if not problem and args.get("batch"):
            problem, kind = "batch is filled in by the action (per_node), never by a task", "invalid"
        if not problem:
            problem, kind = self._settings_from_variables(task_vars), "invalid_step"
        if problem:
            self._mark_arrival(task_vars)  # it will never post: the other hosts' reads need not wait for it
            # Before any connection: a vmid that is not a CT id never reaches a node.
            return {"failed": True, "changed": False, "msg": problem, "error": kind, "run_id": run_id}
        args["run_id"] = run_id
        for option, value in controller_defaults().items():
            if args.get(option) in (None, ""):
                args[option] = value
        queue = self._node_queue(task_vars)
        if queue is None:
            self._mark_arrival(task_vars)  # read alone (a bare host, per_node off): nobody waits for it
        result = self._read_with_node(queue, tmp, task_vars) if queue else self._read_alone(tmp, task_vars)
        result["run_id"] = run_id  # the report names the run by it, whether the pass succeeded or not
        return result

    def _options_from_variables(self, task_vars):
        """Fill in the options the task leaves out from the preflight role's variables, where it asks
        (``options_from_variables``: options_from_variables); the option is the action's own, taken off the task's
        options once they are read (a retried task, retries/until, reads them again if this read failed). Returns a
        problem, or None."""
        args = self._task.args
        if not boolean(args.get("options_from_variables", False), strict=False):
            args.pop("options_from_variables", None)
            return None
        host = task_vars.get("inventory_hostname")
        try:
            args.update(options_from_variables(args, variable_reader(self._templar, task_vars), host))
        except StepSpecError as error:
            return f"{host}: {error}"
        args.pop("options_from_variables")
        return None

    def _settings_from_variables(self, task_vars):
        """Fill ``steps`` with the settings of the steps ``steps_from_variables`` names, read from their roles'
        variables (pve_steps.settings_from_variables); a step ``steps`` gives keeps the settings given. The option
        is the action's own: taken off the task's options once it is read, so neither the module nor the other
        targets of a node's read get it. Returns a problem, or None.

        The variables are templated with this target's task variables; a value that templates to ``omit`` is not
        set (the acting task, templating the same variable, omits the option too). On ansible-core 2.21, Ansible's
        connection variables of the play context are not among them (a setting that names one is undefined here)."""
        args = self._task.args
        names = args.get("steps_from_variables") or []
        if not names:
            args.pop("steps_from_variables", None)
            return None
        given = args.get("steps") or {}
        host = task_vars.get("inventory_hostname")
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            known = ", ".join(pve_steps.STEP_NAMES)
            return f"{host}: steps_from_variables must be a list of step names ({known}), not {names!r}"
        if not isinstance(given, dict):
            return f"{host}: steps must be a dict of each step's settings by step name, not a {type(given).__name__}"

        try:
            read = settings_from_variables(names, variable_reader(self._templar, task_vars))
        except StepSpecError as error:
            return f"{host}: {error}"
        # Only now: a retried task (retries/until) reads them again if this read failed.
        args.pop("steps_from_variables")
        args["steps"] = {**read, **given}
        return None

    def _read_alone(self, tmp, task_vars, batch=None):
        """This target's pass (and ``batch``'s, the other targets' options) in one module execution."""
        args = self._task.args
        if batch:
            args["batch"] = batch
        release = self._first_to_node()
        try:
            return self._run_keeping_payload(tmp, task_vars)
        except AnsibleConnectionFailure as error:
            # What TaskExecutor makes of it, with the run's id: an unreachable node's report is named by it too.
            # Ansible's own words depend on when ssh died ("Connection refused" names the port, a "Broken pipe"
            # while the payload was written names only the address): the node is named whatever they say.
            node = args.get("node_name") or task_vars.get("inventory_hostname")
            return {"unreachable": True, "msg": unreachable_message(node, error)}
        finally:
            release()
            args.pop("batch", None)

    def _read_with_node(self, queue, tmp, task_vars):
        """This target's pass read with every other target of its node waiting then (NodeQueue).

        A fork that finds no result of its own when it gets the node's lock reads: its own target and every one
        waiting. So no fork ever waits on another for good: whatever the reading fork met (its module failed
        before it read the others, it raised, a file could not be written), the targets it did not answer are
        queued again and the next fork to get the lock reads them."""
        try:
            mine = queue.post(task_options(self._task.args), host=task_vars.get("inventory_hostname"))
        except Exception as error:  # by design: the queue only saves time
            display.vvv(f"target_facts: not queued ({type(error).__name__}: {error}); this target is read alone")
            return self._read_alone(tmp, task_vars)
        descriptor = queue.hold()
        try:
            if descriptor is None:  # the node's lock cannot be had: this target is read alone, and once
                if queue.withdraw(mine):
                    return self._read_alone(tmp, task_vars)
                # A reader claimed it before: its answer comes (reading it here too would read the target twice).
                found = queue.await_result(mine, self._result_wait(queue))
                return found if found is not None else self._read_alone(tmp, task_vars)
            found = queue.result(mine)
            if found is None:
                return self._lead(queue, mine, tmp, task_vars)
        finally:
            if descriptor is not None:
                os.close(descriptor)  # lets the lock go
            queue.withdraw(mine)  # a fork that leaves unread (a task timeout, ^C) is never read by another
        return found

    def _result_wait(self, queue):
        """How long a fork waits for the reader that claimed its request: that reader's gathering, then its read at
        the worst the pass's own deadlines allow (a few commands of ``timeout`` each), and RESULT_WAIT_SLACK."""
        try:
            timeout = int(self._task.args.get("timeout") or DEFAULT_TIMEOUT)
        except (TypeError, ValueError):
            timeout = DEFAULT_TIMEOUT
        gathering = max(GATHER_LONGEST, GATHER_PER_HOST * len(queue.expected))
        return gathering + 3 * (timeout + KILL_GRACE) + RESULT_WAIT_SLACK

    def _lead(self, queue, mine, tmp, task_vars):
        """Read this target and every target waiting on its node in one module execution; answer each of them."""
        with contextlib.suppress(OSError):
            queue.gather()  # the rest of the play batch: linear starts their forks tens of ms apart
        claimed = [(name, options) for name, options in queue.claim() if name != mine]
        answered = set()
        try:
            result = self._read_alone(tmp, task_vars, batch_items([o for _name, o in claimed], self._task.args))
            others = result.pop("batch", None)
            invocation = result.get("invocation") or {}
            # Where Ansible adds the invocation, this target's shows its own options, not the batch: the module
            # leaves it out, but not when its options failed AnsibleModule's own checks (Ansible echoes them all).
            (invocation.get("module_args") or {}).pop("batch", None)
            if result.get("unreachable"):
                others = [dict(result) for _claimed in claimed]  # one node, one timeout for all of them
            if not isinstance(others, list) or len(others) != len(claimed):
                return result  # not read (this target's own options failed the module, say): queued again below
            for (name, options), other in zip(claimed, others, strict=True):
                if invocation and isinstance(other, dict):
                    other.setdefault("invocation", {"module_args": options})
                queue.answer(name, other)
                answered.add(name)
            return result
        finally:
            for name, options in claimed:
                if name not in answered:
                    with contextlib.suppress(Exception):
                        queue.post(options, name)

    def _node_queue(self, task_vars):
        """The queue of this target's node (NodeQueue), or None when it is read alone: ``per_node`` off, a bare
        host (no vmid), one host in the play batch, one fork, or a queue that cannot be made (then said at -vvv)."""
        args = self._task.args
        # As the module reads it: "false" from an extra var is false.
        if not boolean(args.get("per_node", True), strict=False) or args.get("vmid") in (None, ""):
            return None
        play_batch = task_vars.get("ansible_play_batch") or ()
        parallel = self._parallel()
        if len(play_batch) < 2 or getattr(self._task, "async_val", 0) or parallel == 1:
            return None  # one at a time: no other target is ever waiting to share the read
        try:
            delegated = (task_vars.get("ansible_delegated_vars") or {}).get(self._task.delegate_to) or {}
            context = self._play_context
            # Targets share an execution only where it reaches the very same node the very same way.
            reach = [
                self._task.delegate_to,
                getattr(self._connection, "transport", None),
                context.remote_addr,
                context.port,
                context.remote_user,
                context.private_key_file,
                context.become,
                context.become_user,
                context.become_method,
                context.check_mode,
                # The node's own connection variables (its ssh arguments, a jump host, its interpreter).
                {k: v for k, v in delegated.items() if k.startswith("ansible_") and isinstance(v, (str, int, bool))},
                self._task.environment,
                self._task.no_log,
                self._task._uuid,
            ]
            key = hashlib.sha256(json.dumps(reach, default=str).encode()).hexdigest()[:32]
            # Every node's queue of this task marks the hosts that came, so a read knows when none of its play
            # batch is left to wait for.
            return NodeQueue(
                os.path.join(C.DEFAULT_LOCAL_TMP, QUEUE_DIR, key),
                arrivals=self._arrivals(),
                expected=play_batch,
                idle=GATHER_IDLE_COVERED if parallel is not None and parallel >= len(play_batch) else GATHER_IDLE,
            )
        except Exception as error:  # by design: the queue only saves time; the target is then read alone
            display.vvv(f"target_facts: no node queue ({type(error).__name__}: {error}); this target is read alone")
            return None

    def _arrivals(self):
        """The directory where the hosts of this task mark their arrival (NodeQueue), every node's the same."""
        task_key = hashlib.sha256(str(self._task._uuid).encode()).hexdigest()[:32]
        return os.path.join(C.DEFAULT_LOCAL_TMP, QUEUE_DIR, f"arrivals-{task_key}")

    def _parallel(self):
        """How many hosts run this task at once: ``--forks``, or the task's ``throttle`` where lower; None when
        unknown (Ansible driven without its command line)."""
        forks = ansible_context.CLIARGS.get("forks")
        throttle = getattr(self._task, "throttle", 0)
        if not isinstance(forks, int):
            return None
        return min(forks, throttle) if isinstance(throttle, int) and throttle > 0 else forks

    def _mark_arrival(self, task_vars):
        """Mark this host as come without queueing it (it is read alone, or fails before): a read of another
        node's targets then stops waiting for it at once instead of after an idle wait."""
        if len(task_vars.get("ansible_play_batch") or ()) < 2:
            return
        try:
            NodeQueue.mark_arrival(self._arrivals(), task_vars.get("inventory_hostname"))
        except Exception as error:  # by design: a mark only saves the others a wait
            display.vvv(f"target_facts: arrival not marked ({type(error).__name__}: {error})")

    @staticmethod
    def _run_id():
        """The run's shared id; one of the target's own, with a warning, when Ansible's temp directory is unusable."""
        run_id = shared_run_id(C.DEFAULT_LOCAL_TMP)
        if run_id is None:
            display.warning(
                f"target_facts: cannot share the run's id through {C.DEFAULT_LOCAL_TMP}; each target names its own"
            )
            run_id = new_run_id()
        return run_id

    def _master_socket(self):
        """The node's ssh master socket, or None when this connection's is not one to guard (the module docstring)."""
        connection = self._connection
        if getattr(connection, "transport", None) != "ssh" or connection.get_option("password"):
            return None
        connection.host = connection.get_option("host") or self._play_context.remote_addr
        argv = connection._build_command(connection.get_option("ssh_executable"), "ssh", "-O", "check", connection.host)
        return control_socket(argv)

    def _first_to_node(self):
        """Before this fork's module run: wait while another fork opens the node's master; when this one is the
        first, hold the lock until its own connection's socket appears. Returns what lets the lock go (idempotent)."""
        try:
            socket = self._master_socket()
            if socket is None or os.path.exists(socket):
                return lambda: None
            descriptor = lock_beside(socket)
        except Exception as error:  # by design: Ansible's internals or the lock file, never a failure of the run
            display.vvv(f"target_facts: no shared ssh master ({type(error).__name__}: {error}); ssh connects alone")
            return lambda: None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # Another fork is opening the master: wait for it, then share its socket, or (its node did not answer)
            # connect alone at once.
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            os.close(descriptor)
            return lambda: None
        if os.path.exists(socket):
            os.close(descriptor)
            return lambda: None
        return master_watch(socket, descriptor)

    def _run_keeping_payload(self, tmp, task_vars):
        place = guarded("looked up", self._payload_place)
        if place:
            guarded("restored", restore, *place)
        result = super().run(tmp, task_vars)
        if place:
            guarded("kept", keep, *place)
        return result

    def _payload_place(self):
        """``(store, key, local_cache, fqn)``, or None when the payload is not to be kept (see the docstring)."""
        if not known_ansible(ansible.__version__):
            display.vvv(
                f"target_facts: ansible-core {ansible.__version__} is not one the AnsiballZ payload store knows "
                f"({', '.join(f'{major}.{minor}' for major, minor in sorted(KNOWN_ANSIBLE))}): Ansible builds the "
                "payload itself"
            )
            return None
        try:
            module_path = self._shared_loader_obj.module_loader.find_plugin(self._task.action, mod_type=".py")
            if not module_path:
                return None
            local_tmp = C.DEFAULT_LOCAL_TMP  # Ansible's per-process directory; its cache is <it>/ansiballz_cache
            store = os.path.join(os.path.dirname(local_tmp), STORE_NAME)
            if not private_dir(store):
                return None
            # The collection's module_utils (plugins/modules/../module_utils) and any configured directory.
            collection_utils = os.path.join(os.path.dirname(os.path.dirname(module_path)), "module_utils")
            key = payload_key(module_path, [collection_utils, *(C.DEFAULT_MODULE_UTILS_PATH or [])])
            fqn = module_fqn(module_path)
        except (OSError, AttributeError, ValueError) as error:
            display.vvv(f"target_facts: AnsiballZ payload not kept: {error}")
            return None
        return store, key, os.path.join(local_tmp, "ansiballz_cache"), fqn
