"""The harness of the lab's stand-in tests: paths, `wait_until` and `Lab`, a private lab under tmp_path.

Puts tests/lab/standins on sys.path, so `gpulab` and `gpu_holder` are importable from here. The `lab` fixture
is in conftest.py.
"""

import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]
FIXTURES = TESTS / "fixtures" / "h200"
STANDINS = TESTS / "lab" / "standins"
NVIDIA_SMI = STANDINS / "nvidia_smi.py"
HOLDER = STANDINS / "gpu_holder.py"

sys.path.insert(0, str(STANDINS))
import gpu_holder  # noqa: E402
import gpulab  # noqa: E402

__all__ = ["FIXTURES", "HOLDER", "NVIDIA_SMI", "STANDINS", "TESTS", "Lab", "gpu_holder", "gpulab", "wait_until"]


def wait_until(predicate, timeout: float = 5.0):
    """Poll `predicate` until it returns a truthy value; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(0.01)


class Lab:
    """A private lab under `root` (proc_root=/proc): state dir, one view config per view, driver files.

    Runs the nvidia-smi stand-in and GPU holders as subprocesses; `close()` kills and reaps every holder.
    """

    def __init__(self, root: Path):
        self.root = root
        self.state = root / "state"
        self.kernel_file = gpulab.write_kernel_version_file(root / "driver" / "version")
        self.lib_dir = root / "lib"
        gpulab.write_nvml_library(self.lib_dir)
        self.procs: list[subprocess.Popen] = []

    def view_config(self, view: str) -> Path:
        path = self.root / f"view-{view}.json"
        if not path.exists():
            gpulab.write_view_config(
                path,
                view,
                self.state,
                proc_root="/proc",
                kernel_version_file=str(self.kernel_file),
                nvml_library_glob=str(self.lib_dir / "libnvidia-ml.so.*"),
            )
        return path

    def env(self, view: str = "node") -> dict:
        return {**os.environ, gpulab.LAB_CONFIG_ENV: str(self.view_config(view))}

    def smi(self, *args: str, view: str = "node", python: str = sys.executable) -> subprocess.CompletedProcess:
        return subprocess.run(
            [python, str(NVIDIA_SMI), *args],
            env=self.env(view),
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )

    def smi_stdout(self, *args: str, view: str = "node") -> str:
        """The stand-in's stdout; it must exit 0."""
        result = self.smi(*args, view=view)
        assert result.returncode == 0, result
        return result.stdout

    def used(self, view: str = "node") -> str:
        return self.smi_stdout("--query-gpu=memory.used", "--format=csv,noheader", view=view)

    def apps(self, view: str = "node") -> str:
        return self.smi_stdout(
            "--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv,noheader", view=view
        )

    def start(self, *args: str, view: str = "node", argv0: str | None = None) -> subprocess.Popen:
        """Start a holder, with argv[0] = `argv0` (as `python3 /tmp/hold.py` was in the capture) if given."""
        env = self.env(view)
        if argv0:
            env["PYTHONHOME"] = sys.base_prefix  # a bare argv[0] does not tell Python where its stdlib is
        proc = subprocess.Popen(
            [argv0 or sys.executable, str(HOLDER), *args],
            executable=sys.executable,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        return proc

    def hold(self, *args: str, view: str = "node", argv0: str | None = None) -> tuple[subprocess.Popen, int]:
        """Start a holder and wait for its single `held <hostpid>` line."""
        proc = self.start(*args, view=view, argv0=argv0)
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(timeout=20), "holder did not report"
        line = proc.stdout.readline()
        assert line.startswith("held "), f"holder failed: {line!r} {'' if line else proc.stderr.read()}"
        return proc, int(line.split()[1])

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            proc.stdout.close()
            proc.stderr.close()
