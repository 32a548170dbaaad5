"""Pruned vs unpruned MTP on real vLLM servers (CPU, 127.0.0.1), the tiny "increment" model.

One module-scoped run, three servers one after another, all on the overlay with mtp_pruning
applied:
1. unpruned (patch inactive): the measured prompts, then longer generations saved as a results
   folder, from which magpie/mtp_pruning/fit_keepset.py fits a keep-set covering them;
2. pruned with that covering keep-set;
3. pruned with the covering keep-set minus every second id the target emits (not every third:
   with 2 draft tokens every third token is the target's bonus token, never drafted).
The target's greedy text must be the same in all three; acceptance comes from /metrics.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from magpie.demo.demo_overlay import vllm_env
from magpie.serving.metrics import SPEC_ACCEPTED, SPEC_DRAFT_TOKENS, SPEC_DRAFTS, MetricsSnapshot
from magpie.serving.process import VllmServer
from tests.conftest import EAGER
from tests.mtp_pruning.pruning_helpers import run_script

pytestmark = pytest.mark.slow

PROMPTS = ["The cat sees the red house", "Our team builds a list", "def return import class", "A student reads"]
MAX_TOKENS = 40
FIT_MAX_TOKENS = 56  # longer than measured: the keep-set also covers the drafts past the last token
NUM_SPECULATIVE_TOKENS = 2


def generate(server: VllmServer, max_tokens: int) -> list[dict]:
    def one(prompt: str) -> dict:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        choice = server.post("/v1/completions", body)["choices"][0]
        return {"ok": True, "prompt": prompt, "text": choice["text"], "token_ids": choice["token_ids"]}

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # decoded together: the draft runs at batch 4
        return list(pool.map(one, PROMPTS))


def spec_counters(server: VllmServer) -> dict[str, float]:
    page = MetricsSnapshot.fetch(server.url)
    names = {"drafts": SPEC_DRAFTS, "draft_tokens": SPEC_DRAFT_TOKENS, "accepted": SPEC_ACCEPTED}
    return {key: page.sum(name) or 0.0 for key, name in names.items()}


def serve(model: Path, overlay: Path, log: Path, keep: Path | None = None) -> VllmServer:
    spec = {"method": "mtp", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
    if keep is not None:
        spec["draft_vocab_path"] = str(keep)
    # Eager: the greedy texts, acceptance and log lines compared here do not depend on
    # torch.compile (the pruned head's logits are computed outside the compiled forward).
    args = ["--speculative-config", json.dumps(spec), "--no-enable-prefix-caching", *EAGER]
    return VllmServer(model, args, env=vllm_env(overlay), log_path=log).start(timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_mtp_model, pruning_overlay):
    folder = tmp_path_factory.mktemp("pruned-server")
    runs: dict[str, dict] = {}

    server = serve(tiny_mtp_model, pruning_overlay, folder / "unpruned.log")
    try:
        runs["unpruned"] = {"outputs": generate(server, MAX_TOKENS), "metrics": spec_counters(server)}
        fit_outputs = generate(server, FIT_MAX_TOKENS)
    finally:
        server.stop()
    runs["unpruned"]["log"] = (folder / "unpruned.log").read_text()

    results = folder / "results"
    results.mkdir()
    (results / "unpruned-generations.json").write_text(json.dumps({"records": fit_outputs}))
    covering = folder / "covering.npy"
    status, out, err = run_script(
        "fit_keepset", results, "--model", tiny_mtp_model, "-o", covering, "--coverage", "1.0", "--quiet"
    )
    assert status == 0, out + err
    emitted = sorted({t for o in runs["unpruned"]["outputs"] for t in o["token_ids"]})
    excluded = set(emitted[1::2])
    excluding = folder / "excluding.npy"
    np.save(excluding, np.array([i for i in np.load(covering) if i not in excluded], dtype=np.int64))

    for name, keep in (("covering", covering), ("excluding", excluding)):
        server = serve(tiny_mtp_model, pruning_overlay, folder / f"{name}.log", keep)
        try:
            runs[name] = {"outputs": generate(server, MAX_TOKENS), "metrics": spec_counters(server)}
        finally:
            server.stop()
        runs[name].update(log=(folder / f"{name}.log").read_text(), keep=keep, keep_set=np.load(keep))
    runs["emitted"], runs["excluded"] = emitted, excluded
    return runs


def acceptance(run: dict) -> float:
    metrics = run["metrics"]
    assert metrics["draft_tokens"] > 0
    return metrics["accepted"] / metrics["draft_tokens"]


def test_unpruned_text_is_the_increment_models_plain_greedy_continuation(runs, tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    for output in runs["unpruned"]["outputs"]:
        last = tokenizer(output["prompt"], add_special_tokens=False)["input_ids"][-1]
        assert output["token_ids"] == [last + i for i in range(1, MAX_TOKENS + 1)]
    assert acceptance(runs["unpruned"]) > 0.9


@pytest.mark.parametrize("name", ["covering", "excluding"])
def test_pruned_greedy_text_is_identical_to_unpruned(runs, name):
    for pruned, unpruned in zip(runs[name]["outputs"], runs["unpruned"]["outputs"], strict=True):
        assert pruned["token_ids"] == unpruned["token_ids"]
        assert pruned["text"] == unpruned["text"]


def test_covering_keep_set_keeps_acceptance(runs):
    assert set(runs["emitted"]) <= set(runs["covering"]["keep_set"].tolist())
    assert len(runs["covering"]["keep_set"]) < 4096 // 10
    assert acceptance(runs["covering"]) >= acceptance(runs["unpruned"]) - 0.02


def test_keep_set_excluding_emitted_ids_lowers_acceptance(runs):
    assert not runs["excluded"] & set(runs["excluding"]["keep_set"].tolist())
    assert acceptance(runs["excluding"]) < acceptance(runs["covering"]) - 0.15


@pytest.mark.parametrize("name", ["covering", "excluding"])
def test_pruned_server_logs_both_activation_lines(runs, name):
    run = runs[name]
    k = len(run["keep_set"])
    share = f"{100 * k / 4096:.2f}%"
    assert f"MTP draft vocab pruned: {k} of 4096 ids ({share}), keep-set {run['keep']}" in run["log"]
    assert f"MTP draft vocab pruned head in use: Qwen3_5MTP.lm_head has {k} rows, not the target's 4096" in run["log"]


def test_unpruned_server_takes_the_stock_lm_head_sharing(runs):
    log = runs["unpruned"]["log"]
    assert "MTP draft vocab pruned" not in log
    assert "Detected MTP model. Sharing target model lm_head weights with the draft model." in log
