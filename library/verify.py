#!/usr/bin/python
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

DOCUMENTATION = r"""
module: verify
short_description: Prove a GPU target is in its known-good state - GPUs, their health, torch and CUDA
description:
  - Reads the target's GPUs with one C(nvidia-smi --query-gpu) (one C(pct exec) for a CT) and asserts them -
    how many, which model, the memory they use, the driver, and their health - uncorrected volatile ECC errors,
    pending or failed row remaps, the recovery action the driver asks for, the PCIe link width and generation
    against their maximum, persistence mode.
  - Then runs the venv's own python once, C(<venv>/bin/python -I -B -) with a stdlib-only script on stdin (a
    second C(pct exec)), under a deadline I(torch_timeout). In that ONE process it imports torch and asks CUDA -
    C(torch.__version__), C(torch.version.cuda), C(torch.cuda.is_available), C(torch.cuda.device_count), the device
    names, C(torch.backends.cudnn.version) and triton's version from its metadata. What it prints is untrusted
    input - read only when it is a JSON object of the expected shape, at most 64 KiB, every version matched
    against a strict pattern.
  - Asserts what it read against the known-good spec - I(torch_version), I(cuda_version), CUDA available, the GPU
    count I(gpu_count) and model I(gpu_name) as torch sees them too. The last good manual check printed
    C(2.11.0+cu128 / 12.8 / True 8), eight C(NVIDIA H200) at 0 MiB.
  - Fails with every failed assertion at once, each one sentence - what was expected, what was found and the
    likely cause. A C(+cpu) torch came from the wrong index. CUDA error 802 means the fabric manager is not
    running. Fewer devices than GPUs passed through means C(CUDA_VISIBLE_DEVICES) or a missing C(/dev/nvidiaN). A
    wrong C(torch.version.cuda) is the other CUDA build of torch. Memory in use means a process still holds it. A
    driver older than torch's CUDA needs is named with the driver it needs. Health checks at C(warn) are warnings.
  - It never changes anything and never reports C(changed). In recover.yml the fact pass (M(pve_gpu.recover.target_facts)) makes
    every check it can without importing torch; this module runs only when verify is pending there (I(import_torch)).
version_added: "0.5.0"
author: pve-gpu-recover contributors (@pve-gpu-recover)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - pve_gpu.recover.pve_target
  - pve_gpu.recover.pve_target.run_lock
attributes:
  check_mode:
    support: full
    details: Read-only; runs the same in check mode.
  diff_mode:
    support: none
  platform:
    platforms: posix
options:
  venv:
    description:
      - The venv whose torch is checked, inside the target; its C(bin/python) imports torch.
    type: path
    default: /opt/venvs/train
  torch_version:
    description:
      - C(torch.__version__) exactly, local tag included (C(2.11.0+cu128) is not C(2.11.0+cu130) nor C(2.11.0)).
      - Empty asserts nothing.
    type: str
    default: ""
  cuda_version:
    description:
      - C(torch.version.cuda), the CUDA torch was built for (C(12.8)); must agree with I(torch_version)'s build.
      - Empty asserts nothing.
    type: str
    default: ""
  gpu_count:
    description:
      - How many GPUs C(nvidia-smi) and torch must see.
      - Unset, the target's C(/dev/nvidiaN) nodes as the torch script finds them (the GPUs passed through), or the
        GPUs C(nvidia-smi) lists when torch is not imported.
    type: int
  gpu_name:
    description:
      - The model of every GPU, as C(nvidia-smi) and C(torch.cuda.get_device_name) name it. Empty asserts nothing.
    type: str
    default: NVIDIA H200
  max_memory_used_mib:
    description:
      - C(memory.used) of every GPU must be at most this many MiB (an idle H200 shows 0).
    type: int
    default: 0
  memory_kept_gpus:
    description:
      - The indexes of GPUs whose memory is left out of I(max_memory_used_mib) - those an unattended run leaves to the
        guarded training job (the fact pass's C(gpu_processes.kept_gpus), named in its C(needs_window)).
      - The role passes them; empty asserts every GPU.
    type: list
    elements: int
    default: []
  driver_version:
    description:
      - The driver NVML reports (C(580.159.04)). Empty asserts nothing.
    type: str
    default: ""
  health:
    description:
      - What each health check does when a GPU fails it - C(fail) (the task fails), C(warn) (a warning), C(ignore)
        (not checked). Checks not named keep their default.
      - A value C(nvidia-smi) prints in brackets where a check needs a number (C([GPU requires reset]), or C([N/A])
        for a field every supported driver knows) makes the check impossible, which counts as failing it, naming
        the GPU.
    type: dict
    default: {}
    suboptions:
      ecc:
        description: Uncorrected volatile ECC errors (C(ecc.errors.uncorrected.volatile.total)) above 0.
        type: str
        choices: [fail, warn, ignore]
        default: fail
      remapped_rows:
        description: A pending (C(remapped_rows.pending), a reset applies it) or failed (C(remapped_rows.failure),
          an RMA) row remap.
        type: str
        choices: [fail, warn, ignore]
        default: fail
      recovery_action:
        description: A C(gpu_recovery_action) other than C(None) (C(Reset), C(Reboot), C(Drain P2P),
          C(Drain and Reset)).
        type: str
        choices: [fail, warn, ignore]
        default: fail
      pcie_width:
        description: C(pcie.link.width.current) below C(pcie.link.width.max) (a degraded link).
        type: str
        choices: [fail, warn, ignore]
        default: warn
      pcie_gen:
        description: C(pcie.link.gen.current) below C(pcie.link.gen.max). An idle GPU lowers its link generation to
          save power, so this is only meaningful under load.
        type: str
        choices: [fail, warn, ignore]
        default: ignore
      persistence_mode:
        description: Persistence mode off.
        type: str
        choices: [fail, warn, ignore]
        default: warn
  import_torch:
    description:
      - When torch is imported. This module imports it unless C(never); C(changed) and C(always) differ only in when
        the verify role runs this module - C(changed) after another step had work in the run (never in check mode),
        C(always) on every run, check mode included. With C(never) the role never runs it (the fact pass's checks
        only) and this module checks C(nvidia-smi) alone.
    type: str
    choices: [changed, always, never]
    default: changed
  torch_timeout:
    description:
      - Seconds the venv's python may take to import torch and start CUDA (7.5 s the first time on a one-GPU H200,
        2 s once its files are cached). It is killed then, in the target too, and the task fails saying so.
    type: int
    default: 180
requirements:
  - C(nvidia-smi) inside the target; the venv at I(venv) with its python (3.9+) and torch.
seealso:
  - module: pve_gpu.recover.target_facts
  - module: pve_gpu.recover.training_venv
  - module: pve_gpu.recover.gpu_processes
notes:
  - Never pastes what the target printed into advice - errors and GPU names are quoted and shortened, versions are
    checked against a pattern, and the commands it suggests name only GPU UUIDs the C(nvidia-smi) parser validated.
"""

EXAMPLES = r"""
- name: Prove CT 200 is the known-good state (torch 2.11.0+cu128, CUDA 12.8, 8 x H200 at 0 MiB)
  pve_gpu.recover.verify:
    vmid: 200
    torch_version: 2.11.0+cu128
    cuda_version: "12.8"
    gpu_count: 8
  delegate_to: pve1

- name: Check only the GPUs of a bare host, a degraded PCIe link failing the task
  pve_gpu.recover.verify:
    import_torch: never
    health:
      pcie_width: fail
"""

RETURN = r"""
checks:
  description:
    - Every assertion made, in order - C(name) (C(gpu_count), C(gpu_name), C(memory), C(driver_version), the health
      checks by their I(health) names, C(torch_import), C(torch_version), C(cuda_version), C(cuda_available),
      C(torch_device_count), C(torch_device_names)), C(ok), C(severity) (C(fail), or the health check's level),
      C(expected), C(found) and C(detail), one sentence.
  returned: always
  type: list
  elements: dict
  sample:
    - name: torch_version
      ok: false
      severity: fail
      expected: 2.11.0+cu128
      found: 2.11.0+cu130
      detail: "CT 200 on pve1: torch is 2.11.0+cu130 (torch.__version__ in /opt/venvs/train), expected 2.11.0+cu128;
        the other CUDA build of torch (cu130, expected cu128); take torch from https://download.pytorch.org/whl/cu128
        (an --extra-index-url of the training_venv lock)"
torch:
  description:
    - What the venv's python said - C(python) (C(<venv>/bin/python)), C(version), C(cuda), C(available),
      C(device_count), C(device_names), C(cudnn), C(dist_version) (torch's dist-info version), C(triton),
      C(python_version), C(seconds); C(error) and C(error_phase) (C(import) or C(cuda)) when something failed,
      C(warnings) (what CUDA's initialization warned), C(devices) (the C(/dev/nvidiaN) it saw),
      C(cuda_visible_devices), C(failure) (C(not_found), C(timeout), C(crashed), C(import), or null), C(timeout).
    - Null with I(import_torch=never).
  returned: always
  type: dict
  sample:
    python: /opt/venvs/train/bin/python
    version: 2.11.0+cu128
    cuda: "12.8"
    available: true
    device_count: 8
    device_names: [NVIDIA H200, NVIDIA H200, NVIDIA H200, NVIDIA H200, NVIDIA H200, NVIDIA H200, NVIDIA H200,
                   NVIDIA H200]
    cudnn: 91900
    dist_version: 2.11.0+cu128
    triton: 3.6.0
    error: null
    error_phase: null
    warnings: []
    devices: [/dev/nvidia0, /dev/nvidia1, /dev/nvidia2, /dev/nvidia3, /dev/nvidia4, /dev/nvidia5, /dev/nvidia6,
              /dev/nvidia7]
    cuda_visible_devices: null
    python_version: 3.11.2
    seconds: 7.9
    failure: null
    timeout: 180
gpus:
  description: The GPUs C(nvidia-smi) lists in the target, with every field M(pve_gpu.recover.gpu_info) returns.
  returned: always
  type: list
  elements: dict
venv:
  description:
    - The venv checked, I(venv) (not returned as C(path), which would make Ansible add the node's file stats).
  returned: always
  type: str
  sample: /opt/venvs/train
expected:
  description: What was asserted after defaults - C(gpu_count), C(gpu_name), C(max_memory_used_mib),
    C(driver_version), C(torch_version), C(cuda_version) (null - not asserted), C(health) (each check's level).
  returned: always
  type: dict
  sample: {gpu_count: 8, gpu_name: NVIDIA H200, max_memory_used_mib: 0, driver_version: null,
           torch_version: 2.11.0+cu128, cuda_version: "12.8",
           health: {ecc: fail, remapped_rows: fail, recovery_action: fail, pcie_width: warn, pcie_gen: ignore,
                    persistence_mode: warn}}
changes:
  description: What the run changed - nothing, ever (a read-only step); the key every acting module returns.
  returned: always
  type: list
  elements: str
  sample: []
seconds:
  description: Seconds the module took.
  returned: always
  type: float
error:
  description:
    - On failure, what kind of failure it was, stable for code - C(verify) (an assertion failed; see I(checks)),
      C(invalid) (options that cannot work), C(probe) (the torch script answered something that is not its
      answer), the target's (C(stopped), C(missing), C(timeout), ...) and nvidia-smi's (C(nvidia_smi_gpu_lost),
      C(nvidia_smi_driver_mismatch), ...).
  returned: failure
  type: str
  sample: verify
cmd:
  description: On failure of a command, the argv that ran (the C(pct exec) wrapper included).
  returned: failure of a command
  type: list
  elements: str
rc:
  description: On failure of a command, its exit code.
  returned: failure of a command
  type: int
stdout_tail:
  description: On failure of a command, the last 20 lines of its stdout.
  returned: failure of a command that printed
  type: str
stderr_tail:
  description: On failure of a command, the last 20 lines of its stderr.
  returned: failure of a command that printed
  type: str
lost_bus_ids:
  description: On failure because a GPU fell off the bus, the PCI bus ids nvidia-smi could not reach.
  returned: failure
  type: list
  elements: str
field:
  description: On failure because the driver does not know a field nvidia-smi was asked for, that field.
  returned: failure
  type: str
bad_row:
  description: On failure because nvidia-smi printed a GPU UUID that is not one, that row, quoted.
  returned: failure
  type: str
"""


from ansible_collections.pve_gpu.recover.plugins.module_utils.node.act_runner import run_step_module
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.run_lock import RUN_LOCK_ARGUMENT_SPEC
from ansible_collections.pve_gpu.recover.plugins.module_utils.node.target import TARGET_ARGUMENT_SPEC
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify.acting import Verify
from ansible_collections.pve_gpu.recover.plugins.module_utils.steps.verify.facts import SPEC

ARGUMENT_SPEC = {
    **TARGET_ARGUMENT_SPEC,
    **RUN_LOCK_ARGUMENT_SPEC,
    **SPEC,
    "torch_timeout": {"type": "int", "default": 180},
    "memory_kept_gpus": {"type": "list", "elements": "int", "default": []},
}


def main():
    run_step_module(Verify(ARGUMENT_SPEC))


if __name__ == "__main__":
    main()
