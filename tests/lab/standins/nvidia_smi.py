#!/usr/bin/env python3
"""`nvidia-smi` stand-in for the pve-gpu-recover lab, byte for byte like driver 580.159.04 on an H200.

The lab has no GPU; this program answers the nvidia-smi calls the collection makes from the shared lab state
(see gpulab.py) so that modules, parsers and recovery logic meet the exact bytes and exit codes of the real
tool (reference captures: tests/fixtures/h200). Implemented:

    nvidia-smi                                       the summary table (one block per GPU, then processes)
    nvidia-smi -L | --list-gpus                      "GPU 0: NVIDIA H200 (UUID: GPU-...)"
    nvidia-smi --query-gpu=F,.. --format=csv[,noheader][,nounits] [-i|--id=ID,..]
    nvidia-smi --query-compute-apps=F,.. --format=csv[,noheader][,nounits] [-i|--id=ID,..]
    nvidia-smi --help-query-gpu | --help-query-compute-apps

Field names, aliases and their canonical (header) spelling come from data/nvsmi_help_query_*.txt, the real
help texts, so exactly the fields the driver accepts are valid; valid fields the lab does not simulate print
"[N/A]" like unsupported ones on real hardware. Everything else (--gpu-reset, -q -x, ...) says on stderr that
the lab does not implement it and exits 2, never a fake success.

Failures come from the same places as on a real machine: a missing kernel version file is an unloaded driver
(exit 9), no NVML library is exit 12, library and module of different versions exit 18; faults.json adds a
lost GPU (15), a corrupted infoROM (14, warning then normal output) and insufficient permissions (4).

The view config is found through $PVE_GPU_LAB_CONFIG (tests may pass `--lab-config PATH` first instead).
"""

import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import gpulab  # noqa: E402  (found next to this script, wherever the lab copied it)

DATA = HERE / "data"
HELP_FILES = {"gpu": DATA / "nvsmi_help_query_gpu.txt", "apps": DATA / "nvsmi_help_query_apps.txt"}

# A field entry of the help text is a line made only of quoted names: `"name" or "gpu_name"`. Lines such as
# `"0: Default" means ...` (the compute_mode explanation) are prose, not fields.
FIELD_LINE = re.compile(r'^"([^"]+)"(?: or "[^"]+")*$')
QUOTED = re.compile(r'"([^"]+)"')

MIB = {"memory.total", "memory.reserved", "memory.used", "memory.free", "protected_memory.total",
       "protected_memory.used", "protected_memory.free", "used_gpu_memory"}  # fmt: skip
PERCENT = {"utilization.gpu", "utilization.memory", "utilization.encoder", "utilization.decoder",
           "utilization.jpeg", "utilization.ofa", "fan.speed"}  # fmt: skip
WATT = {"power.draw", "power.draw.average", "power.draw.instant", "power.limit", "enforced.power.limit",
        "power.default_limit", "power.min_limit", "power.max_limit", "module.power.draw.average",
        "module.power.draw.instant", "module.power.limit", "module.enforced.power.limit",
        "module.power.default_limit", "module.power.min_limit", "module.power.max_limit"}  # fmt: skip

NA = "[N/A]"
EXIT_INVALID_ARG = 2
EXIT_NOT_FOUND = 6
EXIT_CORRUPTED_INFOROM = 14
EXIT_GPU_LOST = 15
EXIT_NO_PERMISSION = 4

SEP_WIDE = "+" + "-" * 89 + "+"
SEP_GPU = "+" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+"
TABLE_HEAD = (
    "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
    "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
    "|                                         |                        |               MIG M. |",
    "|" + "=" * 41 + "+" + "=" * 24 + "+" + "=" * 22 + "|",
)
PROCESS_HEAD = (
    "| Processes:" + " " * 78 + "|",
    "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
    "|        ID   ID                                                               Usage      |",
    "|" + "=" * 89 + "|",
)
COMPUTE_MODE_SHORT = {"Exclusive_Process": "E. Process", "Exclusive_Thread": "E. Thread"}


class Unsupported(Exception):
    """A command line the lab does not reproduce."""


class Result:
    """stdout, stderr and exit code of one call."""

    def __init__(self, code: int = 0, out: str = "", err: str = ""):
        self.code = code
        self.out = out
        self.err = err


# ---------------------------------------------------------------------------------------------- fields


def load_fields(kind: str) -> dict[str, str]:
    """{accepted name: canonical name} from the help text of `kind` ("gpu" or "apps")."""
    fields = {}
    for line in HELP_FILES[kind].read_text().splitlines():
        if FIELD_LINE.match(line):
            names = QUOTED.findall(line)
            for name in names:
                fields.setdefault(name, names[0])
    return fields


def canonical_fields(kind: str, spec: str) -> list[str] | Result:
    """Canonical names for the comma-separated `spec`, or the real error for the first invalid one."""
    known = load_fields(kind)
    folded = {k.lower(): v for k, v in known.items()}
    result = []
    for raw in spec.split(","):
        name = raw.strip()
        canonical = known.get(name) or folded.get(name.lower())
        if canonical is None:
            return Result(EXIT_INVALID_ARG, f'Field "{name}" is not a valid field to query.\n\n')
        result.append(canonical)
    return result


def unit_of(field: str) -> str:
    if field in MIB:
        return "MiB"
    if field in PERCENT:
        return "%"
    if field in WATT:
        return "W"
    if field.startswith("clocks."):
        return "MHz"
    return ""


def header_of(field: str) -> str:
    unit = unit_of(field)
    return f"{field} [{unit}]" if unit else field


def render(field: str, value, units: bool) -> str:
    """One csv cell: "[N/A]" for no value, watts with two decimals, the unit after a space unless nounits."""
    if value is None:
        return NA
    unit = unit_of(field)
    text = f"{float(value):.2f}" if unit == "W" else str(value)
    return f"{text} {unit}" if unit and units else text


def timestamp(now: float) -> str:
    return time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"


def gpu_value(field: str, g: gpulab.GpuView, snap: gpulab.Snapshot, now: float):
    """Raw value of a --query-gpu field for GPU `g`; None prints [N/A]."""
    gpu = g.gpu
    derived = {
        "index": g.index,
        "count": len(snap.gpus),
        "driver_version": snap.config["driver_version"],
        "timestamp": timestamp(now),
        "memory.used": g.used_mib,
        "memory.free": g.free_mib,
    }
    if field in derived:
        return derived[field]
    if field == "clocks_event_reasons.active":
        mask = gpu.get(field)
        if mask is None:
            return None
        # The "GPU idle" reason (bit 0) is only active while no process has a context (busy XML: Not Active).
        return f"0x{(int(mask) & ~1 if g.processes else int(mask)):016x}"
    if field in ("power.draw.average", "power.draw.instant"):
        return gpu.get(field, gpu.get("power.draw"))
    return gpu.get(field)


def app_value(field: str, g: gpulab.GpuView, proc: dict, now: float):
    """Raw value of a --query-compute-apps field for process `proc` on GPU `g`."""
    values = {
        "timestamp": timestamp(now),
        "gpu_name": g.gpu.get("name"),
        "gpu_bus_id": g.gpu.get("pci.bus_id"),
        "gpu_serial": g.gpu.get("serial"),
        "gpu_uuid": g.gpu.get("uuid"),
        "pid": proc["pid"],
        "process_name": proc["process_name"],
        "used_gpu_memory": proc["used_mib"],
    }
    return values.get(field)


# ---------------------------------------------------------------------------------------------- output


def lost_line(g: gpulab.GpuView) -> str:
    bus = g.gpu["pci.bus_id"]
    return f"Unable to determine the device handle for GPU {bus}: GPU is lost.  Reboot the system to recover this GPU"


def query_gpu(fields, selected, snap, *, header: bool, units: bool, now: float) -> list[str]:
    lines = [", ".join(header_of(f) for f in fields)] if header else []
    for g in selected:
        if g.lost:
            lines.append(lost_line(g))  # the lost GPU's row, in its place among the others
        else:
            lines.append(", ".join(render(f, gpu_value(f, g, snap, now), units) for f in fields))
    return lines


def query_apps(fields, selected, *, header: bool, units: bool, now: float) -> list[str]:
    lines = [lost_line(g) for g in selected if g.lost]
    if header:
        lines.append(", ".join(header_of(f) for f in fields))
    for g in selected:
        if not g.lost:
            for proc in g.processes:
                lines.append(", ".join(render(f, app_value(f, g, proc, now), units) for f in fields))
    return lines


def list_gpus(selected) -> list[str]:
    return [lost_line(g) if g.lost else f"GPU {g.index}: {g.gpu['name']} (UUID: {g.gpu['uuid']})" for g in selected]


def _na(value, fmt="{}") -> str:
    return "N/A" if value is None else fmt.format(value)


def gpu_block(g: gpulab.GpuView) -> list[str]:
    """The three table lines of one GPU plus the separator that closes its block."""
    gpu = g.gpu
    name = gpu.get("name") or "N/A"
    if len(name) > 27:
        name = name[:24] + "..."
    persistence = "On" if gpu.get("persistence_mode") == "Enabled" else "Off"
    display = "On" if gpu.get("display_active") == "Enabled" else "Off"
    ecc = _na(gpu.get("ecc.errors.uncorrected.volatile.total"))
    fan = _na(gpu.get("fan.speed"), "{}%")
    temp = _na(gpu.get("temperature.gpu"), "{}C")
    draw, cap = gpu.get("power.draw"), gpu.get("power.limit")
    # NVML reports milliwatts; the table shows whole watts cut off, not rounded (123.99 W -> "123W").
    usage = "N/A" if draw is None else f"{int(float(draw))}W"
    limit = "N/A" if cap is None else f"{int(float(cap))}W"
    memory = f"{g.used_mib}MiB / {gpu.get('memory.total', 0)}MiB"
    util = _na(gpu.get("utilization.gpu"), "{}%")
    compute = gpu.get("compute_mode") or "N/A"
    compute = COMPUTE_MODE_SHORT.get(compute, compute)
    mig = gpu.get("mig.mode.current") or "N/A"
    return [
        f"|{g.index:>4}  {name:<27}{persistence:>6}  |   {gpu['pci.bus_id']} {display:>3} |{ecc:>21} |",
        f"| {fan:>3}  {temp:>4}    {gpu.get('pstate') or 'N/A':<2}{usage:>16} / {limit:>5} |"
        f"{memory:>23} |{util:>8}{compute:>13} |",
        "|" + " " * 41 + "|" + " " * 24 + "|" + f"{mig:>21} |",
        SEP_GPU,
    ]


def process_line(g: gpulab.GpuView, proc: dict) -> str:
    name = proc["process_name"]
    if len(name) > 32:
        name = "..." + name[-29:]  # nvidia-smi keeps the end of a long path
    memory = f"{proc['used_mib']}MiB"
    return f"|{g.index:>5}   {'N/A':<3}  {'N/A':<3}{proc['pid']:>16}{'C':>7}   {name:<32}      {memory:>8} |"


def table(selected, snap, now: float) -> list[str]:
    """The default `nvidia-smi` summary; its first line is asctime() padded like the real one."""
    config = snap.config
    version = config["driver_version"]
    lines = [
        time.asctime(time.localtime(now)) + " " * 7,
        SEP_WIDE,
        f"| NVIDIA-SMI {version:<23}Driver Version: {version:<15}CUDA Version: {config['cuda_version']:<9}|",
        SEP_GPU,
        *TABLE_HEAD,
    ]
    for g in selected:
        lines += gpu_block(g)
    lines += ["", SEP_WIDE, *PROCESS_HEAD]
    procs = [process_line(g, p) for g in selected for p in g.processes]
    lines += procs or ["|  No running processes found" + " " * 61 + "|"]
    lines.append(SEP_WIDE)
    return lines


# ---------------------------------------------------------------------------------------------- arguments

VALUE_OPTIONS = {"--query-gpu": "query_gpu", "--query-compute-apps": "query_apps", "--format": "format",
                 "-i": "ids", "--id": "ids"}  # fmt: skip


def parse_args(argv: list[str]) -> dict:
    opts = {"query_gpu": None, "query_apps": None, "format": None, "ids": None, "list": False, "help": None}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in VALUE_OPTIONS:
            if not eq:
                if i + 1 >= len(argv):
                    raise Unsupported
                i += 1
                value = argv[i]
            opts[VALUE_OPTIONS[name]] = value
        elif arg in ("-L", "--list-gpus"):
            opts["list"] = True
        elif arg == "--help-query-gpu":
            opts["help"] = "gpu"
        elif arg == "--help-query-compute-apps":
            opts["help"] = "apps"
        else:
            raise Unsupported
        i += 1
    queries = [k for k in ("query_gpu", "query_apps") if opts[k] is not None]
    if len(queries) > 1 or (queries and opts["list"]) or (opts["format"] is not None and not queries):
        raise Unsupported
    if queries:
        tokens = [t.strip() for t in (opts["format"] or "").split(",")]
        if not tokens or tokens[0] != "csv" or not set(tokens[1:]) <= {"noheader", "nounits"}:
            raise Unsupported
        opts["header"] = "noheader" not in tokens
        opts["units"] = "nounits" not in tokens
    return opts


def normalize_bus_id(text: str) -> str:
    """00000000:18:00.0 from 0000:18:00.0 or 18:00.0, upper-case, so every spelling -i accepts compares equal."""
    parts = text.upper().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3:
        return text.upper()
    return f"{int(parts[0], 16):08X}:{parts[1]}:{parts[2]}" if re.fullmatch("[0-9A-F]+", parts[0]) else text.upper()


def select(gpus: list[gpulab.GpuView], ids: str | None) -> list[gpulab.GpuView] | None:
    """The GPUs named by -i (view index, UUID or PCI bus id), in device order; None if one is unknown."""
    if ids is None:
        return gpus
    chosen = set()
    for ident in (t.strip() for t in ids.split(",")):
        match = [
            g
            for g in gpus
            if (ident.isdigit() and int(ident) == g.index)
            or ident.lower() == g.gpu["uuid"].lower()
            or normalize_bus_id(ident) == normalize_bus_id(g.gpu["pci.bus_id"])
        ]
        if not match:
            return None
        chosen.add(match[0].index)
    return [g for g in gpus if g.index in chosen]


# ---------------------------------------------------------------------------------------------- main


def split_lab_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """The hidden `--lab-config PATH` / `--lab-config=PATH` first option (tests), and the real arguments."""
    if argv and argv[0].startswith("--lab-config="):
        return argv[0].partition("=")[2], argv[1:]
    if argv and argv[0] == "--lab-config" and len(argv) > 1:
        return argv[1], argv[2:]
    return None, argv


def open_nvml(config_path: str | None) -> gpulab.Snapshot | Result:
    """What nvmlInit would find in this view: the GPU state, or the failure the real tool prints."""
    try:
        view_cfg = gpulab.load_view_config(config_path)
    except (OSError, ValueError) as exc:
        return Result(EXIT_INVALID_ARG, err=f"stand-in: cannot read the lab view config: {exc}\n")
    failure = gpulab.driver_check(view_cfg)
    if failure:
        return Result(failure[0], failure[1])
    try:
        snap = gpulab.snapshot(view_cfg)
    except (OSError, ValueError, KeyError) as exc:
        return Result(EXIT_INVALID_ARG, err=f"stand-in: cannot read the lab GPU state: {exc}\n")
    if (snap.fault or {}).get("mode") == "no_permission":
        return Result(EXIT_NO_PERMISSION, "Failed to initialize NVML: Insufficient Permissions\n")
    return snap


def report(opts: dict, fields: list[str] | None, snap: gpulab.Snapshot) -> Result:
    """The output of a call that reached the GPUs: selection by -i, faults, then the requested form."""
    selected = select(snap.gpus, opts["ids"])
    if not selected:
        return Result(EXIT_NOT_FOUND, "No devices were found\n")
    now = time.time()
    fault = snap.fault or {}
    prefix = []
    code = 0
    if fault.get("mode") == "inforom":
        bad = next((g for g in snap.gpus if g.gpu["uuid"] == fault.get("gpu")), snap.gpus[0])
        prefix.append(f"WARNING: infoROM is corrupted at gpu {bad.gpu['pci.bus_id']}")
        code = EXIT_CORRUPTED_INFOROM
    if any(g.lost for g in selected):
        code = EXIT_GPU_LOST
    if opts["query_gpu"] is not None:
        lines = query_gpu(fields, selected, snap, header=opts["header"], units=opts["units"], now=now)
    elif opts["query_apps"] is not None:
        lines = query_apps(fields, selected, header=opts["header"], units=opts["units"], now=now)
    elif opts["list"]:
        lines = list_gpus(selected)
    elif code == EXIT_GPU_LOST:
        lines = [lost_line(g) for g in selected if g.lost]  # no table at all while a GPU is lost
    else:
        lines = table(selected, snap, now)
    return Result(code, "".join(line + "\n" for line in prefix + lines))


def run(argv: list[str]) -> Result:
    """Everything but the writing: what `nvidia-smi argv` prints and returns in the configured view."""
    config_path, argv = split_lab_config(argv)
    try:
        opts = parse_args(argv)
    except Unsupported:
        return Result(
            EXIT_INVALID_ARG, err=f"stand-in: {' '.join(argv)} is not implemented by the pve-gpu-recover lab\n"
        )
    if opts["help"]:
        return Result(0, HELP_FILES[opts["help"]].read_text())
    fields = None
    if opts["query_gpu"] is not None:
        fields = canonical_fields("gpu", opts["query_gpu"])
    elif opts["query_apps"] is not None:
        fields = canonical_fields("apps", opts["query_apps"])
    if isinstance(fields, Result):
        return fields  # field names are checked before NVML is touched, like the real argument parser
    snap = open_nvml(config_path)
    return snap if isinstance(snap, Result) else report(opts, fields, snap)


def main(argv: list[str] | None = None) -> int:
    result = run(list(sys.argv[1:] if argv is None else argv))
    try:
        sys.stdout.write(result.out)
        sys.stdout.flush()
    except BrokenPipeError:
        pass  # `nvidia-smi | head -1`: the reader left, like the real tool we stop quietly
    sys.stderr.write(result.err)
    return result.code


if __name__ == "__main__":
    sys.exit(main())
