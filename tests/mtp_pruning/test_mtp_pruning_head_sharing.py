"""A pruned MTP draft never shares the target's head, however equal their weights (CPU, a real vLLM
server on 127.0.0.1, the tiny "increment" model).

vLLM shares the target's lm_head with an EAGLE/MTP draft whose padded head weight is torch.equal
to the target's. A keep-set of V - 1 ids that drops an id whose row is zero in the checkpoint
gives exactly that: the K-row head pads to V rows and the padding row is zero, as the target's
row is. The patch decides sharing by the configuration (draft_vocab.keeps_own_lm_head), so the
server drafts with the pruned head; sharing it would kill the engine at the first request.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from magpie.demo.demo_overlay import vllm_env
from magpie.serving.process import VllmServer
from tests.conftest import EAGER
from tests.mtp_pruning.pruning_helpers import with_zero_tail_head_row

pytestmark = pytest.mark.slow

VOCAB = 4096


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_mtp_model, pruning_overlay):
    folder = tmp_path_factory.mktemp("zero-tail")
    model = with_zero_tail_head_row(tiny_mtp_model, folder / "model")
    keep = folder / "keep.npy"
    np.save(keep, np.arange(VOCAB - 1, dtype=np.int64))
    spec = {"method": "mtp", "num_speculative_tokens": 2, "draft_vocab_path": str(keep)}
    log = folder / "server.log"
    server = VllmServer(
        model,
        # Eager: sharing is decided when the draft loads, before any compile.
        ["--speculative-config", json.dumps(spec), "--no-enable-prefix-caching", *EAGER],
        env=vllm_env(pruning_overlay),
        log_path=log,
    ).start(timeout=600)
    try:
        body = {
            "model": "tiny",
            "prompt": "The cat sees the red house",
            "max_tokens": 16,
            "temperature": 0,
            "return_token_ids": True,
        }
        replies = [server.post("/v1/completions", body) for _ in range(2)]
        server.get("/health")  # raises once the engine is dead
    finally:
        server.stop()
    return {"model": model, "replies": replies, "log": log.read_text()}


def test_the_checkpoint_makes_the_padded_heads_equal(served):
    head = load_file(str(served["model"] / "model.safetensors"))["lm_head.weight"]
    assert not head[-1].any() and head[:-1].abs().sum(dim=1).min() > 0
    pruned = torch.zeros_like(head)  # K = V - 1 rows, padded to V with zeros, as vLLM pads it
    pruned[: VOCAB - 1] = head[: VOCAB - 1]
    assert torch.equal(pruned, head)


def test_a_pruned_head_equal_to_the_targets_is_kept_and_serves(served):
    ids = [reply["choices"][0]["token_ids"] for reply in served["replies"]]
    assert ids[0] == ids[1] and len(ids[0]) == 16
    assert ids[0] == list(range(ids[0][0], ids[0][0] + 16))  # the increment model's greedy text
    log = served["log"]
    assert "Keeping it; not sharing the target model lm_head." in log
    assert "Sharing target model lm_head weights with the draft model" not in log
    assert f"MTP draft vocab pruned head in use: Qwen3_5MTP.lm_head has {VOCAB - 1} rows" in log
    assert "lm_head was replaced after load" not in log
