"""target_facts' action: the controller's share of the fact pass, so that a converged run is this one task.

Before the module runs, on the controller and at no remote cost: the inventory is checked (``pve_vmid`` a CT id,
``pve_node`` set beside it), the run is named (``run_id``: one id for every target of one ansible-playbook run)
and the lock's ``owner``, ``controller`` and ``controller_pid`` are filled in when the task leaves them out. Each of
these was a task of its own (a set_fact, an assert, two ``pipe`` lookups), and every task costs a worker process.

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
from ansible.errors import AnsibleConnectionFailure
from ansible.plugins.action.normal import ActionModule as NormalAction
from ansible.utils.display import Display

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
# A run id names report files and lock records: a path component of safe characters only.
RUN_ID_SHAPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


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


class ActionModule(NormalAction):
    """``normal``, after the controller's checks and defaults, with the module's payload restored before and kept
    after (module docstring)."""

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        args = self._task.args
        given = args.get("run_id")
        problem = run_id_problem(given) if given not in (None, "") else None
        kind = "invalid"
        # A run id the task gives names the run; one that cannot is never used (it would name the report's file).
        run_id = given if given not in (None, "") and problem is None else self._run_id()
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
        if problem:
            # Before any connection: a vmid that is not a CT id never reaches a node.
            return {"failed": True, "changed": False, "msg": problem, "error": kind, "run_id": run_id}
        args["run_id"] = run_id
        for option, value in controller_defaults().items():
            if args.get(option) in (None, ""):
                args[option] = value
        release = self._first_to_node()
        try:
            result = self._run_keeping_payload(tmp, task_vars)
        except AnsibleConnectionFailure as error:
            # What TaskExecutor makes of it, with the run's id: an unreachable node's report is named by it too.
            # Ansible's own words depend on when ssh died ("Connection refused" names the port, a "Broken pipe"
            # while the payload was written names only the address): the node is named whatever they say.
            node = args.get("node_name") or task_vars.get("inventory_hostname")
            return {"unreachable": True, "msg": unreachable_message(node, error), "run_id": run_id}
        finally:
            release()
        result["run_id"] = run_id  # the report names the run by it, whether the pass succeeded or not
        return result

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
