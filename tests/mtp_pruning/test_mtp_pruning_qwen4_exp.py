"""The Qwen4ExpMTP hook (Flash-Next's draft): a tiny Qwen4Exp text config, the draft built by vLLM
on the CPU with a keep-set, its head fed the checkpoint's head (or, tied, the embedding)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from magpie.demo.demo_overlay import vllm_env
from tests.mtp_pruning.pruning_helpers import qwen4_exp_dir

pytestmark = pytest.mark.slow

PROBE = Path(__file__).resolve().parent / "qwen4_exp_mtp_probe.py"
VOCAB = 4096


@pytest.fixture(scope="module")
def probes(tmp_path_factory, tokenizer_dir, pruning_overlay):
    folder = tmp_path_factory.mktemp("qwen4-exp-mtp")
    keep = np.arange(3, VOCAB, 5, dtype=np.int64)  # K = 819
    np.save(folder / "keep.npy", keep)
    untied, untied_tensors = qwen4_exp_dir(folder / "untied", Path(tokenizer_dir), tied=False)
    tied, tied_tensors = qwen4_exp_dir(folder / "tied", Path(tokenizer_dir), tied=True)
    cmd = [sys.executable, str(PROBE), str(folder / "keep.npy")]
    cmd += [str(untied), str(folder / "untied.pt"), str(tied), str(folder / "tied.pt")]
    proc = subprocess.run(cmd, env=vllm_env(pruning_overlay), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {
        "keep": torch.from_numpy(keep),
        "untied": torch.load(folder / "untied.pt", weights_only=False),
        "tied": torch.load(folder / "tied.pt", weights_only=False),
        "head": untied_tensors["lm_head.weight"].float(),
        "tied_embed": tied_tensors["model.embed_tokens.weight"].float(),
        "log": proc.stdout + proc.stderr,
    }


@pytest.mark.parametrize(("name", "source"), [("untied", "head"), ("tied", "tied_embed")])
def test_qwen4_exp_mtp_pruned_head_is_the_kept_checkpoint_rows(probes, name, source):
    result, keep = probes[name], probes["keep"]
    assert result["architecture"] == "Qwen4ExpMTP" and result["has_own_lm_head"] is True
    assert torch.equal(result["rows"], probes[source][keep])


@pytest.mark.parametrize(("name", "source"), [("untied", "head"), ("tied", "tied_embed")])
def test_qwen4_exp_mtp_proposes_only_kept_ids_from_the_kept_rows(probes, name, source):
    result, keep = probes[name], probes["keep"]
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[keep] = False
    assert torch.isneginf(result["logits"][:, outside]).all()
    expected = result["hidden"].float() @ probes[source][keep].T
    torch.testing.assert_close(result["logits"][:, keep], expected, atol=0.25, rtol=0.02)
    assert torch.equal(result["top"], result["logits"].argmax(-1))
    assert set(result["top"].tolist()) <= set(keep.tolist())


def test_qwen4_exp_mtp_logs_activation(probes):
    assert f"MTP draft vocab pruned: {len(probes['keep'])} of {VOCAB} ids (20.00%)" in probes["log"]
    assert "MTP draft vocab pruned head in use: Qwen4ExpMTP.lm_head has 819 rows" in probes["log"]
