"""The GPU harness's stand-in of flashinfer.norm (magpie/gpu/stand_in/flashinfer), on the CPU.

vLLM 0.34.0's CUDA Qwen3.5 / Qwen4Exp models call FlashInfer's Gemma RMSNorm for every norm; the
harness carries a torch stand-in instead (docs/gpu-harness.md). It must compute what vLLM's own
GemmaRMSNorm computes (checked against the installed vLLM's layer), be written only for the
releases that need it, and make every other FlashInfer submodule fail to import, as if absent.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from magpie.gpu import gpu_harness as harness


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    tree = tmp_path_factory.mktemp("site")
    assert harness.write_flashinfer_stand_in(tree, "0.34.0")
    sys.path.insert(0, str(tree))
    try:
        import flashinfer.norm as norm

        yield tree, norm
    finally:
        sys.path.remove(str(tree))
        for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def vllm_norm():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    with set_current_vllm_config(VllmConfig()):
        layer = GemmaRMSNorm(96, eps=1e-6)
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(-0.5, 0.5, 96))
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_equals_vllms_gemma_rmsnorm(stand_in, vllm_norm, dtype):
    _, norm = stand_in
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 96, generator=gen) * 3).to(dtype)
    r = torch.randn(6, 96, generator=gen).to(dtype)
    weight = vllm_norm.weight.data
    with torch.no_grad():
        want = vllm_norm.forward_native(x.clone())
        want_x, want_r = vllm_norm.forward_native(x.clone(), r.clone())
    tol = {"atol": 0, "rtol": 0} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(norm.gemma_rmsnorm(x, weight, 1e-6), want.to(dtype), **tol)
    out = torch.empty_like(x)
    assert norm.gemma_rmsnorm(x, weight, 1e-6, out=out) is out
    torch.testing.assert_close(out, want.to(dtype), **tol)
    got_x, got_r = x.clone(), r.clone()
    assert norm.gemma_fused_add_rmsnorm(got_x, got_r, weight, 1e-6) is None  # in place, as FlashInfer
    torch.testing.assert_close(got_r, want_r.to(dtype), **tol)
    torch.testing.assert_close(got_x, want_x.to(dtype), **tol)


def test_written_only_where_needed_and_nothing_else_imports(stand_in, tmp_path):
    assert not harness.write_flashinfer_stand_in(tmp_path / "old", "0.33.0")
    assert not (tmp_path / "old").exists()
    tree, _ = stand_in
    probe = (
        "import importlib, flashinfer.norm\n"
        "for name in ('flashinfer.comm', 'flashinfer.autotuner', 'flashinfer.gdn_prefill'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError:\n"
        "        continue\n"
        "    raise SystemExit(name + ' imported')\n"
        "print(flashinfer.__version__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "stand-in" in proc.stdout
