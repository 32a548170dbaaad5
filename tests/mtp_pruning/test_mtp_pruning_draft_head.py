"""The pruned draft head as vLLM builds it: target and MTP draft loaded through vLLM's own loader
from the tiny checkpoint, the draft through the V2 runner's `load_eagle_model` (the path that
decides lm_head sharing there; the V1 proposer's path runs in the server tests), at tensor-parallel
width 1 and 2 (two CPU processes over gloo)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from magpie.demo.demo_overlay import vllm_env
from magpie.serving.process import free_port

PROBE = Path(__file__).resolve().parent / "draft_head_probe.py"
VOCAB = 4096


def tied_copy(model: Path, dest: Path) -> Path:
    """The tiny model with tied word embeddings: no lm_head.weight in the checkpoint."""
    shutil.copytree(model, dest)
    config = json.loads((dest / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(dest / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def run_probe(overlay: Path, scenarios: list[dict], tp: int, out: Path) -> dict:
    port = free_port()
    env = vllm_env(overlay, VLLM_DIST_IDENT=f"mtp_pruning-{uuid.uuid4().hex[:8]}")
    cmd = [sys.executable, str(PROBE), "--tp", str(tp), "--port", str(port), "--out", str(out)]
    for scenario in scenarios:
        cmd += ["--scenario", json.dumps(scenario)]
    logs = [out.with_suffix(f".rank{rank}.log") for rank in range(tp)]
    procs = [
        subprocess.Popen(cmd + ["--rank", str(rank)], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        for rank, log in enumerate(logs)
    ]
    try:
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * tp, "\n".join(log.read_text()[-3000:] for log in logs)
    return torch.load(out, weights_only=False), [log.read_text() for log in logs]


@pytest.fixture(scope="module")
def probes(tmp_path_factory, tiny_mtp_model, pruning_overlay):
    folder = tmp_path_factory.mktemp("draft-head")
    keep = np.arange(5, VOCAB, 3, dtype=np.int64)  # K = 1364: not a multiple of the 64-row padding
    np.save(folder / "keep.npy", keep)
    tied = tied_copy(tiny_mtp_model, folder / "tied-model")
    keep_path = str(folder / "keep.npy")
    tp1, tp1_logs = run_probe(
        pruning_overlay,
        [
            {"name": "pruned", "model": str(tiny_mtp_model), "keep": keep_path},
            {"name": "stock", "model": str(tiny_mtp_model)},
            {"name": "tied", "model": str(tied), "keep": keep_path},
        ],
        1,
        folder / "tp1.pt",
    )
    tp2, tp2_logs = run_probe(
        pruning_overlay, [{"name": "pruned", "model": str(tiny_mtp_model), "keep": keep_path}], 2, folder / "tp2.pt"
    )
    checkpoint = load_file(Path(tiny_mtp_model) / "model.safetensors")
    tied_checkpoint = load_file(tied / "model.safetensors")
    return {
        "keep": torch.from_numpy(keep),
        "keep_path": keep_path,
        "tp1": tp1,
        "tp2": tp2,
        "logs": tp1_logs + tp2_logs,
        "head": checkpoint["lm_head.weight"].float(),
        "tied_embed": tied_checkpoint["model.embed_tokens.weight"].float(),
    }


pytestmark = pytest.mark.slow


def test_pruned_head_rows_are_the_checkpoint_rows_of_the_keep_set(probes):
    pruned = probes["tp1"]["pruned"]
    assert pruned["head_rows"] == len(probes["keep"])
    assert torch.equal(pruned["rows"], probes["head"][probes["keep"]])


def test_v2_runner_keeps_the_pruned_head(probes):
    pruned = probes["tp1"]["pruned"]
    assert pruned["own_head"] and pruned["has_own_lm_head"] is True


def test_pruned_logits_equal_full_head_logits_on_keep_set_and_minus_inf_elsewhere(probes):
    keep = probes["keep"]
    pruned, stock = probes["tp1"]["pruned"], probes["tp1"]["stock"]
    assert torch.equal(pruned["hidden"], stock["hidden"])
    assert torch.equal(pruned["logits"][:, keep], stock["logits"][:, keep])
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[keep] = False
    assert torch.isneginf(pruned["logits"][:, outside]).all()


def test_pruned_top_tokens_are_target_ids_of_the_best_kept_row(probes):
    keep = probes["keep"]
    pruned, stock = probes["tp1"]["pruned"], probes["tp1"]["stock"]
    assert torch.equal(pruned["top"], keep[stock["logits"][:, keep].argmax(-1)])
    assert torch.equal(pruned["top"], pruned["logits"].argmax(-1))


def test_keep_ids_and_d2t_survive_sleep_level_2(probes):
    """vLLM restores only the draft's named buffers after level 2: both id maps must be among them."""
    after = probes["tp1"]["pruned"]["sleep_level_2"]
    assert torch.equal(after["to_target_ids"], probes["keep"])
    assert torch.equal(after["d2t_target_ids"], probes["keep"])


def test_inactive_patch_shares_the_target_head_like_stock(probes):
    stock = probes["tp1"]["stock"]
    assert not stock["own_head"] and stock["has_own_lm_head"] is None
    assert stock["head_rows"] == VOCAB
    assert torch.equal(stock["top"], stock["logits"].argmax(-1))


def test_tied_embeddings_slice_the_pruned_head_from_the_embedding(probes):
    tied = probes["tp1"]["tied"]
    assert tied["own_head"] and tied["head_rows"] == len(probes["keep"])
    assert torch.equal(tied["rows"], probes["tied_embed"][probes["keep"]])
    expected = tied["hidden"].float() @ probes["tied_embed"][probes["keep"]].T
    torch.testing.assert_close(tied["logits"][:, probes["keep"]], expected, atol=0.25, rtol=0.02)


def test_tensor_parallel_2_gives_the_same_head_logits_and_tokens_as_1(probes):
    one, two = probes["tp1"]["pruned"], probes["tp2"]["pruned"]
    assert torch.equal(one["rows"], two["rows"])
    assert torch.equal(one["logits"], two["logits"])
    assert torch.equal(one["top"], two["top"])


def test_both_log_lines_name_the_keep_set(probes):
    text = "\n".join(probes["logs"])
    k = len(probes["keep"])
    assert f"MTP draft vocab pruned: {k} of {VOCAB} ids (33.30%), keep-set {probes['keep_path']}" in text
    assert f"MTP draft vocab pruned head in use: Qwen3_5MTP.lm_head has {k} rows, not the target's {VOCAB}" in text
