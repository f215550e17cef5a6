# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The preflight step of the fact pass: is the target fit for recovery, and which GPUs does it see.

Its probe part (``preflight_probe``) reads, inside the target: the NVIDIA device nodes, the NVML library
files, the kernel module version file, free disk where the venvs go, and one ``nvidia-smi --query-gpu`` with
every field the report and verify need (so no step asks nvidia-smi inside the CT again in a converged run).
The node side reads the node's own kernel module version and the Xid errors its kernel log holds for each GPU
(node/xid.py; the GPUs' ``xid_events``). :func:`evaluate` is pure: every verdict and message is unit tested.
"""
# "_" is the throwaway name (PEP 8, ruff); ansible-test's pylint config bans it.
# pylint: disable=disallowed-name

from __future__ import annotations

import re

from ansible_collections.pve_gpu.recover.plugins.module_utils.node import xid as node_xid
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.nvidia_smi import (
    GPU_FIELDS,
    OPTIONAL_GPU_FIELDS,
    NvidiaSmiError,
    classify_failure,
    parse_gpus,
    parse_kernel_driver_version,
    parse_library_version,
    query_gpu_argv,
)
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.shared_reads import node_read
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.preflight import probe as preflight_probe

NAME = "preflight"
GPU_DEVICE = re.compile(r"^/dev/nvidia(\d+)$")
REQUIRED_CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm")
DEVICE_GLOBS = ("/dev/nvidia[0-9]*", *REQUIRED_CONTROL_DEVICES)
GIB = 1024**3
KERNEL_VERSION_FILE = "/proc/driver/nvidia/version"
LIBRARY_GLOBS = (
    "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.*",
    "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.*",
    "/usr/lib64/libnvidia-ml.so.*",
    "/usr/lib/libnvidia-ml.so.*",
)
# The spec of the step: the preflight_* role variables that reach the fact pass (target_facts checks them).
SPEC = {
    "space_path": {"type": "path", "default": "/opt"},
    "min_free_gib": {"type": "float", "default": 20.0},
    # Below this (and above min_free_gib) the disk check warns: an unattended run sees space going before a
    # rebuild fails for it. None: twice min_free_gib; 0: no warning.
    "warn_free_gib": {"type": "float"},
    "expected_gpu_count": {"type": "int"},
    "kernel_version_file": {"type": "path", "default": KERNEL_VERSION_FILE},
    "library_globs": {"type": "list", "elements": "str", "default": list(LIBRARY_GLOBS)},
    "kernel_log": {"type": "path", "default": node_xid.KERNEL_LOG},
}
# Settings no role variable gives (registry.settings_from_variables): where the driver's files are is the node's.
ROLE_VARIABLES = {"kernel_version_file": None, "library_globs": None, "kernel_log": None}
SPEC_DEFAULTS = {name: option.get("default") for name, option in SPEC.items()}
PROBE = preflight_probe
# Asked without the fields an older driver may not know when it rejects them (exit 2).
BASIC_GPU_FIELDS = tuple(f for f in GPU_FIELDS if f[0] not in OPTIONAL_GPU_FIELDS)


def check_spec(spec):
    """A sentence when the settings cannot work, else None."""
    warn, low = spec.get("warn_free_gib"), spec["min_free_gib"]
    if warn and warn < low:
        return (
            f"warn_free_gib {warn:g} is below min_free_gib {low:g}: the warning would never come before the "
            f"failure; set preflight_warn_free_gib above preflight_min_free_gib (null: twice it, 0: no warning)"
        )
    return None


def warn_threshold(spec):
    """The free GiB under which the disk check warns: ``warn_free_gib``, or twice ``min_free_gib`` when unset."""
    warn = spec.get("warn_free_gib")
    return 2 * spec["min_free_gib"] if warn is None else warn


def probe_payload(spec, timeout=60):
    """What the probe is asked to read inside the target (argv shapes come from module_utils/nvidia_smi)."""
    return {
        "device_globs": list(DEVICE_GLOBS),
        "kernel_version_file": spec["kernel_version_file"],
        "library_globs": list(spec["library_globs"]),
        "nvidia_smi_argv": query_gpu_argv(GPU_FIELDS),
        "nvidia_smi_fallback_argv": query_gpu_argv(BASIC_GPU_FIELDS),
        "space_path": spec["space_path"],
        "timeout": timeout,
    }


def parse_probe(answer):
    """Facts from the probe's raw answer: driver versions, the GPUs, the nvidia-smi failure if any.

    The answer comes from inside a CT, so its shape is checked: a part that is not what this probe prints is an
    NvidiaSmiError of kind ``probe`` naming the key, never a KeyError.
    """
    for key, kind in (("nvidia_smi", dict), ("devices", list), ("nvml_libraries", list), ("space", dict)):
        if not isinstance(answer.get(key), kind):
            raise NvidiaSmiError(f"the preflight probe answered no {key!r} ({kind.__name__})", kind="probe")
    smi = answer["nvidia_smi"]
    failure = None
    gpus = []
    if smi.get("missing"):
        failure = NvidiaSmiError("nvidia-smi is not installed", kind="missing")
    else:
        failure = classify_failure(
            smi.get("rc"), smi.get("stdout") or "", smi.get("stderr") or "", truncated=bool(smi.get("truncated"))
        )
        if failure is None:
            fields = BASIC_GPU_FIELDS if smi.get("fallback") else GPU_FIELDS
            try:
                gpus = parse_gpus(smi.get("stdout") or "", fields)
            except NvidiaSmiError as error:
                failure = error
            for gpu in gpus:
                for _, key, _ in GPU_FIELDS:
                    gpu.setdefault(key, None)
    versions = sorted({v for v in map(parse_library_version, answer["nvml_libraries"]) if v})
    return {
        "hostname": str(answer.get("hostname", "")),
        "python_version": str(answer.get("python", "")),
        "devices": answer["devices"],
        "space": answer["space"],
        "nvml_library_versions": versions,
        "target_kernel_version": parse_kernel_driver_version(answer.get("kernel_version_text")),
        "target_driver_version": gpus[0]["driver_version"] if gpus else None,
        "gpus": gpus,
        "gpu_uuids": [g["uuid"] for g in gpus],
        "nvidia_smi_failure": failure,
    }


# read_node needs neither the probe's answer nor other steps' facts: it runs beside the probe (the kernel log of a
# busy node is thousands of records, one read each).
NODE_READ_NEEDS_ANSWER = False


def read_node_driver_version(path):
    """Version of the NVIDIA kernel module loaded on this node (the module runs there), or None."""
    try:
        with open(path, encoding="utf-8") as handle:
            return parse_kernel_driver_version(handle.read())
    except OSError:
        return None


def read_node(spec, target, answer, context):
    """Node-side part: the node's kernel module version (what the driver inside is compared with) and the Xids of
    its kernel log (read once for the node's CTs of this module execution)."""
    path = spec["kernel_log"]
    return {
        "driver_version": read_node_driver_version(spec["kernel_version_file"]),
        "xids": node_read(context, ("xids", path), lambda: node_xid.read_xids(path)),
    }


def evaluate_step(spec, answer, node, context):
    """The preflight facts of the fact pass: checks, problems (a non-empty list stops the run), the GPUs."""
    target = context["target"]
    facts = parse_probe(answer)
    for gpu in facts["gpus"]:  # the node's log, by the GPU's PCI address (a CT's GPU keeps the node's)
        gpu["xid_events"] = node_xid.gpu_xids(node.get("xids"), gpu.get("bus_id"))
    checks = evaluate(
        target["label"],
        target["node"],
        facts,
        container=target["vmid"] is not None,
        node_driver_version=node["driver_version"],
        min_free_gib=spec["min_free_gib"],
        expected_gpu_count=spec["expected_gpu_count"],
        space_path=spec["space_path"],
        warn_free_gib=warn_threshold(spec),
    )
    failure = facts.pop("nvidia_smi_failure")
    return dict(
        facts,
        node_driver_version=node["driver_version"],
        nvidia_smi_error=failure.to_result() if failure else None,
        checks=checks,
        problems=[c["detail"] for c in checks if not c["ok"] and c["severity"] == "fail"],
        # Shown as the fact pass's warnings (no task of their own); the run goes on.
        warnings=[c["detail"] for c in checks if not c["ok"] and c["severity"] == "warn"],
        changes=[],
        diff={"before": "", "after": ""},
        pending=False,  # preflight only reads: it never has work of its own
    )


def evaluate(
    label,
    node,
    facts,
    *,
    container,
    node_driver_version,
    min_free_gib,
    expected_gpu_count,
    space_path,
    warn_free_gib=None,
):
    """Preflight checks as ``[{name, ok, severity, detail}]``: pure, so every verdict and message is unit tested.

    ``severity`` is ``fail`` (a problem: the run stops) or ``warn`` (a warning: the run goes on).
    """
    checks = []

    def check(name, ok, detail, severity="fail"):
        checks.append({"name": name, "ok": bool(ok), "severity": severity, "detail": detail})

    # 1. The node's kernel module: what everything else is compared with.
    node = f"node {node}" if container else f"host {node}"
    check(
        "node_driver",
        node_driver_version,
        f"{node} runs NVIDIA kernel module {node_driver_version}"
        if node_driver_version
        else f"{node} has no NVIDIA kernel module loaded (its /proc/driver/nvidia/version is missing): load it "
        f"with `modprobe nvidia`, or reboot it after a driver update",
    )
    # 2. Device nodes: GPUs passed through, plus the control and UVM devices CUDA opens.
    devices = {d["path"]: d for d in facts["devices"]}
    gpu_nodes = sorted(int(m.group(1)) for m in map(GPU_DEVICE.match, devices) if m)
    missing = [p for p in REQUIRED_CONTROL_DEVICES if p not in devices]
    not_char = sorted(p for p, d in devices.items() if not d["char"])
    want = f"{expected_gpu_count} GPU device nodes" if expected_gpu_count is not None else "at least one GPU"
    count_ok = len(gpu_nodes) == expected_gpu_count if expected_gpu_count is not None else bool(gpu_nodes)
    found = [", ".join(f"/dev/nvidia{n}" for n in gpu_nodes) or "no /dev/nvidiaN"]
    if missing:
        found.append(f"no {', '.join(missing)}")
    if not_char:
        found.append(f"{', '.join(not_char)} not character devices")
    if count_ok and not missing and not not_char:
        check("devices", True, f"{label} has {found[0]} and {', '.join(REQUIRED_CONTROL_DEVICES)}")
    else:
        fix = (
            "pass the GPUs through in /etc/pve/lxc/<vmid>.conf (lxc.cgroup2.devices.allow: c 195:* rwm, plus "
            "one lxc.mount.entry per /dev/nvidia* node) and restart the CT"
            if container
            else "load the driver (`modprobe nvidia nvidia-uvm`; `nvidia-modprobe -u -c=0` creates the nodes)"
        )
        check(
            "devices",
            False,
            f"{label} has {'; '.join(found)}; expected {want} and {', '.join(REQUIRED_CONTROL_DEVICES)}: {fix}",
        )
    # 3. The driver NVML reports inside must be the node's kernel module.
    failure = facts["nvidia_smi_failure"]
    libraries = facts["nvml_library_versions"]
    if failure is not None and failure.kind == "driver_mismatch":
        library = ", ".join(libraries) or "an unknown version"
        check(
            "driver",
            False,
            f"{label}: NVML says Driver/library version mismatch: the NVIDIA userspace library inside is "
            f"{library}, the node's kernel module is {node_driver_version or 'not loaded'}; install driver "
            f"{node_driver_version or '<node version>'} in the target without its kernel module "
            f"(NVIDIA-Linux-x86_64-{node_driver_version or '<version>'}.run --no-kernel-module), or reboot the "
            f"node if its driver was just updated",
        )
    elif failure is not None and failure.kind == "missing":
        check(
            "driver",
            False,
            f"{label}: nvidia-smi is not installed; install the NVIDIA userspace driver "
            f"{node_driver_version or ''} (without kernel module) in the target".replace("  ", " "),
        )
    elif failure is not None:
        check("driver", False, f"{label}: nvidia-smi failed: {failure}" + (f"; {failure.hint}" if failure.hint else ""))
    elif node_driver_version and facts["target_driver_version"] != node_driver_version:
        check(
            "driver",
            False,
            f"{label}: NVML reports driver {facts['target_driver_version']}, the node's kernel module is "
            f"{node_driver_version}; install the node's driver version in the target",
        )
    elif [v for v in libraries if v != node_driver_version] and node_driver_version:
        check(
            "driver",
            False,
            f"{label}: userspace library {', '.join(libraries)} differs from the node's kernel module "
            f"{node_driver_version}; NVML will fail after the next library load: install "
            f"{node_driver_version} in the target",
        )
    else:
        check(
            "driver",
            True,
            f"NVML in {label} reports {facts['target_driver_version']}, the node's kernel module"
            + (f", with {len(facts['gpu_uuids'])} GPUs visible" if facts["gpu_uuids"] else ""),
        )
    # 4. Disk: the new venv is built beside the old one, which is kept.
    checks.append(disk_check(label, facts["space"], space_path, min_free_gib, warn_free_gib))
    return checks


def disk_check(label, space, space_path, min_free_gib, warn_free_gib):
    """The disk check: a problem under ``min_free_gib``, a warning under ``warn_free_gib`` (0 or None: none), so that an
    unattended run reports the space going before a rebuild fails for want of it; pure.

    >>> disk_check("CT 200", {"free_bytes": 30 * GIB, "existing": "/"}, "/opt", 20, 40)["severity"]
    'warn'
    """
    free_gib = space["free_bytes"] / GIB
    where = f"{label} has {free_gib:.1f} GiB free at {space_path} (its filesystem at {space['existing']}); "
    if free_gib < min_free_gib:
        detail = where + f"a new venv needs {min_free_gib:g} GiB: free space there or lower preflight_min_free_gib"
        return {"name": "disk", "ok": False, "severity": "fail", "detail": detail}
    if warn_free_gib and free_gib < warn_free_gib:
        detail = where + (
            f"below the warning threshold of {warn_free_gib:g} GiB (preflight_warn_free_gib); a new venv fails "
            f"under {min_free_gib:g} GiB: free space there (old venv versions, caches) before it runs out"
        )
        return {"name": "disk", "ok": False, "severity": "warn", "detail": detail}
    return {"name": "disk", "ok": True, "severity": "fail", "detail": where + "enough for a new venv"}
