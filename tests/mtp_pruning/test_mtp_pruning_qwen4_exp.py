"""The Qwen4ExpMTP hook (Flash-Next's draft): a tiny Qwen4Exp text config, the draft built by vLLM
on the CPU with a keep-set, its head fed the checkpoint's head (or, tied, the embedding)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tiny_models import qwen4_exp_text_config
from vllm_overlay import vllm_env

pytestmark = pytest.mark.slow

PROBE = Path(__file__).resolve().parent / "qwen4_exp_mtp_probe.py"
VOCAB, HIDDEN = 4096, 64


def qwen4_exp_dir(folder: Path, tokenizer_dir: Path, tied: bool) -> tuple[Path, dict]:
    """config.json of a two-layer Qwen4Exp text model with one MTP layer, and its head tensors."""
    folder.mkdir(parents=True)
    config = qwen4_exp_text_config(
        vocab_size=VOCAB, hidden_size=HIDDEN, tie_word_embeddings=tied, mtp_num_hidden_layers=1
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    generator = torch.Generator().manual_seed(1 + tied)
    tensors = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=generator).to(torch.bfloat16)}
    if not tied:
        tensors["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=generator).to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder, tensors


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
