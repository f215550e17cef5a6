"""Shared GPU state of the pve-gpu-recover lab: what the `nvidia-smi` stand-in reports and the GPU holder claims.

The lab has no GPU, so the facts a real NVIDIA driver keeps (which GPUs exist, which processes hold memory on
them, which GPU is lost) live in a small directory of JSON files shared by every *view* (the Proxmox node and
each container see the same directory through a bind mount):

    <state_dir>/config.json   driver/CUDA version, every GPU with every attribute the stand-in prints, and
                              "views": {"node": [all uuids], "ct200": [uuids passed to CT 200], ...}
    <state_dir>/faults.json   {"ct200": {"mode": "gpu_lost", "gpu": "<uuid>"}}: faults injected per view
    <state_dir>/leaks.json    {"<uuid>": MiB}: memory the driver never freed, held by no process
    <state_dir>/holders/      one "<hostpid>-<starttime>.json" per process that registered GPU memory

Memory is never stored as a number that someone must remember to decrement: a holder counts only while its
host PID is alive under the host's /proc with the registered start time (field 22 of /proc/PID/stat, which
defeats PID reuse) and is not a zombie. Killing the process frees its memory, exactly like the real driver
tears down a CUDA context when its process exits.

Faults that a real machine produces from its files (kernel module not loaded, NVML library missing, library
and kernel module of different versions) are not stored here either: `driver_check` derives them from the
view's kernel version file and NVML library glob, so the lab can provoke them by changing those files.

Lab builders (labctl) call `write_config` / `write_fixture_config`, `set_views`, `update_gpu`, `set_fault`,
`set_leak`, `write_view_config`, `write_kernel_version_file`, `write_nvml_library`, `global_index` and
`holder_pids`; the stand-in and the holder read through `load_view_config`, `driver_check` and `snapshot`.

A view config (JSON, found through $PVE_GPU_LAB_CONFIG) has the keys of VIEW_DEFAULTS: view, state_dir,
proc_root (where the HOST's /proc is visible), kernel_version_file, nvml_library_glob and the optional dev_dir.

Stdlib only: this file is copied into containers and runs on Debian bookworm's /usr/bin/python3 (3.11).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import zlib
from pathlib import Path

LAB_CONFIG_ENV = "PVE_GPU_LAB_CONFIG"
DEFAULT_LAB_CONFIG = "/etc/pve-gpu-lab/standin.json"

DRIVER_VERSION = "580.159.04"
CUDA_VERSION = "13.0"

VIEW_DEFAULTS = {
    "view": "node",
    "state_dir": "/run/pve-gpu-lab/gpu",
    "proc_root": "/proc",
    "kernel_version_file": "/proc/driver/nvidia/version",
    "nvml_library_glob": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.*",
    # Optional: where this view's /dev/nvidia<minor> nodes are. When set, a GPU whose node is missing is not
    # visible there (a container without the node's bind mount says "No devices were found"). None: no check,
    # for places like the lab's node that have no device nodes at all.
    "dev_dir": None,
}

FAULT_MODES = ("gpu_lost", "inforom", "no_permission")

# Memory the driver accounts to a GPU as soon as one process has a context on it: 3 MiB for the GPU plus
# 6 MiB per context. Measured on the H200: one process of 20998 MiB -> memory.used 21007, two processes of
# 5638 + 7686 MiB -> 13339 (= 13324 + 3 + 2 * 6). With no process memory.used is exactly 0.
DRIVER_OVERHEAD_MIB = 3
CONTEXT_OVERHEAD_MIB = 6

# Bus ids of the eight SXM slots of a typical HGX H200 board (Dell XE9680 / Supermicro SYS-821GE layout).
HGX_BUS_IDS = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")

# Every H200 of the lab shares these values; they are the ones the fixture machine reported while idle
# (tests/fixtures/h200: capture-1.log and nvsmi_q_x_idle.xml). Keys are the canonical field names of
# `nvidia-smi --help-query-gpu`, values are raw (units are added by the stand-in); None prints "[N/A]".
H200_COMMON = {
    "name": "NVIDIA H200",
    "memory.total": 143771,
    "memory.reserved": 616,
    "pstate": "P0",
    "persistence_mode": "Enabled",
    "display_active": "Disabled",
    "addressing_mode": "None",
    "accounting.mode": "Disabled",
    "accounting.buffer_size": 4000,
    "vbios_version": "96.00.A5.00.1A",
    "inforom.img": "G520.0282.02.02",
    "inforom.oem": "2.1",
    "inforom.ecc": "7.16",
    "inforom.pwr": None,
    "gpu_recovery_action": "None",
    "fan.speed": None,
    "compute_mode": "Default",
    "compute_cap": "9.0",
    "utilization.gpu": 0,
    "utilization.memory": 0,
    "utilization.encoder": 0,
    "utilization.decoder": 0,
    "utilization.jpeg": 0,
    "utilization.ofa": 0,
    "ecc.mode.current": "Enabled",
    "ecc.mode.pending": "Enabled",
    "ecc.errors.corrected.volatile.total": 0,
    "ecc.errors.corrected.aggregate.total": 0,
    "ecc.errors.uncorrected.volatile.total": 0,
    "ecc.errors.uncorrected.aggregate.total": 0,
    "retired_pages.single_bit_ecc.count": None,
    "retired_pages.double_bit.count": None,
    "retired_pages.pending": None,
    "remapped_rows.correctable": 0,
    "remapped_rows.uncorrectable": 0,
    "remapped_rows.pending": "No",
    "remapped_rows.failure": "No",
    "temperature.gpu": 36,
    "temperature.memory": 36,
    "power.draw": 123.99,
    "power.limit": 700.0,
    "enforced.power.limit": 700.0,
    "power.default_limit": 700.0,
    "power.min_limit": 200.0,
    "power.max_limit": 700.0,
    "clocks.current.graphics": 345,
    "clocks.current.sm": 345,
    "clocks.current.memory": 3201,
    "clocks.current.video": 765,
    "clocks.applications.graphics": 1980,
    "clocks.applications.memory": 3201,
    "clocks.default_applications.graphics": 1980,
    "clocks.default_applications.memory": 3201,
    "clocks.max.graphics": 1980,
    "clocks.max.sm": 1980,
    "clocks.max.memory": 3201,
    # Bit 0x1 is "GPU idle"; the stand-in clears it while a process holds the GPU, as the busy XML shows.
    "clocks_event_reasons.active": 0x1,
    "pcie.link.gen.current": 5,
    "pcie.link.gen.gpucurrent": 5,
    "pcie.link.gen.max": 5,
    "pcie.link.gen.gpumax": 5,
    "pcie.link.gen.hostmax": None,
    "pcie.link.width.current": 16,
    "pcie.link.width.max": 16,
    "pci.device_id": "0x233510DE",
    "pci.sub_device_id": "0x18BF10DE",
    "mig.mode.current": "Disabled",
    "mig.mode.pending": "Disabled",
}

# The two single-GPU VMs the fixtures were captured on. Capture 1 (capture-1.log, nvsmi_plain_*.txt,
# nvsmi_apps_busy.csv) did not record serial/vbios/inforom; those are taken from capture 2's XML (same SKU,
# same VM layout). Capture 2 is nvsmi_q_x_*.xml and nvsmi_apps_two.csv.
FIXTURE_GPUS = {
    1: {
        "uuid": "GPU-bf580366-c11c-e730-752a-e9ca8716b7fa",
        "pci.bus_id": "00000000:00:06.0",
        "serial": "1653724058384",
        "temperature.gpu": 36,
        "power.draw": 123.99,
        "platform.module_id": 6,
    },
    2: {
        "uuid": "GPU-5c8d304e-f6b5-2ed9-0941-57901455451b",
        "pci.bus_id": "00000000:00:06.0",
        "serial": "1653724058384",
        "temperature.gpu": 37,
        "temperature.memory": 36,
        "power.draw": 79.23,
        "power.draw.average": 79.38,
        "platform.module_id": 6,
    },
}


# ---------------------------------------------------------------------------------------------- json files


def _read_json(path: Path, default):
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return default


def _write_json(path: Path, data) -> None:
    """Replace `path` atomically: readers in other views never see a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.chmod(0o644)  # containers (other uids) read the state through the bind mount
    tmp.replace(path)


def read_config(state_dir) -> dict:
    """Return config.json of `state_dir`; FileNotFoundError if the lab never wrote one."""
    with open(Path(state_dir) / "config.json") as fh:
        return json.load(fh)


def read_faults(state_dir) -> dict:
    return _read_json(Path(state_dir) / "faults.json", {})


def read_leaks(state_dir) -> dict:
    return _read_json(Path(state_dir) / "leaks.json", {})


# ---------------------------------------------------------------------------------------------- GPUs


def _digest(seed: str, words: int) -> str:
    """`words` * 8 hex digits derived from `seed` only: crc32 seeds splitmix64, which spreads similar seeds
    apart (hashlib would do too, but costs milliseconds to import on every nvidia-smi call)."""
    state = zlib.crc32(seed.encode()) | zlib.adler32(seed.encode()) << 32
    out = []
    for _ in range(0, words, 2):
        state = (state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        out.append(f"{z ^ (z >> 31):016x}")
    return "".join(out)[: words * 8]


def gpu_uuid_for(seed: str) -> str:
    """A deterministic UUID in NVIDIA's shape, GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (lower-case hex)."""
    h = _digest(seed, 4)
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _pci_parts(bus_id: str) -> dict:
    domain, bus, devfn = bus_id.split(":")
    return {"pci.domain": f"0x{domain[-4:]}", "pci.bus": f"0x{bus}", "pci.device": f"0x{devfn.split('.')[0]}"}


def make_gpu(position: int, *, node: str | None = None, **attrs) -> dict:
    """One idle H200 at global `position` (its /dev/nvidia<minor>); `attrs` override by canonical field name.

    UUID, serial and bus id are derived from the position only, so every lab build produces the same GPUs.
    Positions 0-7 use the HGX slot bus ids; further GPUs go to PCI domain 1, 2, ... with the same buses.
    `node` names the node of a lab with several: its GPUs get UUIDs and serials of their own (no two nodes share
    one, as no two real GPUs do) and the same bus ids (nodes of one model have one PCI layout); None gives the
    single lab's GPUs.
    """
    seed = "pve-gpu-lab" if node is None else f"pve-gpu-lab {node}"
    bus_id = f"{position // len(HGX_BUS_IDS):08X}:{HGX_BUS_IDS[position % len(HGX_BUS_IDS)]}:00.0"
    digest = int(_digest(f"{seed} serial {position}", 2), 16)
    gpu = dict(H200_COMMON)
    gpu.update(
        uuid=gpu_uuid_for(f"{seed} h200 {position}"),
        serial=str(1650000000000 + digest % 10**10),
        minor_number=position,
        **{"pci.bus_id": bus_id, "platform.module_id": position % len(HGX_BUS_IDS) + 1},
    )
    gpu.update(attrs)
    gpu.update(_pci_parts(gpu["pci.bus_id"]))
    return gpu


def make_gpus(gpu_count: int = 8, *, node: str | None = None) -> list[dict]:
    return [make_gpu(i, node=node) for i in range(gpu_count)]


def fixture_gpu(capture: int = 1, overrides: dict | None = None) -> dict:
    """The GPU of fixture machine `capture` (1 or 2), attribute for attribute; `overrides` by field name.

    The captures read different instantaneous values at different moments (capture 1: 36 C / 123.99 W in the
    csv block, 123.98 W in the nounits block, 35 C / 90 W / 1 % in the busy table), so tests pass those as
    overrides, e.g. {"temperature.gpu": 35, "power.draw": 90.5, "utilization.gpu": 1}.
    """
    gpu = make_gpu(0, **FIXTURE_GPUS[capture])
    gpu.update(overrides or {})
    gpu.update(_pci_parts(gpu["pci.bus_id"]))
    return gpu


def _resolve_gpu(config: dict, gpu) -> str:
    """uuid of `gpu`, given as uuid or global position (int or digit string)."""
    gpus = config["gpus"]
    if isinstance(gpu, int) or (isinstance(gpu, str) and gpu.isdigit()):
        return gpus[int(gpu)]["uuid"]
    for entry in gpus:
        if gpu in (entry["uuid"], entry.get("pci.bus_id")):
            return entry["uuid"]
    raise KeyError(f"no GPU {gpu!r} in the lab config")


def global_index(state_dir, uuid: str) -> int:
    """The node-wide position of GPU `uuid`: its index in the node view and the minor of /dev/nvidia<minor>."""
    for position, gpu in enumerate(read_config(state_dir)["gpus"]):
        if gpu["uuid"] == uuid:
            return int(gpu.get("minor_number", position))
    raise KeyError(f"no GPU {uuid!r} in the lab config")


def _normalize_views(config: dict, views: dict | None) -> dict:
    """Views with uuids only; "node" always present (all GPUs in global order) unless given explicitly.

    A view lists its GPUs in the order NVML enumerates them there (index 0 first); give them in PCI order
    to match a real container.
    """
    result = {"node": [g["uuid"] for g in config["gpus"]]}
    for name, members in (views or {}).items():
        result[name] = [_resolve_gpu(config, m) for m in members]
    return result


def write_config(
    state_dir,
    gpu_count: int = 8,
    views: dict | None = None,
    *,
    gpus: list[dict] | None = None,
    driver_version: str = DRIVER_VERSION,
    cuda_version: str = CUDA_VERSION,
) -> dict:
    """Write <state_dir>/config.json for `gpu_count` idle H200s (or the given `gpus`) and create holders/.

    `views` maps view name -> GPUs (uuids or global positions), e.g. {"ct200": [0, 1]}; the node view with
    every GPU is added unless given. Faults, leaks and holder registrations are left as they are (see
    `reset_state`). Returns the config written.
    """
    state = Path(state_dir)
    gpus = [dict(g) for g in (gpus if gpus is not None else make_gpus(gpu_count))]
    for position, gpu in enumerate(gpus):
        gpu.setdefault("minor_number", position)
    config = {"driver_version": driver_version, "cuda_version": cuda_version, "gpus": gpus}
    config["views"] = _normalize_views(config, views)
    _write_json(state / "config.json", config)
    holders = state / "holders"
    holders.mkdir(parents=True, exist_ok=True)
    # World-writable + sticky like /tmp: holders in unprivileged containers (mapped uids) register here too.
    holders.chmod(0o1777)
    return config


def write_fixture_config(state_dir, capture: int = 1, views: dict | None = None, overrides: dict | None = None) -> dict:
    """config.json with the single GPU of fixture machine `capture` (see `fixture_gpu`)."""
    return write_config(state_dir, views=views, gpus=[fixture_gpu(capture, overrides)])


def set_views(state_dir, views: dict) -> dict:
    """Replace the views of config.json (same rules as in `write_config`)."""
    config = read_config(state_dir)
    config["views"] = _normalize_views(config, views)
    _write_json(Path(state_dir) / "config.json", config)
    return config


def update_gpu(state_dir, gpu, attrs: dict) -> dict:
    """Change attributes of one GPU (uuid or global position), e.g. {"remapped_rows.pending": "Yes"}."""
    config = read_config(state_dir)
    uuid = _resolve_gpu(config, gpu)
    entry = next(g for g in config["gpus"] if g["uuid"] == uuid)
    entry.update(attrs)
    _write_json(Path(state_dir) / "config.json", config)
    return entry


def set_fault(state_dir, view: str, mode: str, gpu=None) -> dict:
    """Inject `mode` into what `view` sees: gpu_lost (exit 15), inforom (exit 14), no_permission (exit 4).

    `gpu` (uuid or global position) is the GPU the fault names; None means the view's first GPU. One fault per
    view; a real lost GPU is lost for every view that has it, so set the fault for each of them.
    """
    if mode not in FAULT_MODES:
        raise ValueError(f"fault mode must be one of {FAULT_MODES}, not {mode!r}")
    faults = read_faults(state_dir)
    faults[view] = {"mode": mode, "gpu": None if gpu is None else _resolve_gpu(read_config(state_dir), gpu)}
    _write_json(Path(state_dir) / "faults.json", faults)
    return faults


def clear_faults(state_dir, view: str | None = None) -> dict:
    """Remove the fault of `view`, or every fault."""
    faults = {} if view is None else {k: v for k, v in read_faults(state_dir).items() if k != view}
    _write_json(Path(state_dir) / "faults.json", faults)
    return faults


def set_leak(state_dir, gpu, mib: int) -> dict:
    """Account `mib` MiB on `gpu` (uuid or global position) to no process: a leak the driver never freed."""
    leaks = read_leaks(state_dir)
    leaks[_resolve_gpu(read_config(state_dir), gpu)] = int(mib)
    _write_json(Path(state_dir) / "leaks.json", leaks)
    return leaks


def clear_leaks(state_dir, gpu=None) -> dict:
    """Free the leak of `gpu`, or every leak (what a GPU reset or reboot does)."""
    leaks = {}
    if gpu is not None:
        uuid = _resolve_gpu(read_config(state_dir), gpu)
        leaks = {k: v for k, v in read_leaks(state_dir).items() if k != uuid}
    _write_json(Path(state_dir) / "leaks.json", leaks)
    return leaks


def reset_state(state_dir) -> None:
    """Clear faults, leaks and holder registrations (the processes themselves are the caller's business)."""
    clear_faults(state_dir)
    clear_leaks(state_dir)
    clear_holders(state_dir)


# ---------------------------------------------------------------------------------------------- views


def write_view_config(
    path,
    view: str,
    state_dir,
    *,
    proc_root: str = "/proc",
    kernel_version_file: str = VIEW_DEFAULTS["kernel_version_file"],
    nvml_library_glob: str = VIEW_DEFAULTS["nvml_library_glob"],
    dev_dir: str | None = None,
) -> dict:
    """Write the JSON that the stand-in and the holder of one place find through $PVE_GPU_LAB_CONFIG."""
    data = {
        "view": view,
        "state_dir": str(state_dir),
        "proc_root": str(proc_root),
        "kernel_version_file": str(kernel_version_file),
        "nvml_library_glob": str(nvml_library_glob),
        "dev_dir": None if dev_dir is None else str(dev_dir),
    }
    _write_json(Path(path), data)
    return data


def load_view_config(path=None) -> dict:
    """The view config at `path`, else $PVE_GPU_LAB_CONFIG, else /etc/pve-gpu-lab/standin.json; missing keys
    take the node's defaults. Raises OSError / ValueError when it cannot be read."""
    path = path or os.environ.get(LAB_CONFIG_ENV) or DEFAULT_LAB_CONFIG
    with open(path) as fh:
        data = json.load(fh)
    return {**VIEW_DEFAULTS, **data}


# ---------------------------------------------------------------------------------------------- driver files

KERNEL_MODULE_RE = re.compile(r"^NVRM version: NVIDIA UNIX .*?Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)\s", re.M)
NVML_NAME_RE = re.compile(r"libnvidia-ml\.so\.(\d+\.\d+(?:\.\d+)?)$")


def write_kernel_version_file(path, version: str = DRIVER_VERSION, open_module: bool = True) -> Path:
    """Write a /proc/driver/nvidia/version look-alike for kernel module `version`.

    The open module (what 580 installs on Hopper by default) says "Open Kernel Module for x86_64 ... Release
    Build"; the proprietary one "x86_64 Kernel Module". The builder host and dates are placeholders.
    """
    if open_module:
        head = (
            f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build  "
            "(dvs-builder@U22-I3-AE18-23-3)  Wed Oct 29 06:49:20 UTC 2025"
        )
    else:
        head = f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  Wed Oct 29 06:49:20 UTC 2025"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{head}\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14+deb12u1) \n")
    return path


def write_nvml_library(lib_dir, version: str = DRIVER_VERSION) -> Path:
    """Create the placeholder libnvidia-ml.so.<version> and the libnvidia-ml.so.1 link ldconfig would make."""
    lib_dir = Path(lib_dir)
    lib_dir.mkdir(parents=True, exist_ok=True)
    lib = lib_dir / f"libnvidia-ml.so.{version}"
    lib.write_text("pve-gpu-recover lab placeholder for the NVML library\n")
    link = lib_dir / "libnvidia-ml.so.1"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(lib.name)
    return lib


def kernel_module_version(path) -> str | None:
    """Version of the loaded kernel module per its version file; None when no module is loaded (no file)
    or the file does not name a version."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    match = KERNEL_MODULE_RE.search(text)
    return match.group(1) if match else None


def nvml_library_version(pattern: str) -> tuple[bool, str | None]:
    """(found, version) of the NVML library a dlopen would load among the files matching `pattern`.

    Dangling links do not count (dlopen fails on them). libnvidia-ml.so.1 is what nvidia-smi loads, so its
    target's version wins; otherwise the highest versioned file. version is None for unversioned files.
    """
    # glob, not Path.glob: the pattern is an absolute path that may hold wildcards in any component.
    paths = sorted(Path(p) for p in glob.glob(pattern) if Path(p).exists())
    if not paths:
        return False, None
    soname = [p for p in paths if p.name == "libnvidia-ml.so.1"]
    if soname:
        match = NVML_NAME_RE.search(soname[0].resolve().name)
        if match:
            return True, match.group(1)
    versions = [m.group(1) for m in (NVML_NAME_RE.search(p.name) for p in paths) if m]
    if not versions:
        return True, None
    return True, max(versions, key=lambda v: tuple(int(x) for x in v.split(".")))


NO_LIBRARY = (
    "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that the NVIDIA Display "
    "Driver is properly installed and present in your system.\n"
    "Please also try adding directory that contains libnvidia-ml.so to your system PATH.\n"
)
NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
    "NVIDIA driver is installed and running.\n\n"
)


def driver_check(view_cfg: dict) -> tuple[int, str] | None:
    """What nvidia-smi prints (exit code, stdout) before it can talk to any GPU, or None when it can.

    Same order as the real tool: dlopen of libnvidia-ml (12), then nvmlInit finding the kernel module (9),
    then the version handshake between library and module (18).
    """
    found, lib_version = nvml_library_version(view_cfg["nvml_library_glob"])
    if not found:
        return 12, NO_LIBRARY
    module_version = kernel_module_version(view_cfg["kernel_version_file"])
    if module_version is None:
        return 9, NO_DRIVER
    if lib_version is not None and lib_version != module_version:
        short = ".".join(lib_version.split(".")[:2])
        return 18, f"Failed to initialize NVML: Driver/library version mismatch\nNVML library version: {short}\n"
    return None


# ---------------------------------------------------------------------------------------------- processes


def read_proc_stat(proc_root, pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) from <proc_root>/<pid>/stat, None if there is no such process."""
    try:
        data = (Path(proc_root) / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    # comm (field 2) may contain spaces and ')'; the fields after the last ')' start at field 3 (state).
    rest = data[data.rfind(b")") + 2 :].split()
    return rest[0].decode(), int(rest[19])


def process_name(proc_root, pid: int) -> str:
    """argv[0] of the process, as NVML names compute processes ("python3" for `python3 /tmp/hold.py`)."""
    base = Path(proc_root) / str(pid)
    try:
        argv0 = (base / "cmdline").read_bytes().split(b"\0", 1)[0]
        if argv0:
            return argv0.decode(errors="replace")
        return (base / "comm").read_text().strip()
    except OSError:
        return ""


def find_host_pid(proc_root="/proc") -> int:
    """This process's PID as the host's /proc (mounted at `proc_root`) numbers it.

    Inside a container os.getpid() is the PID in the container's namespace, but NVML reports host PIDs. The
    host entry is the one whose NSpid ends with our PID and whose pid namespace is ours (the NSpid match alone
    could be another container's process with the same local PID). <proc_root>/self already points at our host
    entry when proc_root is a host procfs, so it is checked first; then every entry.
    """
    if Path(proc_root).resolve() == Path("/proc"):
        return os.getpid()
    my_pid = str(os.getpid())
    my_ns = Path("/proc/self/ns/pid").readlink()
    root = Path(proc_root)
    candidates = []
    with contextlib.suppress(OSError):
        candidates.append(str((root / "self").readlink()))
    candidates += [entry.name for entry in root.iterdir() if entry.name.isdigit()]
    for pid in candidates:
        try:
            status = (root / pid / "status").read_text()
            nspid = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
            if nspid and nspid[-1] == my_pid and (root / pid / "ns" / "pid").readlink() == my_ns:
                return int(pid)
        except (OSError, StopIteration, ValueError):
            continue
    raise LookupError(f"no entry for pid {my_pid} (pid namespace {my_ns}) under {proc_root}")


def register_holder(state_dir, pid: int, start_time: int, gpus: dict, **meta) -> Path:
    """Record that host process `pid` (started at `start_time` ticks) holds gpus {uuid: MiB}."""
    path = Path(state_dir) / "holders" / f"{pid}-{start_time}.json"
    _write_json(path, {"pid": pid, "start_time": start_time, "gpus": gpus, **meta})
    return path


def clear_holders(state_dir) -> None:
    for path in (Path(state_dir) / "holders").glob("*.json"):
        path.unlink(missing_ok=True)


def holder_pids(state_dir, proc_root="/proc") -> list[int]:
    """Host pids of the holders alive now (a pid reused by another process is not listed, so it is safe to kill)."""
    return [holder["pid"] for holder in live_holders(state_dir, proc_root)]


def live_holders(state_dir, proc_root="/proc", prune: bool = True) -> list[dict]:
    """Registered holders whose process still runs, oldest first, each with its current "process_name".

    Dead ones (no such PID, a zombie, or a PID reused by a process with another start time) hold nothing;
    their files are deleted when `prune` and allowed (a container may not delete the node's files).
    """
    if not (Path(proc_root) / "1" / "stat").exists():
        # Without the host's processes every holder would look dead and be pruned: refuse instead.
        raise FileNotFoundError(f"{proc_root} is not a mounted procfs")
    live = []
    for path in (Path(state_dir) / "holders").glob("*.json"):
        try:
            holder = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # vanished between glob and read, or not ours
        stat = read_proc_stat(proc_root, holder["pid"])
        if stat is None or stat[0] in ("Z", "X") or stat[1] != holder["start_time"]:
            if prune:
                with contextlib.suppress(OSError):
                    path.unlink()
            continue
        holder["process_name"] = process_name(proc_root, holder["pid"])
        live.append(holder)
    live.sort(key=lambda h: (h["start_time"], h["pid"]))
    return live


# ---------------------------------------------------------------------------------------------- snapshot


class GpuView:
    """One GPU as a view sees it: its view `index`, the config entry, processes and memory now."""

    __slots__ = ("free_mib", "gpu", "index", "lost", "minor", "processes", "used_mib")

    def __init__(self, index: int, gpu: dict, minor: int):
        self.index = index
        self.gpu = gpu
        self.minor = minor
        self.processes: list[dict] = []  # {"pid", "process_name", "used_mib", "start_time"}
        self.used_mib = 0
        self.free_mib = 0
        self.lost = False


class Snapshot:
    """Everything one nvidia-smi call reports, read once: config, the view's GPUs, the view's fault."""

    __slots__ = ("config", "fault", "gpus", "view")

    def __init__(self, config: dict, view: str, gpus: list[GpuView], fault: dict | None):
        self.config = config
        self.view = view
        self.gpus = gpus
        self.fault = fault


def snapshot(view_cfg: dict) -> Snapshot:
    """Read the shared state for `view_cfg` and compute what its GPUs show right now.

    memory.used = live holders' MiB + 3 MiB + 6 MiB per holder (0 when none) + leaked MiB;
    memory.free = total - (reserved - 1) - used: NVML rounds reserved (~615.5 MiB) and free separately, which
    is why the idle H200 shows reserved 616 but free = 143771 - 615.
    """
    state_dir = view_cfg["state_dir"]
    config = read_config(state_dir)
    view = view_cfg["view"]
    fault = read_faults(state_dir).get(view)
    leaks = read_leaks(state_dir)
    position = {g["uuid"]: i for i, g in enumerate(config["gpus"])}
    by_uuid = {g["uuid"]: g for g in config["gpus"]}
    members = config.get("views", {}).get(view, [])
    dev_dir = view_cfg.get("dev_dir")
    if dev_dir:
        # NVML only enumerates GPUs whose device node exists here.
        minor = {u: by_uuid[u].get("minor_number", position[u]) for u in members}
        members = [u for u in members if (Path(dev_dir) / f"nvidia{minor[u]}").exists()]
    gpus = [GpuView(i, by_uuid[u], by_uuid[u].get("minor_number", position[u])) for i, u in enumerate(members)]
    if fault and fault.get("mode") == "gpu_lost" and gpus:
        lost = fault.get("gpu") or gpus[0].gpu["uuid"]
        for g in gpus:
            g.lost = g.gpu["uuid"] == lost
    index = {g.gpu["uuid"]: g for g in gpus}
    for holder in live_holders(state_dir, view_cfg["proc_root"]):
        for uuid, mib in holder["gpus"].items():
            if uuid in index:
                index[uuid].processes.append(
                    {
                        "pid": holder["pid"],
                        "process_name": holder["process_name"],
                        "used_mib": int(mib),
                        "start_time": holder["start_time"],
                    }
                )
    for g in gpus:
        n = len(g.processes)
        overhead = DRIVER_OVERHEAD_MIB + CONTEXT_OVERHEAD_MIB * n if n else 0
        g.used_mib = sum(p["used_mib"] for p in g.processes) + overhead + int(leaks.get(g.gpu["uuid"], 0))
        total = int(g.gpu.get("memory.total", 0))
        reserved = int(g.gpu.get("memory.reserved", 1))
        g.free_mib = max(total - (reserved - 1) - g.used_mib, 0)
    return Snapshot(config, view, gpus, fault)
