#!/usr/bin/python3
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Stand-in for Proxmox VE's ``pct`` on the lab node: ``status``, ``exec``, ``push``, ``pull``, ``list``.

Maps each onto LXC's own tools (``lxc-info``, ``lxc-attach``) for the lab's real containers, with Proxmox's
parameter checks, messages and exit codes (pve-container: src/PVE/CLI/pct.pm; errors of the PVE CLI handler
exit 255):

* ``pct exec <vmid> [--keep-env <bool>] -- <cmd...>`` -> ``lxc-attach -n <vmid> --clear-env|--keep-env -- cmd``,
  exec'd so the exit code and stdin/stdout are the inner command's own, as with the real pct;
* a vmid that is not an integer in 100..999999999: ``400 Parameter verification failed.``;
* a CT without config: ``Configuration file 'nodes/<node>/lxc/<vmid>.conf' does not exist``;
* exec into a stopped CT: ``container '<vmid>' not running!``.

Every call is appended to the lab's pct-calls.log (JSON lines) so tests can count pct round trips.
Configuration: JSON file named by $PVE_GPU_LAB_PCT with ``lxcpath``, ``node``, ``log`` and an optional
``delay``: seconds every call costs before it starts, like a real node's Perl ``pct`` (``labctl pct-delay``), and
``keep_env_option``: false plays a pct older than pve-container 5.0.9 (``labctl pct-mode old``).
"""

import json
import os
import subprocess
import sys
import time

EXIT_ERROR = 255
USAGE = {
    "exec": "pct exec <vmid> [<extra-args>] [OPTIONS]",
    "status": "pct status <vmid> [OPTIONS]",
    "push": "pct push <vmid> <file> <destination> [OPTIONS]",
    "pull": "pct pull <vmid> <path> <destination> [OPTIONS]",
}


def fail(message):
    sys.stderr.write(message if message.endswith("\n") else message + "\n")
    sys.exit(EXIT_ERROR)


def param_error(command, name, problem):
    fail(f"400 Parameter verification failed.\n{name}: {problem}\n{USAGE.get(command, 'pct <command>')}\n")


def check_vmid(command, raw):
    """Proxmox's pve-vmid: an integer from 100 to 999999999."""
    if raw is None:
        param_error(command, "vmid", "property is missing and it is not optional")
    try:
        vmid = int(raw, 10)
    except ValueError:
        param_error(command, "vmid", f"type check ('integer') failed - got '{raw}'")
    if not raw.isdigit():
        param_error(command, "vmid", f"type check ('integer') failed - got '{raw}'")
    if vmid < 100:
        param_error(command, "vmid", "value must have a minimum value of 100")
    if vmid > 999_999_999:
        param_error(command, "vmid", "value must have a maximum value of 999999999")
    return vmid


def parse_bool(command, name, raw):
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    param_error(command, name, f"type check ('boolean') failed - got '{raw}'")
    return None


class Pct:
    def __init__(self, config):
        self.lxcpath = config["lxcpath"]
        self.node = config["node"]
        # False plays a pct older than pve-container 5.0.9 (Proxmox VE 8.1): no --keep-env, the node's env leaks in.
        self.keep_env_option = config.get("keep_env_option", True)

    def load_config(self, vmid):
        """Like PVE::LXC::Config->load_config: the CT must have a config on this node."""
        if not os.path.exists(os.path.join(self.lxcpath, str(vmid), "config")):
            fail(f"Configuration file 'nodes/{self.node}/lxc/{vmid}.conf' does not exist")

    def running(self, vmid):
        state = subprocess.run(
            ["lxc-info", "-P", self.lxcpath, "-n", str(vmid), "-s"], capture_output=True, text=True, check=False
        )
        return "RUNNING" in state.stdout

    def attach(self, vmid, keep_env):
        return ["lxc-attach", "-P", self.lxcpath, "-n", str(vmid), "--keep-env" if keep_env else "--clear-env"]

    def status(self, args):
        vmid = check_vmid("status", args[0] if args else None)
        self.load_config(vmid)
        print(f"status: {'running' if self.running(vmid) else 'stopped'}")
        return 0

    def exec(self, args):
        if "--" in args:
            split = args.index("--")
            opts, command = args[:split], args[split + 1 :]
        else:
            opts, command = args, []
        vmid = check_vmid("exec", opts[0] if opts else None)
        keep_env = True  # Proxmox VE 8 default; callers of this project always pass --keep-env 0
        rest = opts[1:]
        while rest:
            if rest[0].startswith("--keep-env") and not self.keep_env_option:
                # pve-container before 5.0.9: Getopt::Long warns, the CLI handler refuses; nothing runs.
                sys.stderr.write("Unknown option: keep-env\n")
                fail(f"400 unable to parse option\n{USAGE['exec']}")
            if rest[0] == "--keep-env" and len(rest) > 1:
                keep_env = parse_bool("exec", "keep-env", rest[1])
                rest = rest[2:]
            elif rest[0].startswith("--keep-env="):
                keep_env = parse_bool("exec", "keep-env", rest[0].split("=", 1)[1])
                rest = rest[1:]
            else:
                command = rest + command
                break
        self.load_config(vmid)
        if not self.running(vmid):
            fail(f"container '{vmid}' not running!")
        if not command:
            fail("missing command")
        argv = [*self.attach(vmid, keep_env), "--", *command]
        os.execvp(argv[0], argv)  # noqa: S606  (pct exec replaces itself with lxc-attach, as the real one does)
        return EXIT_ERROR

    def transfer(self, command, args, missing, not_running):
        """``pct push|pull <vmid> <from> <to> [--opts]``: checked like Proxmox does (pve-container's own wording)."""
        positional, options = split_options(args)
        if len(positional) != 3:
            param_error(command, missing, "property is missing and it is not optional")
        vmid = check_vmid(command, positional[0])
        self.load_config(vmid)
        if not self.running(vmid):
            fail(not_running)
        return vmid, positional[1], positional[2], options

    def push(self, args):
        vmid, source, destination, options = self.transfer("push", args, "file", "can only push files to a running CT")
        try:
            handle = open(source, "rb")  # noqa: SIM115  (handed to the child as stdin)
        except OSError:
            fail(f"failed to open {source} for reading")
        perms = options.get("perms", "644")
        script = 'umask 077 && cat > "$1" && chmod "$2" "$1"'
        done = subprocess.run(
            [*self.attach(vmid, False), "--", "sh", "-c", script, "sh", destination, perms],
            stdin=handle,
            capture_output=True,
            text=True,
            check=False,
        )
        handle.close()
        if done.returncode != 0:
            fail(f"failed to create file: {destination}: {done.stderr.strip()}")
        return 0

    def pull(self, args):
        vmid, source, destination, _ = self.transfer("pull", args, "path", "can only pull files from a running VM")
        done = subprocess.run([*self.attach(vmid, False), "--", "cat", "--", source], capture_output=True, check=False)
        if done.returncode != 0:
            fail(f"failed to open {source}: No such file or directory")
        with open(destination, "wb") as handle:
            handle.write(done.stdout)
        return 0

    def list(self, _args):
        print("VMID       Status     Lock         Name                ")
        for entry in sorted(os.listdir(self.lxcpath), key=lambda e: (len(e), e)):
            if entry.isdigit() and os.path.exists(os.path.join(self.lxcpath, entry, "config")):
                state = "running" if self.running(int(entry)) else "stopped"
                print(f"{entry:<10} {state:<10} {'':<12} ct{entry:<18}")
        return 0


def split_options(args):
    positional, options = [], {}
    items = iter(args)
    for item in items:
        if item.startswith("--"):
            options[item[2:]] = next(items, "")
        else:
            positional.append(item)
    return positional, options


def main(argv):
    config_path = os.environ.get("PVE_GPU_LAB_PCT")
    if not config_path:
        fail("pct (lab stand-in): PVE_GPU_LAB_PCT is not set")
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    with open(config["log"], "a", encoding="utf-8") as log:
        log.write(json.dumps({"time": time.time(), "argv": argv}) + "\n")
    # What a real node's pct costs before it does anything (a Perl CLI that loads the cluster configuration):
    # the benchmark sets it with `labctl pct-delay SECONDS`; 0 (the default) for tests.
    time.sleep(float(config.get("delay", 0)))
    pct = Pct(config)
    commands = {"status": pct.status, "exec": pct.exec, "push": pct.push, "pull": pct.pull, "list": pct.list}
    if not argv or argv[0] not in commands:
        fail(f"unknown command 'pct {argv[0] if argv else ''}'".rstrip())
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
