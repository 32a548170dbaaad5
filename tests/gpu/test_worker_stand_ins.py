"""The GPU worker's CuTe DSL stand-in, checked against vLLM 0.34.0's own Qwen4Exp code on the CPU.

0.34's CUDA Qwen4Exp picks a fused CuTe DSL kernel for the hyper-connection's down projection +
SiLU on sm90+ and JIT-compiles it at warm-up, which imports `cutlass`; the GPU machine has no
CuTe DSL, so the worker keeps that layer on its own unfused path (docs/gpu-harness.md). Run here
with 0.34.0's sdist first on the path and the platform made to report sm90, so stock 0.34 does
pick the fused kernel: the stand-in must turn it off and drop the warm-up request, and only then.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.releases import sdist_tree

REPO = Path(__file__).resolve().parent.parent.parent


def child(mode: str, rendezvous: str) -> None:
    from vllm.platforms import current_platform

    from magpie.gpu import worker
    from tests.release_python.probe import pass_the_cpu_triton_gate

    current_platform.has_device_capability = lambda *args, **kwargs: True
    done = worker.unfused_hc_down_without_cutedsl() if mode == "stand-in" else []
    pass_the_cpu_triton_gate()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.models.qwen4_exp.common.hyperconnection import HyperConnectionConfig
    from vllm.models.qwen4_exp.nvidia import hyperconnection, model

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"file://{rendezvous}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
        layer = hyperconnection.GatedResidual(HyperConnectionConfig(hc_count=2, hidden_size=64, hc_lowrank=14))
    warmup = model.request_hc_down_silu_warmup
    print(json.dumps({"stand_ins": done, "fused": layer._use_hc_down_silu, "warmup_from": warmup.__module__}))


def _run(mode: str, tmp_path: Path) -> dict:
    sdist = sdist_tree("0.34.0")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": os.pathsep.join([str(REPO), str(sdist)])}
    proc = subprocess.run(
        [sys.executable, __file__, mode, str(tmp_path / f"rendezvous-{mode}")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_stock_034_picks_the_fused_kernel_and_the_stand_in_keeps_it_unfused(tmp_path):
    stock = _run("stock", tmp_path)
    assert stock == {
        "stand_ins": [],
        "fused": True,
        "warmup_from": "vllm.models.qwen4_exp.nvidia.ops.cute_dsl.hc_down_silu",
    }
    stood_in = _run("stand-in", tmp_path)
    assert stood_in["fused"] is False
    assert stood_in["warmup_from"] == "magpie.gpu.worker"
    assert stood_in["stand_ins"] == [
        "vllm.models.qwen4_exp.nvidia.hyperconnection.GatedResidual: unfused down+SiLU "
        "(no cutlass for the CuTe DSL kernel)"
    ]


def test_the_stand_in_does_nothing_on_a_release_without_the_module():
    from magpie.gpu import worker

    # The test venv's vLLM is 0.29.0: its CUDA Qwen4Exp has the layer but no fused CuTe DSL kernel.
    assert worker.unfused_hc_down_without_cutedsl() == []


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    child(sys.argv[1], sys.argv[2])
