"""plugins/action/target_facts.py: the controller's share of the fact pass (the inventory check, the run's id, who
runs it) and the fact pass's AnsiballZ payload kept between runs, never a stale one.

Each part is tested as functions; then real ``ansible`` processes show one run id for every host of a run, an
inventory mistake failing before any connection, and a second process using the payload the first one built
(ansible-core's own debug line says which it did).
"""

import importlib.util
import json
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time
import types

import pytest
import yaml
from ansible.module_utils import _internal as module_internal

controller = module_internal.is_controller
from ansible.parsing.dataloader import DataLoader  # noqa: E402
from ansible.template import Templar, trust_as_template  # noqa: E402
from ansible.utils.context_objects import CLIArgs  # noqa: E402
from ansible_collections.pve_gpu.recover.plugins.plugin_utils import (  # noqa: E402
    node_queue,
    payload_store,
    run_identity,
    settings,
)

from tests.conftest import ROOT  # noqa: E402

# Importing controller code flips module_utils to controller semantics; the module tests in this process need it back
# (the plugin itself is loaded only when these tests run: the fixture below).
module_internal.is_controller = controller


@pytest.fixture(scope="module")
def action():
    """The plugin, loaded by path under its own name (``target_facts`` is plugins/modules/target_facts.py to the other
    tests) and only when these tests run: importing Ansible's action machinery changes how AnsibleModule's warnings
    reach the module tests that run in the same process."""
    spec = importlib.util.spec_from_file_location(
        "action_target_facts", ROOT / "plugins" / "action" / "target_facts.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FQN = "ansible_collections.pve_gpu.recover.plugins.modules.target_facts"
PAYLOAD = f"{FQN}-ZIP_DEFLATED-none"


@pytest.fixture
def code(tmp_path):
    """A module and two module_utils directories, like library/ and module_utils/."""
    module = tmp_path / "library" / "target_facts.py"
    module.parent.mkdir()
    module.write_text("print('module')\n")
    utils = tmp_path / "module_utils"
    (utils / "sub").mkdir(parents=True)
    (utils / "pve_target.py").write_text("X = 1\n")
    (utils / "sub" / "deep.py").write_text("Y = 1\n")
    return module, utils


def key(action, module, utils, **kwargs):
    return payload_store.payload_key(str(module), [str(utils)], **kwargs)


def test_the_key_changes_with_everything_the_payload_is_built_from_and_nothing_else(action, code):
    module, utils = code
    first = key(action, module, utils)
    assert first == key(action, module, utils) and len(first) == 32
    (utils / "__pycache__").mkdir()
    (utils / "__pycache__" / "pve_target.cpython-312.pyc").write_bytes(b"\0")
    (utils / "README.md").write_text("docs are not code\n")
    assert key(action, module, utils) == first
    (utils / "sub" / "deep.py").write_text("Y = 2\n")
    changed_util = key(action, module, utils)
    assert changed_util != first
    (utils / "new.py").write_text("")
    assert key(action, module, utils) != changed_util
    before_module = key(action, module, utils)
    module.write_text("print('module, edited')\n")
    assert key(action, module, utils) != before_module
    assert key(action, module, utils, ansible_version="2.21.0") != key(action, module, utils, ansible_version="2.21.5")
    assert key(action, module, utils, python="3.12.1") != key(action, module, utils, python="3.13.0")


def test_a_payload_is_kept_restored_into_a_new_process_cache_and_never_over_one_ansible_built(action, tmp_path):
    store, built, fresh = tmp_path / "store", tmp_path / "run1", tmp_path / "run2"
    store.mkdir(mode=0o700)
    built.mkdir()
    (built / PAYLOAD).write_bytes(b"payload 1")
    (built / f"{PAYLOAD}.lock").write_bytes(b"")
    (built / "ansible.legacy.command-ZIP_DEFLATED-none").write_bytes(b"another module")
    assert payload_store.keep(str(store), "k1", str(built), FQN) == 1
    assert sorted(os.listdir(store / "k1")) == [PAYLOAD]
    assert payload_store.keep(str(store), "k1", str(built), FQN) == 0  # already kept
    assert payload_store.restore(str(store), "k1", str(fresh), FQN) == 1
    assert (fresh / PAYLOAD).read_bytes() == b"payload 1"
    assert oct((fresh).stat().st_mode & 0o777) == "0o700"
    (fresh / PAYLOAD).write_bytes(b"built by this process")
    assert payload_store.restore(str(store), "k1", str(fresh), FQN) == 0
    assert (fresh / PAYLOAD).read_bytes() == b"built by this process"
    assert payload_store.restore(str(store), "another key", str(tmp_path / "run3"), FQN) == 0
    assert not (tmp_path / "run3").exists()


def test_the_store_keeps_the_newest_keys_only(action, tmp_path):
    store, built = tmp_path / "store", tmp_path / "built"
    store.mkdir()
    built.mkdir()
    (built / PAYLOAD).write_bytes(b"payload")
    for number in range(6):
        payload_store.keep(str(store), f"k{number}", str(built), FQN, limit=3)
        os.utime(store / f"k{number}", (1000 + number, 1000 + number))
    assert sorted(os.listdir(store)) == ["k3", "k4", "k5"]


def test_a_store_others_can_write_is_not_used(action, tmp_path):
    store = tmp_path / "store"
    assert payload_store.private_dir(str(store))
    assert oct(store.stat().st_mode & 0o777) == "0o700"
    store.chmod(0o777)
    assert not payload_store.private_dir(str(store))
    store.chmod(0o700)
    if os.geteuid() == 0:
        os.chown(store, 65534, 65534)
        assert not payload_store.private_dir(str(store))
    (tmp_path / "file").write_text("")
    assert not payload_store.private_dir(str(tmp_path / "file"))


def test_the_store_knows_the_supported_ansible_core_range_only(action):
    for known in ("2.19.0", "2.19.14", "2.20.3", "2.21.5", "2.21.0rc1", "2.21"):
        assert payload_store.known_ansible(known), known
    for unknown in ("2.18.12", "2.22.0", "2.22.0.dev0", "2.190.1", "3.19.1", "", "devel", None):
        assert not payload_store.known_ansible(unknown), unknown


def test_the_ansible_core_under_test_is_one_the_store_knows(action):
    """`make test` runs these tests on each end of the supported range (.venv: 2.19, .venv-latest: 2.21), so the
    tests below that run real ansible processes prove the store on both; an ansible-core outside the range would
    only prove the fallback."""
    import ansible  # noqa: PLC0415 (the plugin's ansible, imported with it)

    assert payload_store.known_ansible(ansible.__version__), (
        f"ansible-core {ansible.__version__}: add it to KNOWN_ANSIBLE"
    )


def test_a_store_failure_of_any_kind_is_none(action):
    def broken():
        raise RuntimeError("an internal Ansible moved")

    assert payload_store.guarded("kept", broken) is None
    assert payload_store.guarded("kept", lambda a, b: a + b, 1, 2) == 3


# -- the inventory, the run's id, who runs it ------------------------------------------------------------------
SHAPE = "pve_vmid must be a Proxmox CT id (an integer from 100 to 999999999) with pve_node naming its node"


def test_the_inventory_is_checked_as_the_preflight_role_documents_it(action):
    assert settings.inventory_problem("bare", False, None, False, None) is None  # a bare GPU host
    assert settings.inventory_problem("ct200", True, 200, True, "pve1") is None
    assert settings.inventory_problem("ct200", True, "200", True, "pve1") is None  # `-e pve_vmid=200` is a string
    assert settings.inventory_problem("ct", True, 999999999, True, "pve1") is None
    # None: `pve_vmid:` left empty. Unchecked, the CT would become a bare host: its node.
    for vmid in (None, "", 99, 1000000000, "200; touch /tmp/x", "$(id)", "2e2", " 200", True, 200.0, -200):
        problem = settings.inventory_problem("ct", True, vmid, True, "pve1")
        assert problem.startswith(f"ct: {SHAPE}; got pve_vmid={json.dumps(str(vmid))}, pve_node=pve1."), vmid
        assert problem.endswith("Fix the inventory.")
    assert settings.inventory_problem("ct200", True, 200, False, None) == (
        f'ct200: {SHAPE}; got pve_vmid="200", pve_node=unset. Fix the inventory.'
    )


def test_a_role_variable_renamed_in_a_major_version_is_named_with_its_new_name(action):
    assert settings.renamed_variable_problem("ct", {"pve_vmid": 200, "training_venv_python_version": "3.11"}) == ""
    assert settings.renamed_variable_problem("ct", {"training_venv_python": None}) == (
        "ct: training_venv_python was renamed training_venv_python_version in pve_gpu.recover 2.0.0 "
        "(CHANGELOG.md); rename it"
    )


def test_a_run_id_of_the_tasks_own_must_be_able_to_name_a_file(action):
    for good in ("20261204T101500Z-3f2a1c", "ops-4711", "a", "nightly.2026_12_04", "x" * 64):
        assert run_identity.run_id_problem(good) is None, good
    for bad in ("../../etc", "OPS/123", ".hidden", "-x", "x" * 65, "with space", "", None, 4711):
        assert run_identity.run_id_problem(bad).startswith(f"run_id {json.dumps(str(bad))} cannot name a run"), bad


RUN_ID = re.compile(r"[0-9]{8}T[0-9]{6}Z-[0-9a-f]{6}")


def test_a_run_id_is_the_utc_time_and_random_hex(action):
    assert run_identity.new_run_id(0).startswith("19700101T000000Z-")
    ids = {run_identity.new_run_id() for _ in range(50)}
    assert len(ids) == 50 and all(RUN_ID.fullmatch(i) for i in ids)


def _ask(action, directory, start, answers):
    start.wait()
    answers.put(run_identity.shared_run_id(directory))


def test_every_worker_of_one_run_reads_the_id_the_first_one_made(action, tmp_path):
    """Workers forked at once race to name the run: every one of them gets the same, complete id."""
    context = multiprocessing.get_context("fork")
    start, answers = context.Event(), context.Queue()
    workers = [context.Process(target=_ask, args=(action, str(tmp_path), start, answers)) for _ in range(12)]
    for worker in workers:
        worker.start()
    start.set()
    ids = {answers.get(timeout=30) for _ in workers}
    for worker in workers:
        worker.join(30)
    assert len(ids) == 1 and RUN_ID.fullmatch(ids.pop())
    assert os.listdir(tmp_path) == [run_identity.RUN_ID_FILE]  # no temporary file left behind
    assert run_identity.shared_run_id(str(tmp_path)) == (tmp_path / run_identity.RUN_ID_FILE).read_text()


def test_a_run_id_is_none_where_the_temp_directory_cannot_be_used(action, tmp_path):
    assert run_identity.shared_run_id(str(tmp_path / "missing")) is None


def test_who_runs_it_is_filled_in_from_the_controller(action):
    defaults = run_identity.controller_defaults({"USER": "alice", run_identity.CONTROLLER_PID_ENV: "4242"})
    assert defaults["controller"] and defaults["owner"] == f"alice@{defaults['controller']}"
    assert defaults["controller_pid"] == 4242
    # Without the callback's variable, the worker's parent (ansible-playbook): a run is never without its pid.
    assert (
        run_identity.controller_defaults({"USER": "alice", run_identity.CONTROLLER_PID_ENV: "x"}, 77)["controller_pid"]
        == 77
    )
    assert run_identity.controller_defaults({})["controller_pid"] == os.getppid()
    assert run_identity.controller_defaults({})["owner"].endswith(f"@{defaults['controller']}")


# An unknown step fails the module on the node before it reads or locks anything: enough to see the action work.
UNKNOWN_STEP = '{"steps": {"nope": {}}}'


def ansible_env(local_tmp):
    """The environment of a real ansible process of these tests: the project's config, Ansible's temp directory
    in ``local_tmp``, the report callback writing to ``<local_tmp>/reports``."""
    return dict(
        os.environ,
        ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
        PYTHONPATH=os.pathsep.join(p for p in [str(local_tmp / "site"), os.environ.get("PYTHONPATH")] if p),
        ANSIBLE_LOCAL_TEMP=str(local_tmp),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_LOAD_CALLBACK_PLUGINS="1",
        PVE_GPU_RECOVER_REPORT_DIR=str(local_tmp / "reports"),
    )


def ad_hoc(local_tmp, hosts, *args, debug=False):
    """The real module through the action, in its own ansible process; ``args`` after the host pattern. The
    project's report callback writes each host's result to ``<local_tmp>/reports/<host>/<run id>.json``."""
    env = ansible_env(local_tmp)
    if debug:
        env["ANSIBLE_DEBUG"] = "1"
    argv = [os.path.join(os.path.dirname(sys.executable), "ansible"), "all", "-i", hosts, *args]
    argv += ["-e", f"ansible_python_interpreter={sys.executable}", "-m", "pve_gpu.recover.target_facts"]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)


def reports_of(local_tmp):
    """``{host: [report, ...]}`` of every run so far."""
    reports = {}
    for path in sorted((local_tmp / "reports").glob("*/*.json")):
        reports.setdefault(path.parent.name, []).append(json.loads(path.read_text()))
    return reports


def test_every_target_of_one_run_shares_its_id_and_a_failed_pass_still_carries_it(tmp_path):
    done = ad_hoc(tmp_path, "h1,h2,h3,", "-c", "local", "-f", "3", "-a", UNKNOWN_STEP)
    reports = reports_of(tmp_path)
    assert sorted(reports) == ["h1", "h2", "h3"], done.stdout[-2000:] + done.stderr[-2000:]
    assert all("unknown step(s) nope" in r["error"]["msg"] for (r,) in reports.values())
    (run_id,) = {r["run_id"] for (r,) in reports.values()}
    assert RUN_ID.fullmatch(run_id)
    ad_hoc(tmp_path, "h1,", "-c", "local", "-a", UNKNOWN_STEP)
    first, second = reports_of(tmp_path)["h1"]
    assert second["run_id"] != first["run_id"]  # another run, another id


# Every host here is reached over ssh at a closed port: a task that reaches for one is `unreachable` at once.
CLOSED = "{ansible_host: 127.0.0.1, ansible_port: 9, ansible_connection: ssh}"


def test_an_inventory_mistake_fails_before_any_connection(tmp_path):
    hosts = tmp_path / "hosts.yml"
    hosts.write_text(
        "all:\n  vars: " + CLOSED + "\n  hosts:\n"
        "    ct1: {pve_vmid: '200; touch /tmp/pgr-pwned', pve_node: pve1}\n"
        "    ct2: {pve_vmid: 201}\n"
        "    ct3: {pve_vmid: null, pve_node: pve1}\n"
        "    ct4: {pve_vmid: 204, pve_node: pve1, training_venv_python: '3.11'}\n"
    )
    args = '{"vmid": "{{ pve_vmid }}", "node_name": "{{ pve_node | default(inventory_hostname) }}", "steps": {}}'
    done = ad_hoc(tmp_path, str(hosts), "-a", args)
    errors = {host: report["error"] for host, (report,) in reports_of(tmp_path).items()}
    assert errors["ct1"]["msg"] == (
        f'ct1: {SHAPE}; got pve_vmid="200; touch /tmp/pgr-pwned", pve_node=pve1. Fix the inventory.'
    ), done.stdout[-2000:]
    assert errors["ct2"]["msg"] == f'ct2: {SHAPE}; got pve_vmid="201", pve_node=unset. Fix the inventory.'
    assert errors["ct3"]["msg"] == f'ct3: {SHAPE}; got pve_vmid="None", pve_node=pve1. Fix the inventory.'
    assert errors["ct4"]["msg"] == (
        "ct4: training_venv_python was renamed training_venv_python_version in pve_gpu.recover 2.0.0 "
        "(CHANGELOG.md); rename it"
    )
    assert {e["kind"] for e in errors.values()} == {"inventory"}
    assert "UNREACHABLE" not in done.stdout


def test_a_vmid_the_task_gives_itself_is_the_modules_to_check_and_an_unreachable_node_keeps_the_run_id(tmp_path):
    """No pve_vmid in the inventory (the module's EXAMPLES): the action checks nothing of it and reaches for the
    node, here unreachable; that result still carries the run's id, which names the report."""
    hosts = tmp_path / "hosts.yml"
    hosts.write_text("all:\n  hosts:\n    pve1: " + CLOSED + "\n")
    done = ad_hoc(tmp_path, str(hosts), "-a", '{"vmid": 200, "run_id": "ops-4711", "steps": {}}')
    assert "UNREACHABLE" in done.stdout, done.stdout[-2000:]
    assert "the node pve1 could not be reached: " in done.stdout  # named, whatever ssh's failure said
    (report,) = reports_of(tmp_path)["pve1"]
    assert (report["run_id"], report["status"]) == ("ops-4711", "failed")
    assert (tmp_path / "reports" / "pve1" / "ops-4711.json").exists()


def test_a_run_id_that_cannot_name_a_file_fails_and_names_nothing(tmp_path):
    done = ad_hoc(tmp_path, "localhost,", "-c", "local", "-a", '{"run_id": "../../escaped", "steps": {}}')
    (report,) = reports_of(tmp_path)["localhost"]
    assert report["error"]["kind"] == "invalid", done.stdout[-2000:]
    assert report["error"]["msg"].startswith('run_id "../../escaped" cannot name a run')
    assert RUN_ID.fullmatch(report["run_id"])  # the report is named by an id of the action's own
    assert not list(tmp_path.rglob("escaped*"))


# -- the steps' settings read from their roles' variables (steps_from_variables) ----------------------------------
def test_the_steps_settings_are_read_from_the_variables_and_given_settings_win(action):
    """The action's own option, never the module's: the settings of the named steps from their variables, templated
    by Ansible; a step given in ``steps`` keeps those; a step that is off is left out."""
    variables = {
        "verify_gpu_name": "NVIDIA H200",
        "verify_gpu_count": trust_as_template("{{ gpus | int }}"),
        "gpus": "8",
        "gpu_processes_enabled": trust_as_template("{{ 'no' }}"),
        "training_code_grace": "not a setting of any step: never read",
        "verify_enabled": True,
        "verify_torch_version": trust_as_template("{{ omit }}"),  # not set: the module's default, as the task omits it
    }
    instance = action.ActionModule.__new__(action.ActionModule)
    instance._templar = Templar(loader=DataLoader(), variables=variables)
    instance._task = Task({"steps_from_variables": ["verify", "gpu_processes", "preflight"], "steps": {}})
    assert instance._settings_from_variables(variables) is None
    assert instance._task.args == {"steps": {"preflight": {}, "verify": {"gpu_name": "NVIDIA H200", "gpu_count": 8}}}
    given = {"verify": {"gpu_count": 4}}
    instance._task = Task({"steps_from_variables": ["verify"], "steps": given})
    assert instance._settings_from_variables(variables) is None
    assert instance._task.args == {"steps": given}
    instance._task = Task({"steps": given})  # nothing to read: the task's steps as they are
    assert instance._settings_from_variables(variables) is None and instance._task.args == {"steps": given}
    instance._task = Task({"steps_from_variables": "verify"})
    assert instance._settings_from_variables({"inventory_hostname": "ct1"}) == (
        "ct1: steps_from_variables must be a list of step names (preflight, gpu_processes, training_code, "
        "training_venv, compile_cache, verify), not 'verify'"
    )
    instance._task = Task({"steps_from_variables": ["verify"], "steps": ["verify"]})
    assert instance._settings_from_variables({"inventory_hostname": "ct1"}) == (
        "ct1: steps must be a dict of each step's settings by step name, not a list"
    )


# -- the pass's own options read from the preflight role's variables (options_from_variables) ---------------------
def role_variables(path):
    return yaml.safe_load((ROOT / "roles" / "preflight" / path).read_text())


def test_the_options_the_task_leaves_out_are_read_as_the_role_passed_them(action):
    """As the preflight role's task templated them before: vmid from pve_vmid, node_name from pve_node else the host,
    the steps to read from preflight and preflight_steps_from_variables, check_run from check mode, the rest from
    preflight_<option>; an unset variable leaves its option out, a false run id or owner too; given options win."""
    variables = {
        **role_variables("defaults/main.yml"),
        "pve_vmid": 301,
        "pve_node": "pve-a",
        "preflight_steps_from_variables": ["gpu_processes", "verify"],
        "preflight_run_id": "",
        "preflight_timeout": 90,
        "ansible_check_mode": True,
    }

    def variable(name):
        return variables[name]  # KeyError when unset, as variable_reader

    assert settings.options_from_variables({}, variable, "ct301") == {
        "vmid": 301,
        "node_name": "pve-a",
        "lock_ttl": 7200,
        "lock_dir": "/run/lock/pve-gpu-recover",
        "python": "python3",
        "timeout": 90,
        "per_node": True,
        "steps": {},
        "steps_from_variables": ["preflight", "gpu_processes", "verify"],
        "check_run": True,
    }  # no run_id (empty) nor owner (null): the action names the run and records who runs it
    del variables["pve_vmid"], variables["pve_node"], variables["preflight_steps_from_variables"]
    variables.update(preflight_run_id="ticket-7", preflight_lock_owner="ops@example", ansible_check_mode=False)
    found = settings.options_from_variables({"timeout": 5, "steps": {"verify": {}}}, variable, "gpu1")
    assert found["node_name"] == "gpu1" and "vmid" not in found  # a bare host, on its own name
    assert found["run_id"] == "ticket-7" and found["owner"] == "ops@example" and found["check_run"] is False
    assert found["steps_from_variables"] == ["preflight"]
    assert "timeout" not in found and "steps" not in found  # the task's own options are kept as given
    # null is passed on as the templates passed it (the module's default; per_node null reads the target alone),
    # except where default(omit, true) left out any false value.
    variables.update(pve_node=None, preflight_per_node=None, preflight_run_id=0, preflight_lock_owner=False)
    found = settings.options_from_variables({}, variable, "ct1")
    assert found["node_name"] is None and found["per_node"] is None
    assert "run_id" not in found and "owner" not in found
    del variables["preflight_lock_dir"]  # unset (outside the role): the module's default, as omit would give
    assert "lock_dir" not in settings.options_from_variables({}, variable, "ct1")
    variables["preflight_steps_from_variables"] = "verify"
    with pytest.raises(action.StepSpecError, match=r"preflight_steps_from_variables must be a list of step names"):
        settings.options_from_variables({}, variable, "ct1")


def test_each_option_is_read_from_the_preflight_roles_own_documented_variable(action):
    """Option <o> from preflight_<o> (the owner from preflight_lock_owner), each set in the role's defaults and
    described in its argument_specs: a typo in the action's table would be a variable nobody sets."""
    options = ["run_id", "lock_ttl", "lock_dir", "python", "timeout", "per_node", "steps"]
    expected = {option: f"preflight_{option}" for option in options}
    assert {**expected, "owner": "preflight_lock_owner"} == settings.OPTION_VARIABLES
    defaults = role_variables("defaults/main.yml")
    specs = role_variables("meta/argument_specs.yml")["argument_specs"]["main"]["options"]
    for variable in [*settings.OPTION_VARIABLES.values(), "preflight_steps_from_variables"]:
        assert variable in defaults and variable in specs, variable


def test_the_options_are_templated_by_ansible_and_read_again_by_a_retry_that_failed(action):
    variables = {
        **role_variables("defaults/main.yml"),
        "pve_vmid": 200,
        "pve_node": "pve1",
        "inventory_hostname": "ct1",
        "ansible_check_mode": False,
        "preflight_lock_dir": trust_as_template("{{ base }}/locks"),
        "base": "/run/lock/mine",
        "preflight_python": trust_as_template("{{ omit }}"),  # not set: the module's default
        "preflight_timeout": trust_as_template("{{ no_such_variable }}"),
    }
    instance = action.ActionModule.__new__(action.ActionModule)
    instance._templar = Templar(loader=DataLoader(), variables=variables)
    instance._task = Task({"options_from_variables": True, "lock_ttl": 60})
    problem = instance._options_from_variables(variables)
    assert problem.startswith("ct1: the variable preflight_timeout (the fact pass's timeout) cannot be templated: ")
    assert "no_such_variable" in problem
    # Ansible runs a retried task's action again on the same options: they are read again, not left out.
    assert instance._task.args == {"options_from_variables": True, "lock_ttl": 60}
    variables["preflight_timeout"] = 30
    instance._templar = Templar(loader=DataLoader(), variables=variables)
    assert instance._options_from_variables(variables) is None
    assert "options_from_variables" not in instance._task.args  # never the module's
    assert instance._task.args["lock_dir"] == "/run/lock/mine/locks" and instance._task.args["timeout"] == 30
    assert instance._task.args["lock_ttl"] == 60 and "python" not in instance._task.args
    instance._task = Task({"options_from_variables": False, "vmid": 200})
    assert instance._options_from_variables(variables) is None and instance._task.args == {"vmid": 200}


def test_a_variable_of_the_role_that_fails_to_template_fails_before_any_connection(tmp_path):
    hosts = tmp_path / "hosts.yml"
    hosts.write_text("all:\n  vars: " + CLOSED + "\n  hosts:\n    ct1: {pve_vmid: 200, pve_node: pve1}\n")
    broken = json.dumps({"preflight_lock_ttl": "{{ no_such_variable }}", "preflight_steps": {}})
    done = ad_hoc(tmp_path, str(hosts), "-a", '{"options_from_variables": true}', "-e", broken)
    (report,) = reports_of(tmp_path)["ct1"]
    assert report["error"]["kind"] == "invalid", done.stdout[-2000:]
    assert report["error"]["msg"].startswith(
        "ct1: the variable preflight_lock_ttl (the fact pass's lock_ttl) cannot be templated: "
    ), report["error"]["msg"]
    assert "UNREACHABLE" not in done.stdout


def test_templating_is_warmed_only_where_tasks_run_and_a_failure_only_leaves_it_undone(action):
    """ansible-playbook (its task queue imported) warms it before it forks; ansible-doc or a sanity test's import of
    the action does not template anything. (A lookup needs Ansible's collection loader, which only a real ansible
    process has: the next test's runs warm the default expression.)"""
    running = {"ansible.executor.task_queue_manager": object()}
    simple = "{{ (none | default('') | string | length > 0) | bool }}"
    assert settings.warm_templating(simple, modules=running, lookups=()) is True
    assert settings.warm_templating(modules={}) is False
    assert settings.warm_templating("{{ undefined_here }}", modules=running, lookups=()) is False
    assert settings.warm_templating("{{ lookup('ansible.builtin.nosuchlookup') }}", modules=running) is False
    assert settings.warm_templating(simple, modules=running, lookups=("nosuchlookup",)) is False


def test_the_lookups_of_the_venv_steps_lock_are_loaded_before_the_forks(action, monkeypatch):
    """The lookups of the venv step's lock are loaded in the process that forks the workers, so none of them loads
    them again (about 2 ms each for the file lookup, docs/benchmarks.md). A collection's lookup needs the collection
    loader of a real ansible process: the next test checks that one loads them all."""
    running = {"ansible.executor.task_queue_manager": object()}
    loaded = []
    monkeypatch.setattr(settings.lookup_loader, "get", lambda name: loaded.append(name) or object())
    assert settings.warm_templating("{{ 1 }}", modules=running) is True
    assert loaded == list(settings.WARM_LOOKUPS)
    monkeypatch.setattr(settings.lookup_loader, "get", lambda name: None)  # a lookup that is not there
    assert settings.warm_templating("{{ 1 }}", modules=running) is False
    assert set(settings.WARM_LOOKUPS) == {"ansible.builtin.file", "pve_gpu.recover.uv_lock"}
    lock_variable = (ROOT / "roles" / "training_venv" / "vars" / "main.yml").read_text()
    assert all(f"lookup('{name}'" in lock_variable for name in settings.WARM_LOOKUPS)  # the lookups it does use


def test_a_wrong_step_name_or_a_variable_that_fails_to_template_fails_before_any_connection(tmp_path):
    hosts = tmp_path / "hosts.yml"
    hosts.write_text("all:\n  vars: " + CLOSED + "\n  hosts:\n    ct1: {pve_vmid: 200, pve_node: pve1}\n")
    done = ad_hoc(tmp_path, str(hosts), "-a", '{"steps_from_variables": ["verify", "nope"]}', "-vvv")
    said = done.stdout + done.stderr
    assert "templating not warmed" not in said and "not loaded before the forks" not in said  # lookups and all
    (report,) = reports_of(tmp_path)["ct1"]
    assert report["error"]["kind"] == "invalid_step", done.stdout[-2000:]
    assert report["error"]["msg"].startswith("ct1: unknown step(s) nope in steps_from_variables (the preflight role's")
    broken = json.dumps({"verify_enabled": True, "verify_gpu_count": "{{ no_such_variable }}"})
    second = tmp_path / "second"
    second.mkdir()
    done = ad_hoc(second, str(hosts), "-a", '{"steps_from_variables": ["verify"]}', "-e", broken)
    (report,) = reports_of(second)["ct1"]
    assert report["error"]["kind"] == "invalid_step", done.stdout[-2000:]
    assert report["error"]["msg"].startswith(
        "ct1: the variable verify_gpu_count (verify's gpu_count) cannot be templated: "
    ), report["error"]["msg"]
    assert "no_such_variable" in report["error"]["msg"]
    assert "UNREACHABLE" not in done.stdout


def run_ad_hoc(local_tmp, *args):
    """The real module through the action, with ansible-core's debug lines (it fails on its steps: enough)."""
    done = ad_hoc(local_tmp, "localhost,", "-c", "local", "-a", UNKNOWN_STEP, *args, debug=True)
    assert "unknown step(s) nope" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout + done.stderr


def test_a_second_ansible_process_uses_the_payload_the_first_one_built(action, tmp_path):
    first = run_ad_hoc(tmp_path)
    assert "ANSIBALLZ: Creating module" in first
    (kept,) = os.listdir(tmp_path / payload_store.STORE_NAME)
    assert os.listdir(tmp_path / payload_store.STORE_NAME / kept) == [PAYLOAD]
    second = run_ad_hoc(tmp_path)
    assert "ANSIBALLZ: using cached module" in second and "ANSIBALLZ: Creating module" not in second


def sitecustomize(local_tmp, code):
    """Python code every process of the next ad hoc runs starts with (before Ansible loads anything)."""
    (local_tmp / "site").mkdir(exist_ok=True)
    (local_tmp / "site" / "sitecustomize.py").write_text(code)


def test_an_ansible_core_the_store_does_not_know_builds_the_payload_itself(action, tmp_path):
    sitecustomize(
        tmp_path,
        "import os, sys\n"
        "if os.path.basename(sys.argv[0]) == 'ansible':  # the controller only, not the module's own python\n"
        "    import ansible\n"
        "    ansible.__version__ = '2.22.0'\n",
    )
    for _ in range(2):
        output = run_ad_hoc(tmp_path, "-vvv")
        assert "ANSIBALLZ: Creating module" in output and "ANSIBALLZ: using cached module" not in output
        assert "ansible-core 2.22.0 is not one the AnsiballZ payload store knows (2.19, 2.20, 2.21)" in output
    assert not (tmp_path / payload_store.STORE_NAME).exists()


def test_any_exception_of_the_store_leaves_the_payload_to_ansible_and_never_fails_the_run(action, tmp_path):
    """The store's directory listings raise what no OSError handler catches: each run still gets its module's
    answer (run_ad_hoc asserts it), Ansible building the payload, and says why at -vvv."""
    sitecustomize(
        tmp_path,
        "import os\n"
        "_listdir = os.listdir\n"
        "def listdir(path='.'):\n"
        f"    if {payload_store.STORE_NAME!r} in os.fsdecode(path):\n"
        "        raise RuntimeError('the store broke')\n"
        "    return _listdir(path)\n"
        "os.listdir = listdir\n",
    )
    outputs = [run_ad_hoc(tmp_path, "-vvv") for _ in range(2)]
    for output in outputs:
        assert "ANSIBALLZ: Creating module" in output and "ANSIBALLZ: using cached module" not in output
        assert "AnsiballZ payload not restored: RuntimeError: the store broke" in output
    assert "AnsiballZ payload not kept: RuntimeError: the store broke" in outputs[0]


def test_the_payload_is_filed_under_the_name_ansible_builds_it_by(action):
    """A collection's module is cached by its collection path; one on a library path as ansible.legacy."""
    collection = "/x/collections/ansible_collections/pve_gpu/recover/plugins/modules/target_facts.py"
    assert payload_store.module_fqn(collection) == "ansible_collections.pve_gpu.recover.plugins.modules.target_facts"
    assert payload_store.module_fqn("/srv/library/target_facts.py") == "ansible.legacy.target_facts"


# -- per node: the targets of one node in one module execution ------------------------------------------------------
MODULE = 0.3  # a module's run over the connection


class Task:
    def __init__(self, args):
        self.args = args


def queued_fork(action, queue, vmid, executions, *, module=MODULE, outcome="read"):
    """One fork as _read_with_node runs it, its module run replaced: it records each execution's targets and
    answers each target with its own vmid. ``outcome``: ``read``, ``unreachable``, ``raise`` or ``fail`` (the
    module failed on this fork's own options before it read the batch) for the run's first execution."""
    fork = action.ActionModule.__new__(action.ActionModule)
    fork._task = Task({"vmid": vmid, "run_id": "run-1"})

    def read_alone(_tmp, _task_vars, batch=None):
        executions.append([vmid, *(options["vmid"] for options in batch or [])])
        time.sleep(module)
        first = len(executions) == 1
        if outcome == "raise" and first:
            raise RuntimeError("the worker broke")
        if outcome == "fail" and first:
            return {"failed": True, "msg": f"Unsupported parameters for CT {vmid}"}
        if outcome == "unreachable":
            return {"unreachable": True, "msg": action.unreachable_message("pve1", "Connection refused")}
        return {"changed": False, "read": vmid, "batch": [{"changed": False, "read": o["vmid"]} for o in batch or []]}

    fork._read_alone = read_alone
    try:
        return fork._read_with_node(queue, None, {"ansible_play_batch": ["a", "b"], "inventory_hostname": f"ct{vmid}"})
    except RuntimeError as error:
        return {"raised": str(error)}


def run_queued(action, queue, vmids, *, stagger=0.0, **kwargs):
    executions, results = [], {}

    def one(vmid):
        results[vmid] = queued_fork(action, queue, vmid, executions, **kwargs)

    threads = []
    for vmid in vmids:
        threads.append(threading.Thread(target=one, args=(vmid,)))
        threads[-1].start()
        time.sleep(stagger)
    for thread in threads:
        thread.join(20)
    assert not any(t.is_alive() for t in threads), "a fork waits for a result that never comes"
    return executions, results


def test_the_forks_of_one_node_are_read_in_one_execution_each_with_its_own_result(action, tmp_path):
    queue = node_queue.NodeQueue(str(tmp_path / "q"))
    executions, results = run_queued(action, queue, range(200, 208), stagger=0.01)
    assert len(executions) == 1 and sorted(executions[0]) == list(range(200, 208))
    assert {vmid: r["read"] for vmid, r in results.items()} == {vmid: vmid for vmid in range(200, 208)}
    assert all("batch" not in r for r in results.values())
    assert not os.listdir(tmp_path / "q" / "requests") and not os.listdir(tmp_path / "q" / "results")


def test_forks_that_come_while_a_read_runs_are_the_next_reads(action, tmp_path):
    """Forks arrive one every 0.1 s for 1.5 s, with a read taking 0.3 s: fewer executions than forks, each target
    in exactly one of them."""
    queue = node_queue.NodeQueue(str(tmp_path / "q"))
    vmids = list(range(200, 216))
    executions, results = run_queued(action, queue, vmids, stagger=0.1)
    assert sorted(v for execution in executions for v in execution) == vmids
    assert len(executions) < len(vmids) / 2
    assert all(results[v]["read"] == v for v in vmids)


def test_an_unreachable_node_fails_every_waiting_target_as_unreachable(action, tmp_path):
    queue = node_queue.NodeQueue(str(tmp_path / "q"))
    executions, results = run_queued(action, queue, [200, 201, 202], stagger=0.01, outcome="unreachable")
    assert len(executions) == 1
    assert all(r["unreachable"] and "the node pve1 could not be reached" in r["msg"] for r in results.values())


@pytest.mark.parametrize("outcome", ["raise", "fail"])
def test_targets_a_read_did_not_answer_are_read_by_the_next_fork(action, tmp_path, outcome):
    """The first read raised, or its own options failed the module before it read the others: that target alone
    fails, and the targets it carried are read by the next fork, together."""
    queue = node_queue.NodeQueue(str(tmp_path / "q"))
    executions, results = run_queued(action, queue, [200, 201, 202, 203], stagger=0.01, outcome=outcome)
    first = executions[0][0]
    assert "raised" in results[first] or results[first]["failed"]
    assert len(executions) == 2 and sorted(executions[1]) == sorted(set(range(200, 204)) - {first})
    assert all(results[v]["read"] == v for v in range(200, 204) if v != first)


def test_a_fork_that_leaves_unread_is_never_read_by_another(action, tmp_path):
    queue = node_queue.NodeQueue(str(tmp_path / "q"))
    gone = queue.post({"vmid": 201})
    queue.withdraw(gone)  # what its fork's `finally` does when a task timeout or ^C ends it in the wait
    executions, _results = run_queued(action, queue, [200])
    assert executions == [[200]]


# A hashed lock of the seeds' size (about 126 KB: 90 pins of 16 hashes), the text every target of a fleet shares.
SHARED_LOCK = "".join(f"pkg-{n:02d}==1.{n}.0 \\\n" + f"    --hash=sha256:{n:064d} \\\n" * 16 for n in range(90))


def test_a_batch_item_sends_what_differs_and_names_what_is_the_tasks_own(action):
    own = {"vmid": 200, "run_id": "r", "steps": {"training_venv": {"lock": SHARED_LOCK}}, "check_run": False}
    same = {"vmid": 201, "run_id": "r", "steps": {"training_venv": {"lock": SHARED_LOCK}}, "check_run": False}
    other_lock = {**same, "steps": {"training_venv": {"lock": SHARED_LOCK + "six==1.17.0\n"}}}
    lacking = {k: v for k, v in same.items() if k != "check_run"}
    items = node_queue.batch_items([same, other_lock, {**same, "owner": "bob@ctl"}, lacking], own)
    assert len(SHARED_LOCK) > 120_000 and items[0] == {"vmid": 201, "same_as_task": ["check_run", "run_id", "steps"]}
    assert items[1] == {"vmid": 201, "steps": other_lock["steps"], "same_as_task": ["check_run", "run_id"]}
    assert items[2] == {"vmid": 201, "owner": "bob@ctl", "same_as_task": ["check_run", "run_id", "steps"]}
    assert items[3] == {"vmid": 201, "same_as_task": ["run_id", "steps"]}  # check_run stays out: its default
    assert node_queue.batch_items([same], {**own, "batch": [{"vmid": 202}]}) == items[:1]  # the batch is never shared


def test_a_batch_item_shares_a_value_only_where_the_module_would_receive_the_same(action):
    """Compared as JSON, as the module receives them: Python's ``1 == 1.0 == True`` would have a host's ``13.0``
    (a str setting: a CUDA version) become another host's ``13``."""
    own = {"vmid": 200, "steps": {"verify": {"cuda_version": 13, "strict": True}}}
    for value in (13.0, "13", True):
        other = {"vmid": 201, "steps": {"verify": {"cuda_version": value, "strict": True}}}
        assert node_queue.batch_items([other], own) == [other]
    assert node_queue.batch_items([{"vmid": 201, "steps": {"verify": {"strict": 1, "cuda_version": 13}}}], own) == [
        {"vmid": 201, "steps": {"verify": {"strict": 1, "cuda_version": 13}}}
    ]
    reordered = {"vmid": 201, "steps": {"verify": {"strict": True, "cuda_version": 13}}}
    assert node_queue.batch_items([reordered], own) == [{"vmid": 201, "same_as_task": ["steps"]}]


def test_a_value_json_cannot_write_is_never_shared_and_travels(action):
    """A dict whose keys mix numbers and strings (YAML allows it) cannot be written with sorted keys: it is sent as
    it is, never named as the task's, and the read goes on."""
    mixed = {"vmid": 200, "steps": {"compile_cache": {"warmup_env": {1: "a", "B": "b"}}}}
    other = {"vmid": 201, "steps": {"compile_cache": {"warmup_env": {"1": "a", "B": "b"}}}}
    assert node_queue.as_json(mixed["steps"]) is None
    assert node_queue.batch_items([other], mixed) == [other]


def test_a_retried_task_never_posts_or_shares_the_keys_ansible_wrote_into_its_options(action, tmp_path):
    """Ansible writes its ``_ansible_*`` keys into the task's options when it runs the module, and a retried task
    (``retries``/``until``) runs again with them: they are no options of the module, so a target that carried
    them failed as invalid."""
    queue = node_queue.NodeQueue(str(tmp_path / "q"))
    fork = action.ActionModule.__new__(action.ActionModule)
    fork._task = Task({"vmid": 200, "run_id": "r"})
    posted = []
    post = queue.post
    queue.post = lambda options, *args, **kwargs: posted.append(dict(options)) or post(options, *args, **kwargs)

    def read_alone(_tmp, _task_vars, batch=None):
        fork._task.args.update(_ansible_check_mode=False, _ansible_tmpdir="/tmp/x")  # what _execute_module does
        return {"changed": False, "read": 200}

    fork._read_alone = read_alone
    for _attempt in range(2):
        assert fork._read_with_node(queue, None, {})["read"] == 200
    assert posted == [{"vmid": 200, "run_id": "r"}] * 2
    own = {"vmid": 200, "run_id": "r", "_ansible_check_mode": False}
    assert node_queue.batch_items([{"vmid": 201, "run_id": "r"}], own) == [{"vmid": 201, "same_as_task": ["run_id"]}]


def test_the_targets_a_read_carried_travel_as_what_differs_and_get_their_own_invocation(action, tmp_path):
    queue = node_queue.NodeQueue(str(tmp_path / "q"))
    fork = action.ActionModule.__new__(action.ActionModule)
    fork._task = Task({"vmid": 200, "run_id": "r", "steps": {"training_venv": {"lock": SHARED_LOCK}}})
    others = [
        {"vmid": 201, "run_id": "r", "steps": {"training_venv": {"lock": SHARED_LOCK}}},
        {"vmid": 202, "run_id": "r", "steps": {"training_venv": {"lock": "six==1.17.0"}}},
    ]
    posted = [queue.post(options) for options in others]
    carried = []

    def read_alone(_tmp, _task_vars, batch=None):
        carried.extend(batch)
        # Ansible's own echo, the batch in it, as where the module's options fail AnsibleModule's checks.
        options = {**fork._task.args, "batch": batch}
        return {"changed": False, "invocation": {"module_args": options}, "batch": [{"changed": False} for _ in batch]}

    fork._read_alone = read_alone
    mine = fork._read_with_node(queue, None, {})
    assert carried == [
        {"vmid": 201, "same_as_task": ["run_id", "steps"]},
        {"vmid": 202, "steps": {"training_venv": {"lock": "six==1.17.0"}}, "same_as_task": ["run_id"]},
    ]
    assert "batch" not in mine["invocation"]["module_args"] and "batch" not in mine
    for name, options in zip(posted, others, strict=True):
        assert queue.result(name)["invocation"] == {"module_args": options}  # all of its options, as its task's


def test_the_gathering_waits_while_targets_still_come_and_never_longer_than_its_bound(action, tmp_path):
    queue = node_queue.NodeQueue(str(tmp_path / "q"))
    now = [0.0]

    def sleep(seconds):
        now[0] += seconds
        if now[0] < 0.5:
            queue.post({"vmid": int(now[0] * 1000)})  # a new target every 10 ms for half a second

    assert queue.gather(idle=0.15, longest=1.0, clock=lambda: now[0], sleep=sleep) >= 49
    assert 0.6 < now[0] < 0.7  # 0.15 s after the last one came
    now[0] = 0.0
    assert queue.gather(idle=0.15, longest=0.3, clock=lambda: now[0], sleep=sleep) > 0
    assert now[0] < 0.32


def test_no_queue_where_a_target_is_read_alone(action):
    def queue_of(args, play_batch):
        fork = action.ActionModule.__new__(action.ActionModule)
        fork._task = Task(args)
        return fork._node_queue({"ansible_play_batch": play_batch})

    assert queue_of({"vmid": 200, "per_node": False}, ["a", "b"]) is None
    assert queue_of({"per_node": True}, ["a", "b"]) is None  # a bare host: no vmid
    assert queue_of({"vmid": 200, "per_node": True}, ["a"]) is None  # alone in its play batch
    assert queue_of({"vmid": 200}, ["a", "b"]) is None  # no task machinery here: read alone, no exception


def playbook_on_one_node(tmp_path, *extra):
    """Four CTs of one node (the controller itself, local) through the real action and module, the way the
    preflight role runs the pass (delegated to the node); ct2 and ct3 each with wrong step settings of their own and
    ct4 with an option of the module that is wrong, so that each result says whose it is. Returns (module
    executions, {host: report})."""
    (tmp_path / "hosts.yml").write_text(
        "all:\n  children:\n    nodes:\n      hosts:\n        pve1: {ansible_connection: local}\n"
        "    cts:\n      vars: {pve_node: pve1}\n      hosts:\n"
        "        ct1: {pve_vmid: 201}\n        ct2: {pve_vmid: 202, ct_steps: {nope: {}}}\n"
        "        ct3: {pve_vmid: 203, ct_steps: {preflight: {bogus: 1}}}\n"
        "        ct4: {pve_vmid: 204, ct_timeout: sixty}\n"
    )
    (tmp_path / "play.yml").write_text(
        "- hosts: cts\n  gather_facts: false\n  tasks:\n    - pve_gpu.recover.target_facts:\n"
        '        vmid: "{{ pve_vmid }}"\n        node_name: "{{ pve_node }}"\n'
        '        steps: "{{ ct_steps | default({}) }}"\n        per_node: "{{ per_node | default(true) }}"\n'
        '        timeout: "{{ ct_timeout | default(60) }}"\n'
        '      delegate_to: "{{ pve_node }}"\n'
    )
    argv = [os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i", str(tmp_path / "hosts.yml")]
    argv += ["-f", "4", "-vvv", "-e", f"ansible_python_interpreter={sys.executable}", *extra]
    argv.append(str(tmp_path / "play.yml"))
    done = subprocess.run(
        argv, cwd=ROOT, env=ansible_env(tmp_path), capture_output=True, text=True, timeout=120, check=False
    )
    executions = len(re.findall(r"EXEC /bin/sh -c '\S+ \S+/AnsiballZ_target_facts\.py", done.stdout))
    return executions, {host: report for host, (report,) in reports_of(tmp_path).items()}


@pytest.mark.parametrize(("per_node", "executions"), [("true", 1), ("false", 4)])
def test_one_nodes_targets_are_read_in_one_module_execution_each_with_its_own_result(tmp_path, per_node, executions):
    counted, reports = playbook_on_one_node(tmp_path, "-e", f"per_node={per_node}")
    # Per node: one execution, or two where a busy machine started a fork after the first read began, or ct4
    # led and its own options failed the module before it read the others (they are then read together).
    assert counted == executions if per_node == "false" else counted < 3, reports
    assert sorted(reports) == ["ct1", "ct2", "ct3", "ct4"]
    # Each its own options, its own result.
    assert "pct not found in PATH of node pve1" in reports["ct1"]["error"]["msg"]
    assert "unknown step(s) nope" in reports["ct2"]["error"]["msg"]
    assert "settings of step preflight: unknown setting(s) bogus" in reports["ct3"]["error"]["msg"]
    assert "timeout" in reports["ct4"]["error"]["msg"] and "int" in reports["ct4"]["error"]["msg"]
    assert len({report["run_id"] for report in reports.values()}) == 1


def test_the_gathering_ends_when_every_host_of_the_play_batch_has_come_to_any_node(action, tmp_path):
    """Four nodes' queues share the task's arrivals: node a's reader waits while the other nodes' targets still come
    (round-robin, each node's own a few forks apart), and starts the moment the last of the 8 hosts has come, not
    an idle wait later: one read per node, none split in two."""
    arrivals = str(tmp_path / "arrivals")
    order = [(f"ct{i}", "abcd"[i % 4]) for i in range(8)]
    batch = [host for host, _node in order]
    queues = {node: node_queue.NodeQueue(str(tmp_path / node), arrivals=arrivals, expected=batch) for node in "abcd"}
    now = [0.0]
    queues["a"].post({"vmid": 100}, host=order[0][0])
    coming = iter(order[1:])

    def sleep(seconds):
        now[0] += seconds
        if round(now[0] * 100) % 12 == 0:  # one host every 0.12 s: a node's own come 0.48 s apart
            host, node = next(coming, (None, None))
            if host:
                queues[node].post({"vmid": int(host[2:]) + 100}, host=host)

    assert queues["a"].gather(idle=0.15, longest=5.0, clock=lambda: now[0], sleep=sleep) == 2  # ct0 and ct4
    assert 0.83 < now[0] < 0.86  # the eighth came at 0.84 s: no idle wait after it
    assert len(os.listdir(arrivals)) == 8


def test_a_host_that_posts_again_is_counted_once_and_a_gathering_without_arrivals_counts_its_node(action, tmp_path):
    arrivals = str(tmp_path / "arrivals")
    queue = node_queue.NodeQueue(str(tmp_path / "a"), arrivals=arrivals, expected=["ct200", "ct201", "ct202"])
    name = queue.post({"vmid": 200}, host="ct200")
    queue.post({"vmid": 200}, name)  # queued again after a read that did not answer it: no second arrival
    queue.post({"vmid": 201}, host="ct201")
    assert queue.arrived() == 2
    now = [0.0]

    def sleep(seconds):
        now[0] += seconds

    # The third host never comes (its task failed before it posted): the gathering ends an idle wait later.
    assert queue.gather(idle=0.15, longest=5.0, clock=lambda: now[0], sleep=sleep) == 2
    assert 0.15 <= now[0] < 0.17
    alone = node_queue.NodeQueue(str(tmp_path / "b"))
    alone.post({"vmid": 300}, host="ct300")
    assert alone.arrived() == 1 and not os.path.exists(tmp_path / "b" / "arrivals")


def test_a_batch_counts_only_its_own_hosts_marks(action, tmp_path):
    """The task's arrivals outlive a play batch: a serial play's earlier batch, or a host that failed the
    controller's checks and left the batch, never counts for (or makes wait) the batch that reads now."""
    arrivals = str(tmp_path / "arrivals")
    earlier = node_queue.NodeQueue(str(tmp_path / "a"), arrivals=arrivals, expected=["ct1", "ct2"])
    earlier.post({"vmid": 201}, host="ct1")
    earlier.post({"vmid": 202}, host="ct2")
    # The next batch, ct3 to ct5; ct5 failed before it posted and the forks after it see a batch without it.
    first = node_queue.NodeQueue(str(tmp_path / "b"), arrivals=arrivals, expected=["ct3", "ct4", "ct5"])
    first.post({"vmid": 203}, host="ct3")
    assert first.arrived() == 1  # ct1 and ct2 are another batch's
    shrunk = node_queue.NodeQueue(str(tmp_path / "c"), arrivals=arrivals, expected=["ct3", "ct4"])
    shrunk.post({"vmid": 204}, host="ct4")
    now = [0.0]

    def sleep(seconds):
        now[0] += seconds

    assert shrunk.gather(idle=0.15, longest=5.0, clock=lambda: now[0], sleep=sleep) == 1
    assert now[0] == 0.0  # all of its batch came: no wait at all
    assert first.gather(idle=0.15, longest=5.0, clock=lambda: now[0], sleep=sleep) == 1
    assert 0.15 <= now[0] < 0.17  # ct5 never comes: an idle wait, not the 5 s bound


def test_a_mark_that_cannot_be_made_still_queues_the_request_once(action, tmp_path):
    arrivals = tmp_path / "arrivals"
    queue = node_queue.NodeQueue(str(tmp_path / "a"), arrivals=str(arrivals), expected=["ct200", "ct201"])
    arrivals.rmdir()
    arrivals.write_text("not a directory")  # a mark cannot be made in it
    name = queue.post({"vmid": 200}, host="ct200")
    assert queue.waiting() == [name]
    assert queue.claim() == [(name, {"vmid": 200})]


def failing_hold(queue, then):
    """``queue.hold`` failing (the lock file cannot be opened) right after a reader has claimed every waiting
    request; ``then(claimed)`` runs in a thread, as that reader would go on."""

    def hold(_longest):
        claimed = queue.claim()
        threading.Thread(target=then, args=(claimed,), daemon=True).start()

    queue.hold = hold


def test_a_fork_that_cannot_hold_the_lock_waits_for_the_reader_that_claimed_its_target(action, tmp_path):
    """Read once: the fork whose request a reader claimed returns that reader's answer, never its own read."""
    queue = node_queue.NodeQueue(str(tmp_path / "q"))

    def answer(claimed):
        time.sleep(0.2)
        for name, options in claimed:
            queue.answer(name, {"changed": False, "read": options["vmid"], "by": "the reader"})

    failing_hold(queue, answer)
    executions = []
    result = queued_fork(action, queue, 200, executions)
    assert result == {"changed": False, "read": 200, "by": "the reader"}
    assert executions == []
    assert not os.listdir(tmp_path / "q" / "requests") and not os.listdir(tmp_path / "q" / "results")


def test_a_claimed_target_the_reader_queues_again_is_read_by_its_own_fork_once(action, tmp_path):
    queue = node_queue.NodeQueue(str(tmp_path / "q"))

    def fail_and_requeue(claimed):
        time.sleep(0.2)
        for name, options in claimed:
            queue.post(options, name)  # as _lead does for the targets it did not answer

    failing_hold(queue, fail_and_requeue)
    executions = []
    result = queued_fork(action, queue, 200, executions)
    assert result["read"] == 200 and executions == [[200]]
    assert not os.listdir(tmp_path / "q" / "requests")


def test_a_fork_that_cannot_hold_the_lock_reads_its_still_queued_target_alone_at_once(action, tmp_path):
    queue = node_queue.NodeQueue(str(tmp_path / "q"))
    queue.hold = lambda _longest: None
    executions = []
    assert queued_fork(action, queue, 200, executions)["read"] == 200
    assert executions == [[200]] and not os.listdir(tmp_path / "q" / "requests")


def test_a_claimed_request_is_waited_for_no_longer_than_its_bound(action, tmp_path):
    queue = node_queue.NodeQueue(str(tmp_path / "q"))
    name = queue.post({"vmid": 200})
    assert queue.claim() == [(name, {"vmid": 200})]
    now = [0.0]

    def sleep(seconds):
        now[0] += seconds

    assert queue.await_result(name, 1.0, clock=lambda: now[0], sleep=sleep) is None
    assert 1.0 <= now[0] < 1.1
    assert queue.withdraw(name) is False  # claimed: nothing to take back
    fork = action.ActionModule.__new__(action.ActionModule)
    fork._task = Task({"vmid": 200, "timeout": 30})
    assert (
        fork._result_wait(queue)
        == node_queue.GATHER_LONGEST + 3 * (30 + action.KILL_GRACE) + node_queue.RESULT_WAIT_SLACK
    )


def test_every_node_queue_of_a_task_shares_one_arrivals_directory_and_another_task_has_its_own(
    action, tmp_path, monkeypatch
):
    def queue_of(uuid, node, play_batch):
        return equipped_fork(action, uuid, node)._node_queue({"ansible_play_batch": play_batch})

    monkeypatch.setattr(action.C, "DEFAULT_LOCAL_TMP", str(tmp_path))
    a = queue_of("task-1", "pve-a", ["ct1", "ct2", "ct3"])
    b = queue_of("task-1", "pve-b", ["ct1", "ct2"])  # a fork started after ct3 left the batch
    other = queue_of("task-2", "pve-a", ["ct1", "ct2", "ct3"])
    assert a.directory != b.directory and a.arrivals == b.arrivals
    assert other.arrivals != a.arrivals and other.directory != a.directory
    assert len(a.expected) == 3 and b.expected < a.expected


def test_each_fork_marks_its_host_so_the_reader_stops_waiting_once_the_batch_has_come(action, tmp_path):
    """Through _read_with_node: every fork marks its own host, and the fork that reads finds the whole batch
    there, so it reads at once instead of an idle wait (a read of two takes the module's time, not 5 s)."""
    arrivals = tmp_path / "arrivals"
    queue = node_queue.NodeQueue(str(tmp_path / "q"), arrivals=str(arrivals), expected=["ct200", "ct201"], idle=5.0)
    started = time.monotonic()
    executions, results = run_queued(action, queue, [200, 201])
    assert time.monotonic() - started < 2.5  # not the 5 s idle wait
    assert sorted(os.listdir(arrivals)) == sorted(node_queue.NodeQueue.mark(h) for h in ("ct200", "ct201"))
    assert len(executions) == 1 and sorted(executions[0]) == [200, 201]
    assert all(results[v]["read"] == v for v in (200, 201))


def test_a_host_that_never_queues_marks_its_arrival_so_no_read_waits_for_it(action, tmp_path, monkeypatch):
    """ct2 fails the action's own checks, ct3 is read alone (per_node off) and ct4's options cannot be read: each
    marks its arrival, so ct1's node, whose batch names all four, reads as soon as ct1 has come."""
    monkeypatch.setattr(action.C, "DEFAULT_LOCAL_TMP", str(tmp_path))
    monkeypatch.setattr(action.ansible_context, "CLIARGS", CLIArgs({"forks": 3}))
    batch = ["ct1", "ct2", "ct3", "ct4"]
    failing = equipped_fork(action, "task-1", "pve-a")
    failing._task.args = {"vmid": 202, "batch": [{"vmid": 1}]}  # refused before any connection
    assert failing.run(None, {"ansible_play_batch": batch, "inventory_hostname": "ct2"})["failed"]
    alone = equipped_fork(action, "task-1", "pve-b")
    alone._task.args = {"vmid": 203, "per_node": False}
    alone._read_alone = lambda _tmp, _task_vars: {"changed": False}
    assert alone.run(None, {"ansible_play_batch": batch, "inventory_hostname": "ct3"})["changed"] is False
    # ct4's options cannot be read from the role's variables: refused before any connection, its arrival marked.
    unreadable = equipped_fork(action, "task-1", "pve-a")
    unreadable._task.args = {"options_from_variables": True}
    variables = {"ansible_play_batch": batch, "inventory_hostname": "ct4", "pve_vmid": 204, "pve_node": "pve-a"}
    variables["preflight_lock_dir"] = trust_as_template("{{ no_such_variable }}")
    unreadable._templar = Templar(loader=DataLoader(), variables=variables)
    assert unreadable.run(None, variables)["error"] == "invalid"
    queue = equipped_fork(action, "task-1", "pve-a")._node_queue({"ansible_play_batch": batch})
    queue.post({"vmid": 201}, host="ct1")
    now = [0.0]

    def sleep(seconds):
        now[0] += seconds

    assert queue.arrived() == 4 and queue.gather(clock=lambda: now[0], sleep=sleep) == 1
    assert now[0] == 0.0  # no idle wait for ct2 and ct3


def test_a_hosts_mark_comes_after_its_request_so_a_full_count_never_misses_one(action, tmp_path, monkeypatch):
    """A gathering that has seen every mark claims every request: post() writes the request, then the mark."""
    arrivals = tmp_path / "arrivals"
    queue = node_queue.NodeQueue(str(tmp_path / "q"), arrivals=str(arrivals), expected=["ct200"])
    marks_when_written = []
    write = node_queue.write_json_atomically

    def recording_write(path, data):
        marks_when_written.append(os.listdir(arrivals))
        write(path, data)

    monkeypatch.setattr(node_queue, "write_json_atomically", recording_write)
    name = queue.post({"vmid": 200}, host="ct200")
    assert marks_when_written == [[]] and queue.arrived() == 1 and queue.waiting() == [name]


def test_the_gathering_bound_grows_with_a_batch_of_hundreds(action, tmp_path):
    """64 hosts keep the 10 s bound; 500 get 50 s (linear starts their forks over 15 s or more): a node is
    still read once when its hosts keep coming for longer than 10 s."""
    now = [0.0]

    def sleep(seconds):
        now[0] += seconds

    hosts = [f"ct{i}" for i in range(500)]
    queue = node_queue.NodeQueue(str(tmp_path / "q"), arrivals=str(tmp_path / "arrivals"), expected=hosts)
    coming = iter(hosts)

    def sleep_while_coming(seconds):
        sleep(seconds)
        if round(now[0] * 100) % 3 == 0:  # a host every 30 ms: 500 in 15 s
            host = next(coming, None)
            if host:
                queue.post({"vmid": 1}, host=host)

    queue.gather(clock=lambda: now[0], sleep=sleep_while_coming)
    assert 14.9 < now[0] < 15.2 and queue.arrived() == 500  # all came: one read, not three
    small = node_queue.NodeQueue(str(tmp_path / "s"), arrivals=str(tmp_path / "a2"), expected=hosts[:64])
    now[0] = 0.0

    def keeps_coming(seconds):  # someone else's marks never end the wait: only the bound does
        sleep(seconds)
        small.post({"vmid": 1})

    small.gather(idle=20.0, clock=lambda: now[0], sleep=keeps_coming)
    assert 10.0 <= now[0] < 10.02


def test_one_fork_reads_alone(action, tmp_path, monkeypatch):
    """With --forks 1 no other target is ever waiting: no queue, no gathering wait."""
    monkeypatch.setattr(action.C, "DEFAULT_LOCAL_TMP", str(tmp_path))
    monkeypatch.setattr(action.ansible_context, "CLIARGS", CLIArgs({"forks": 2}))
    assert equipped_fork(action, "task-1", "pve-a")._node_queue({"ansible_play_batch": ["ct1", "ct2"]}) is not None
    monkeypatch.setattr(action.ansible_context, "CLIARGS", CLIArgs({"forks": 1}))
    assert equipped_fork(action, "task-1", "pve-a")._node_queue({"ansible_play_batch": ["ct1", "ct2"]}) is None


def test_the_idle_wait_is_long_only_where_every_host_of_the_batch_has_a_fork(action, tmp_path, monkeypatch):
    """Forks that cover the batch: a host that has not come yet is still being started (a busy main process
    leaves gaps of 0.2 s and more), so the reader waits up to 1 s for it. Fewer forks (Ansible's default is 5):
    the others come only as reads end, so it waits 0.15 s."""
    monkeypatch.setattr(action.C, "DEFAULT_LOCAL_TMP", str(tmp_path))
    batch = {"ansible_play_batch": [f"ct{i}" for i in range(64)]}
    cases = [
        ({"forks": 64}, 0, node_queue.GATHER_IDLE_COVERED),
        ({"forks": 100}, 0, node_queue.GATHER_IDLE_COVERED),
        ({"forks": 5}, 0, node_queue.GATHER_IDLE),  # Ansible's default
        ({"forks": 100}, 8, node_queue.GATHER_IDLE),  # the task's throttle: 8 at a time
        ({}, 0, node_queue.GATHER_IDLE),  # Ansible driven without its command line: not known to cover
    ]
    for cliargs, throttle, idle in cases:
        monkeypatch.setattr(action.ansible_context, "CLIARGS", CLIArgs(cliargs))
        fork = equipped_fork(action, "task-1", "pve-a")
        fork._task.throttle = throttle
        assert fork._node_queue(batch).idle == idle, (cliargs, throttle)
    fork._task.throttle = 1
    monkeypatch.setattr(action.ansible_context, "CLIARGS", CLIArgs({"forks": 100}))
    assert fork._node_queue(batch) is None  # throttle 1: one at a time, read alone
    assert node_queue.GATHER_IDLE_COVERED > 0.5 > node_queue.GATHER_IDLE
    # The gathering waits the queue's own idle time for a host that does not come.
    queue = node_queue.NodeQueue(str(tmp_path / "q"), arrivals=str(tmp_path / "a"), expected=["ct1", "ct2"], idle=1.0)
    queue.post({"vmid": 201}, host="ct1")
    now = [0.0]

    def sleep(seconds):
        now[0] += seconds

    queue.gather(clock=lambda: now[0], sleep=sleep)
    assert 1.0 <= now[0] < 1.02


def equipped_fork(action, uuid, node):
    """A fork of task ``uuid`` delegated to ``node`` with what _node_queue reads of Ansible's task machinery."""
    fork = action.ActionModule.__new__(action.ActionModule)
    fork._task = Task({"vmid": 200})
    fork._task._uuid = uuid
    fork._task.delegate_to = node
    fork._task.environment = []
    fork._task.no_log = False
    fork._task.async_val = 0
    fork._connection = types.SimpleNamespace(transport="ssh")
    fork._play_context = types.SimpleNamespace(
        remote_addr=node,
        port=22,
        remote_user="root",
        private_key_file=None,
        become=False,
        become_user=None,
        become_method=None,
        check_mode=False,
    )
    return fork
