"""The machine's state stamped on every measurement: what moves a figure besides the code.

- `launch`: vLLM version, the patch series and each patch's state and sha256, from serve.sh's
  launch manifest (LOG.launch.json) when the tool is told the server's log (`--server-log`);
- `gpu`: name, driver, CUDA, SM clock and its maximum (the cap) from nvidia-smi; "unknown" where
  nvidia-smi is absent or fails (a CPU host);
- `ple_table`: the fraction of the PLE table's bytes in the page cache before and after the run
  (mincore over the checkpoint's table shards), when the manifest says PLE=1;
- `mem_available_low_water_bytes`: the lowest MemAvailable seen during the run (sampled every
  0.2 s), with the value before;
- `nv_err_no_memory`: the count of NV_ERR_NO_MEMORY lines in the kernel log (`dmesg`) before and
  after the run; "unreadable" where dmesg is not allowed (kernel.dmesg_restrict).

Standard library only. Nothing here raises: a part that cannot be read says why.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import threading

from magpie.serving import manifest

UNKNOWN = "unknown"
SAMPLE_S = 0.2


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class MemWatch:
    """MemAvailable's low-water mark while the `with` block runs (a thread samples it)."""

    def __init__(self, every: float = SAMPLE_S) -> None:
        self.every = every
        self.before = mem_available()
        self.low = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def _sample(self) -> None:
        value = mem_available()
        if value is not None and (self.low is None or value < self.low):
            self.low = value

    def __enter__(self) -> MemWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def record(self) -> dict:
        return {"mem_available_before_bytes": self.before, "mem_available_low_water_bytes": self.low}


def gpu_state() -> dict:
    """The first GPU as nvidia-smi reports it, or every field "unknown" (with the reason)."""
    fields = ("name", "driver_version", "clocks.sm", "clocks.max.sm")
    out = {"name": UNKNOWN, "driver": UNKNOWN, "cuda": UNKNOWN, "sm_clock_mhz": UNKNOWN, "sm_clock_max_mhz": UNKNOWN}
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return dict(out, reason="no nvidia-smi on PATH")
    try:
        query = subprocess.run(
            [smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=False,
        )  # fmt: skip
        banner = subprocess.run([smi], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return dict(out, reason=f"nvidia-smi failed: {e}")
    if query.returncode != 0 or not query.stdout.strip():
        return dict(out, reason=f"nvidia-smi exited {query.returncode}: {query.stderr.strip()[:200]}")
    values = [v.strip() for v in query.stdout.splitlines()[0].split(",")]
    if len(values) == len(fields):
        out.update(name=values[0], driver=values[1], sm_clock_mhz=values[2], sm_clock_max_mhz=values[3])
    for line in banner.stdout.splitlines():
        if "CUDA Version:" in line:
            out["cuda"] = line.split("CUDA Version:")[1].split()[0]
    return out


def nv_err_no_memory() -> int | str:
    """NV_ERR_NO_MEMORY lines in the kernel log, or "unreadable" (why) when dmesg is refused."""
    dmesg = shutil.which("dmesg")
    if dmesg is None:
        return "unreadable: no dmesg"
    try:
        proc = subprocess.run([dmesg], capture_output=True, text=True, timeout=20, check=False, errors="replace")
    except (OSError, subprocess.SubprocessError) as e:
        return f"unreadable: {e}"
    if proc.returncode != 0:
        return f"unreadable: dmesg exited {proc.returncode} ({proc.stderr.strip()[:120]})"
    return sum("NV_ERR_NO_MEMORY" in line for line in proc.stdout.splitlines())


def _sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def launch_state(server_log: str | None) -> dict:
    """vLLM version, the patch series and its patches' states and hashes from the launch manifest."""
    if not server_log:
        return {"manifest": None, "reason": "no --server-log given"}
    try:
        record = manifest.load(server_log)
    except manifest.ManifestError as e:
        return {"manifest": manifest.path_for(server_log), "reason": str(e)}
    if record is None:
        return {"manifest": None, "reason": f"no {manifest.path_for(server_log)} (a server serve.sh did not start)"}
    status = record.get("patches") or {}
    series = status.get("series")
    patches = []
    for p in status.get("patches") or []:
        path = os.path.join(series, p["name"]) if series else None
        patches.append({"name": p["name"], "state": p["state"], "sha256": _sha256(path) if path else None})
    overrides = record.get("overrides") or {}
    ple = overrides.get("PLE") or _ple_from_config(record.get("config"))
    return {
        "manifest": manifest.path_for(server_log),
        "vllm": (record.get("versions") or {}).get("vllm"),
        "magpie": (record.get("versions") or {}).get("magpie"),
        "series": series,
        "patches": patches,
        "model": record.get("model"),
        "ple": ple,
    }


def _ple_from_config(config) -> str | None:
    """ "1" when the resolved profile turns the table-on-disk switch on (PLE=1 set by the profile,
    not by a variable), in any release's spelling (magpie.serving.launch.PLE_SPELLINGS)."""
    if not isinstance(config, dict):
        return None
    from magpie.serving.launch import PLE_SPELLINGS

    for option, values, _patched in PLE_SPELLINGS.values():
        setting = config.get(option)
        if isinstance(setting, str):
            try:
                setting = json.loads(setting)
            except ValueError:
                continue
        if isinstance(setting, dict) and all(setting.get(k) == v for k, v in values.items()):
            return "1"
    return None


def ple_resident(model: str | None) -> dict | None:
    """The PLE table's resident fraction now (mincore), or why it is not measured."""
    if not model:
        return None
    from magpie.serving import ple_warmup

    try:
        ranges = ple_warmup.table_ranges(model, ple_warmup.DEFAULT_PATTERN)
        return ple_warmup.status(ranges)
    except (SystemExit, OSError, ValueError) as e:
        return {"error": str(e)}


class Machine:
    """The state before a run (`Machine(server_log)`), completed by `finish()` after it; use
    `watch()` around the run for MemAvailable's low-water mark."""

    def __init__(self, server_log: str | None, vllm_version: str | None) -> None:
        self.launch = launch_state(server_log)
        self.launch.setdefault("vllm", None)
        self.launch["vllm_server"] = vllm_version
        self.ple_model = self.launch.get("model") if self.launch.get("ple") == "1" else None
        self.ple_before = ple_resident(self.ple_model)
        self.oom_before = nv_err_no_memory()
        self.gpu = gpu_state()
        self.mem = MemWatch()

    def watch(self) -> MemWatch:
        return self.mem

    def record(self) -> dict:
        after = ple_resident(self.ple_model)
        return {
            "launch": self.launch,
            "gpu": self.gpu,
            "ple_table": None
            if self.ple_model is None
            else {"model": self.ple_model, "before": self.ple_before, "after": after},
            **self.mem.record(),
            "nv_err_no_memory": {"before": self.oom_before, "after": nv_err_no_memory()},
        }
