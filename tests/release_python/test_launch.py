"""serve.sh's launch plan against each series release's own Python (tree.py): the V2 model runner
switch. Before 0.34.0 PLE=1 through the Engram storage mode asks for VLLM_USE_V2_MODEL_RUNNER=1
(the ple_ssd patch stages the table on V2 only); 0.34.0 removed the V1 runner and the variable
(=1 warns, any other value raises), so the plan never sets it and refuses a value vLLM would
raise on, before vLLM starts. The version is the one the plan reads from the tree on PYTHONPATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from magpie import releases
from magpie.demo.demo_overlay import vllm_env
from tests.release_python.tree import each_python_release
from tests.serving.helpers import tool


def plan(tmp_path: Path, overlay: Path, model: Path, ple: str, runner: str | None):
    log = tmp_path / f"server-{ple}-{runner}.log"
    env = vllm_env(overlay, MODEL=str(model), PLE=ple, JIT_CHECK="0", MTP="0")
    env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    if runner is not None:
        env["VLLM_USE_V2_MODEL_RUNNER"] = runner
    proc = subprocess.run(
        [*tool("launch"), "plan", "--log", str(log), "--port", "18114"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=180,
        check=False,
    )
    manifest = Path(str(log) + ".launch.json")
    return proc, (json.loads(manifest.read_text()) if proc.returncode == 0 else None)


@each_python_release
def test_the_plan_sets_the_v2_runner_switch_only_where_the_release_has_it(
    release, tmp_path, release_overlays, tiny_mtp_model
):
    proc, record = plan(tmp_path, release_overlays(release)["series"], tiny_mtp_model, "1", None)
    assert proc.returncode == 0, proc.stderr
    # The plan read the release from the tree on PYTHONPATH and picked that release's series.
    assert record["patches"]["series"].endswith(f"patches/vllm-{release}"), record["patches"]
    if releases.has_runner_switch(release):
        assert record["env"]["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    else:
        assert "VLLM_USE_V2_MODEL_RUNNER" not in record["env"]
        assert not any("VLLM_USE_V2_MODEL_RUNNER" in line for line in record["gb10"]["notes"])
        # 0.34's PLE=1 is upstream's Engram disk offload (no patch needed for it).
        command = record["command"]
        assert json.loads(command[command.index("--engram-config") + 1]) == {"disk_offload": True}


@each_python_release
def test_a_v1_runner_value_is_refused_before_vllm_starts(release, tmp_path, release_overlays, tiny_mtp_model):
    proc, _ = plan(tmp_path, release_overlays(release)["series"], tiny_mtp_model, "1", "0")
    assert proc.returncode != 0
    if releases.has_runner_switch(release):  # the ple_ssd patch stages the table on V2 only
        assert "set VLLM_USE_V2_MODEL_RUNNER=1" in proc.stderr, proc.stderr
    else:
        assert f"vLLM {release} removed the V1 model runner" in proc.stderr, proc.stderr
        assert "unset VLLM_USE_V2_MODEL_RUNNER" in proc.stderr


def test_a_users_1_on_0_34_is_named_as_not_needed(tmp_path, release_overlays, tiny_mtp_model):
    proc, record = plan(tmp_path, release_overlays("0.34.0")["series"], tiny_mtp_model, "0", "1")
    assert proc.returncode == 0, proc.stderr
    assert "VLLM_USE_V2_MODEL_RUNNER" not in record["env"]
    assert any("has only the V2 model runner" in line for line in record["gb10"]["notes"]), record["gb10"]["notes"]
    # ... and `exec` takes it out of the server's environment, not only out of the plan.
    assert record["unset"] == ["VLLM_USE_V2_MODEL_RUNNER"]
    manifest = tmp_path / "server-0-1.log.launch.json"
    launch = json.loads(manifest.read_text())
    launch["argv"] = [sys.executable, "-c", "import os; print(os.environ.get('VLLM_USE_V2_MODEL_RUNNER', 'unset'))"]
    manifest.write_text(json.dumps(launch))
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "1"}
    proc = subprocess.run(
        [*tool("launch"), "exec", str(manifest)], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "unset"
