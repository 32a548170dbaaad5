"""serve.sh's launch plan against vLLM 0.33.0 (the sdist's Python first on PYTHONPATH): PLE=1 is
the ple_ssd patch's Engram storage mode there, not 0.29's hf-overrides switch that 0.33 ignores."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from magpie.demo.demo_overlay import vllm_env
from magpie.serving import launch
from tests.serving.helpers import tool

MMAP = '{"offload_storage": "mmap"}'


def _plan(tmp_path: Path, overlay: Path, model: Path, ple: str):
    log = tmp_path / f"server-{ple}.log"
    env = vllm_env(overlay, MODEL=str(model), PLE=ple, JIT_CHECK="0", MTP="0")
    proc = subprocess.run(
        [*tool("launch"), "plan", "--log", str(log), "--port", "18113"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=180,
        check=False,
    )
    manifest = Path(str(log) + ".launch.json")
    return proc, (json.loads(manifest.read_text()) if proc.returncode == 0 else None)


def test_the_0_29_spelling_is_kept_for_0_29_and_moved_for_later_releases():
    config = {"hf-overrides": {"ple_mmap": True, "other": 1}, "max-num-seqs": 4}
    assert launch.ple_for_release(config, "0.29.0") == config
    moved = launch.ple_for_release(config, "0.33.0")
    assert moved == {"hf-overrides": {"other": 1}, "max-num-seqs": 4, "engram-config": {"offload_storage": "mmap"}}
    assert launch.ple_for_release({"hf-overrides": {"ple_mmap": True}}, "0.30.0") == {
        "engram-config": {"offload_storage": "mmap"}
    }
    assert config["hf-overrides"]["ple_mmap"] is True  # the profile's dict is not changed in place


def test_ple_on_stock_0_33_is_refused_naming_the_engram_switch(tmp_path, overlays_033, tiny_mtp_model):
    proc, _ = _plan(tmp_path, overlays_033["stock"], tiny_mtp_model, "1")
    assert proc.returncode != 0
    assert f"--engram-config '{MMAP}'" in proc.stderr and "ple_ssd" in proc.stderr, proc.stderr


@pytest.mark.parametrize("ple", ["1", "0"])
def test_ple_on_the_patched_0_33_runs_the_engram_storage_mode(tmp_path, overlays_033, tiny_mtp_model, ple):
    proc, plan = _plan(tmp_path, overlays_033["series"], tiny_mtp_model, ple)
    assert proc.returncode == 0, proc.stderr
    command = plan["command"]
    assert "ple_mmap" not in " ".join(command)
    if ple == "1":
        assert command[command.index("--engram-config") + 1] == MMAP.replace(" ", "") or json.loads(
            command[command.index("--engram-config") + 1]
        ) == json.loads(MMAP)
    else:
        assert "--engram-config" not in command
