"""bench-pruned (magpie/mtp_pruning/bench_pruned.py) end to end: two real vLLM CPU
servers of the tiny "increment" model, one after the other, on the overlay with mtp_pruning
applied; the pruned one with the even ids as keep-set, so its drafts differ measurably.

The oracles are the model's own definition (greedy: next id = previous + 1, so every record's ids
follow from its prompt's last id), the records of the two servers compared here, and the draft
arithmetic of the even keep-set (after an odd id the draft is even and kept, the next one odd and
never kept: position 1 is never accepted).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from magpie.demo.demo_overlay import vllm_env
from magpie.mtp_pruning import bench_pruned
from tests.conftest import EAGER
from tests.serving.helpers import tool

pytestmark = pytest.mark.slow

K = 2  # draft tokens per step
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory, tiny_mtp_model, pruning_overlay):
    folder = tmp_path_factory.mktemp("bench-pruned")
    vocab = json.loads((tiny_mtp_model / "config.json").read_text())
    vocab = (vocab.get("text_config") or {}).get("vocab_size") or vocab["vocab_size"]
    keep = folder / "even.npy"
    np.save(keep, np.arange(0, vocab, 2, dtype=np.int64))
    output = folder / "bench.json"
    cmd = [*tool("bench-pruned"), "--model", str(tiny_mtp_model), "--keepset", str(keep)]
    cmd += ["--num-speculative-tokens", str(K), "-n", "3", "--max-tokens", str(MAX_TOKENS)]
    cmd += ["--server-arg=--no-enable-prefix-caching", "--server-arg=--max-model-len=512"]
    # Both servers eager: what is compared (texts, acceptance, logs, engine decode rates) does not
    # depend on torch.compile, and the compile warm-up was most of each start.
    cmd += [f"--server-arg={arg}" for arg in EAGER]
    cmd += ["--startup-timeout", "600", "--log-dir", str(folder / "logs"), "--output", str(output)]
    proc = subprocess.run(cmd, env=vllm_env(pruning_overlay), capture_output=True, text=True, timeout=1500, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    result = json.loads(output.read_text())
    return {"proc": proc, "cmd": cmd, "result": result, "output": output, "vocab": vocab, "keep": keep}


def test_both_servers_generate_the_increment_models_greedy_text(bench_run, tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    records = bench_run["result"]["records"]
    assert len(records["unpruned"]) == len(records["pruned"]) == 3
    for unpruned, pruned in zip(records["unpruned"], records["pruned"], strict=True):
        last = tokenizer(unpruned["prompt"], add_special_tokens=False)["input_ids"][-1]
        assert unpruned["token_ids"] == [last + i for i in range(1, MAX_TOKENS + 1)]
        assert pruned["token_ids"] == unpruned["token_ids"] and pruned["tokens"] == MAX_TOKENS
    assert bench_run["result"]["identical_outputs"] is True
    assert [r["prompt"] for r in records["pruned"]] == bench_pruned.PROMPTS[:3]


def test_acceptance_shows_the_keep_set(bench_run):
    summary = bench_run["result"]["summary"]
    unpruned, pruned = summary["unpruned"], summary["pruned"]
    # Unpruned, the draft is the target's next ids: (nearly) every draft token accepted, L = K + 1.
    assert unpruned["acceptance_rate"] > 0.9 and unpruned["acceptance_length"] > K + 0.8
    # Even ids kept: at most position 0 of each draft can be accepted, so at most half the tokens.
    counters = pruned["spec_counters"]
    assert counters["draft_tokens"] == K * counters["drafts"] > 0
    assert pruned["acceptance_rate"] <= 0.5 + 1e-9 and pruned["acceptance_length"] <= 2.0 + 1e-9
    assert pruned["acceptance_rate"] == pytest.approx(counters["accepted"] / counters["draft_tokens"])
    # The patch says it is active, with this keep-set, in the pruned server's log only.
    vocab, keep = bench_run["vocab"], bench_run["keep"]
    assert not unpruned["log_lines"]
    assert any(f"MTP draft vocab pruned: {(vocab + 1) // 2} of {vocab} ids" in line for line in pruned["log_lines"])
    assert all(str(keep) in line for line in pruned["log_lines"] if "vocab pruned:" in line)


def test_the_table_and_the_output_policy(bench_run):
    out = bench_run["proc"].stdout
    assert "unpruned" in out and "pruned" in out and "identical outputs: yes" in out
    # An existing --output is never replaced without --force (refused before any server starts).
    again = subprocess.run(bench_run["cmd"], capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 1 and f"error: {bench_run['output']} exists; pass --force" in again.stderr
    assert json.loads(bench_run["output"].read_text()) == bench_run["result"]


def test_decode_speed_comes_from_the_engines_request_times(bench_run):
    """Issue 21 item 6 for bench-pruned: decode tok/s is the engine's (generated tokens less one
    first token per request over vllm:request_decode_time_seconds), never a per-request window
    that a burst of chunks can collapse; the records carry no per-request rate."""
    result = bench_run["result"]
    assert result["schema"] == "magpie/bench-pruned-vs-unpruned/2"
    for run in result["summary"].values():
        rate = run["engine_decode_tok_per_s"]
        # The requests run one at a time, so their summed engine decode seconds cannot exceed the
        # measured wall time: the rate is at least their decode tokens over that wall time.
        assert rate is not None and rate > 0
        assert rate >= 3 * (MAX_TOKENS - 1) / run["wall_s"] * 0.99
    for records in result["records"].values():
        assert all("decode_tok_per_s" not in r for r in records)
    speedup = result["decode_speedup"]
    assert speedup == pytest.approx(
        result["summary"]["pruned"]["engine_decode_tok_per_s"]
        / result["summary"]["unpruned"]["engine_decode_tok_per_s"]
    )


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _group_members(pgid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rpartition(")")[2].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def test_sigterm_stops_the_server_bench_pruned_started(tmp_path, tiny_mtp_model, pruning_overlay):
    keep = tmp_path / "even.npy"
    vocab = json.loads((tiny_mtp_model / "config.json").read_text())
    vocab = (vocab.get("text_config") or {}).get("vocab_size") or vocab["vocab_size"]
    np.save(keep, np.arange(0, vocab, 2, dtype=np.int64))
    cmd = [*tool("bench-pruned"), "--model", str(tiny_mtp_model), "--keepset", str(keep), "-n", "1"]
    cmd += ["--server-arg=--max-model-len=512", "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.Popen(cmd, env=vllm_env(pruning_overlay), stderr=subprocess.PIPE, text=True)
    server = None
    try:
        deadline = time.monotonic() + 120
        while server is None and time.monotonic() < deadline and proc.poll() is None:
            server = next(iter(_children(proc.pid)), None)
            time.sleep(0.2)
        assert server is not None, "bench-pruned started no server"
        time.sleep(5)  # the server is starting up (its own session, its own process group)
        assert _group_members(server)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == -signal.SIGTERM
        assert "magpie bench-pruned: stopped by SIGTERM" in proc.stderr.read()
        assert _group_members(server) == []  # the old code left the whole server running
    finally:
        if proc.poll() is None:
            proc.kill()
        if server is not None and _group_members(server):
            os.killpg(server, signal.SIGKILL)
