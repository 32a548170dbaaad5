"""The keep-set tools of magpie/mtp_pruning/ on inputs whose counts are computed here independently."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.mtp_pruning.pruning_helpers import run_script

VOCAB = 4096


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def expected_counts(tokenizer, texts=(), token_ids=()) -> np.ndarray:
    counts = np.zeros(VOCAB, dtype=np.int64)
    for text in texts:
        for token in tokenizer.encode(text, add_special_tokens=False):
            counts[token] += 1
    for ids in token_ids:
        for token in ids:
            counts[token] += 1
    return counts


def write_jsonl(path, items) -> None:
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items))


# Each input format: the lines written, and the generated texts that must be counted from them.
FORMATS = {
    "openai": (
        [
            {
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Sort the list."},
                    {"role": "assistant", "content": "The engineer sorts the list."},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "text", "text": "Our team reads an old book."},
                            {"type": "image_url", "image_url": {"url": "file:///x.png"}},
                        ],
                        "tool_calls": [
                            {"type": "function", "function": {"name": "open_file", "arguments": '{"path": "a.py"}'}}
                        ],
                    },
                ]
            }
        ],
        ["The engineer sorts the list.", "Our team reads an old book.", "open_file", '{"path": "a.py"}'],
    ),
    "sharegpt": (
        [{"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "A dog finds a list."}]}],
        ["A dog finds a list."],
    ),
    "text_keys": (
        [{"text": "The cat sees the red house."}, {"response": "def return import"}, {"content": "one two three"}],
        ["The cat sees the red house.", "def return import", "one two three"],
    ),
    "json_string_and_raw": (
        ['"The final number is 42."', "plain raw text, not JSON", ""],
        ["The final number is 42.", "plain raw text, not JSON"],
    ),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_count_tokens_counts_generated_text_of_each_format(tmp_path, tiny_mtp_model, tokenizer, name):
    lines, texts = FORMATS[name]
    write_jsonl(tmp_path / "in.jsonl", lines)
    status, out, err = run_script(
        "count_tokens", tmp_path / "in.jsonl", "--model", tiny_mtp_model, "-o", tmp_path / "c.npy", "--quiet"
    )
    assert status == 0, err
    want = expected_counts(tokenizer, texts)
    got = np.load(tmp_path / "c.npy")
    assert got.shape == (VOCAB,) and got.dtype == np.int64
    assert np.array_equal(got, want)
    assert f"counted {len(texts)} texts, {want.sum()} tokens, {(want > 0).sum()} distinct ids" in out


def test_count_tokens_reads_this_projects_result_files(tmp_path, tiny_mtp_model, tokenizer):
    bench = {
        "schema": "flash-next/bench-decode/1",
        "summary": {},
        "records": [
            {"ok": True, "token_ids": [5, 6, 7, 7], "text": "ignored: the ids are counted"},
            {"ok": False, "token_ids": [9, 9], "text": "failed request"},
            {"ok": True, "token_ids": [], "text": "The server returns a value."},
        ],
    }
    gsm8k = {"schema": "flash-next/gsm8k/1", "records": [{"ok": True, "reply": "She has 7 apples. #### 7"}]}
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "bench.json").write_text(json.dumps(bench))
    (tmp_path / "results" / "gsm8k.json").write_text(json.dumps(gsm8k))
    # run_suite.sh leaves a one-screen summary beside the records: not generated text.
    (tmp_path / "results" / "summary.txt").write_text("c=1 decode 33.1 tok/s, acceptance 3.09\n")
    status, out, err = run_script(
        "count_tokens", tmp_path / "results", "--model", tiny_mtp_model, "-o", tmp_path / "c.npy",
        "--summary", tmp_path / "s.json", "--quiet",
    )  # fmt: skip
    assert status == 0, err
    want = expected_counts(
        tokenizer, ["The server returns a value.", "She has 7 apples. #### 7"], token_ids=[[5, 6, 7, 7]]
    )
    assert np.array_equal(np.load(tmp_path / "c.npy"), want)
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["schema"] == "magpie/count-tokens/1"
    assert (summary["texts"], summary["tokens"], summary["distinct_ids"]) == (3, int(want.sum()), int((want > 0).sum()))
    assert summary["vocab_size"] == VOCAB
    assert {entry["path"].rsplit("/", 1)[-1]: entry["texts"] for entry in summary["inputs"]} == {
        "bench.json": 2,
        "gsm8k.json": 1,
    }


def test_count_tokens_sizes_counts_by_the_models_head_not_the_tokenizer(tmp_path, tiny_mtp_model):
    write_jsonl(tmp_path / "in.jsonl", [{"text": "one two"}])
    status, _, err = run_script(
        "count_tokens", tmp_path / "in.jsonl", "--tokenizer", tiny_mtp_model, "--vocab-size", "248320",
        "-o", tmp_path / "c.npy", "--quiet",
    )  # fmt: skip
    assert status == 0, err
    assert np.load(tmp_path / "c.npy").shape == (248320,)


def test_count_tokens_add_to_accumulates(tmp_path, tiny_mtp_model, tokenizer):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "The cat sees"}])
    write_jsonl(tmp_path / "b.jsonl", [{"text": "a dog builds"}])
    args = ["--model", tiny_mtp_model, "--quiet"]
    assert run_script("count_tokens", tmp_path / "a.jsonl", "-o", tmp_path / "c.npy", *args)[0] == 0
    status, out, err = run_script(
        "count_tokens", tmp_path / "b.jsonl", "--add-to", tmp_path / "c.npy", "-o", tmp_path / "c.npy", *args
    )
    assert status == 0, err
    assert np.array_equal(np.load(tmp_path / "c.npy"), expected_counts(tokenizer, ["The cat sees", "a dog builds"]))


def test_count_tokens_fails_clearly_on_zero_tokens(tmp_path, tiny_mtp_model):
    write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "only a prompt"}]}])
    status, _, err = run_script(
        "count_tokens", tmp_path / "in.jsonl", "--model", tiny_mtp_model, "-o", tmp_path / "c.npy", "--quiet"
    )
    assert status == 1
    assert "no tokens counted" in err
    assert not (tmp_path / "c.npy").exists()


@pytest.fixture
def counts_file(tmp_path):
    counts = np.zeros(VOCAB, dtype=np.int64)
    counts[[10, 11, 12, 13]] = [50, 30, 15, 5]  # total 100
    np.save(tmp_path / "counts.npy", counts)
    return tmp_path / "counts.npy"


@pytest.mark.parametrize(("coverage", "top_k"), [(0.5, 1), (0.8, 2), (0.95, 3), (0.96, 4), (1.0, 4)])
def test_build_keepset_takes_the_smallest_top_k_reaching_coverage(tmp_path, counts_file, coverage, top_k):
    out = tmp_path / "keep.npy"
    status, stdout, err = run_script(
        "build_keepset", counts_file, "-o", out, "--coverage", coverage, "--no-special-ids", "--summary", tmp_path / "s"
    )
    assert status == 0, err
    keep = np.load(out)
    assert keep.tolist() == [10, 11, 12, 13][:top_k]
    figures = json.loads((tmp_path / "s").read_text())
    reached = [0.5, 0.8, 0.95, 1.0][top_k - 1]
    assert figures["top_k"] == top_k and figures["coverage"] == pytest.approx(reached)
    assert figures["coverage"] >= coverage and (top_k == 1 or [0.5, 0.8, 0.95, 1.0][top_k - 2] < coverage)
    assert f"K = {top_k} of {VOCAB} ids" in stdout


def test_build_keepset_adds_special_extra_and_union_ids_sorted(tmp_path, counts_file, tiny_mtp_model, draft_vocab):
    np.save(tmp_path / "other.npy", np.array([3000, 4000], dtype=np.int64))
    out = tmp_path / "keep.pt"
    status, stdout, err = run_script(
        "build_keepset", counts_file, "-o", out, "--coverage", "0.8", "--model", tiny_mtp_model,
        "--extra-ids", "100-102,7", "--union", tmp_path / "other.npy",
    )  # fmt: skip
    assert status == 0, err
    keep = torch.load(out, weights_only=True)
    assert keep.dtype == torch.int64
    # The tokenizer's special tokens are ids 0-2 (<|endoftext|>, <|im_start|>, <|im_end|>).
    assert keep.tolist() == [0, 1, 2, 7, 10, 11, 100, 101, 102, 3000, 4000]
    assert draft_vocab.load_keep_ids(str(out), VOCAB).tolist() == keep.tolist()  # vLLM accepts it
    assert "+ 3 special, 4 extra, 2 union ids" in stdout


def test_build_keepset_refuses_a_keep_set_of_every_id(tmp_path, counts_file):
    out = tmp_path / "keep.npy"
    status, _, err = run_script(
        "build_keepset", counts_file, "-o", out, "--no-special-ids", "--extra-ids", f"0-{VOCAB - 1}"
    )
    assert status == 1
    assert f"the keep-set would hold all {VOCAB} ids, which prunes nothing" in err and "lower --coverage" in err
    assert not out.exists()


def test_build_keepset_warns_when_holdout_coverage_drops(tmp_path, counts_file):
    holdout = np.zeros(VOCAB, dtype=np.int64)
    holdout[[10, 500]] = [60, 40]  # the keep-set misses id 500: 60 % held-out coverage
    np.save(tmp_path / "holdout.npy", holdout)
    status, stdout, err = run_script(
        "build_keepset", counts_file, "-o", tmp_path / "keep.npy", "--no-special-ids", "--coverage", "0.99",
        "--holdout", tmp_path / "holdout.npy",
    )  # fmt: skip
    assert status == 0
    assert "coverage of the held-out tokens (100): 60.00%" in stdout
    assert "transfer badly across workloads" in err


def test_fit_keepset_from_a_results_folder(tmp_path, tiny_mtp_model, tokenizer):
    results = tmp_path / "results"
    results.mkdir()
    records = [{"ok": True, "token_ids": [100 + i, 200 + i]} for i in range(20)]
    (results / "bench.json").write_text(json.dumps({"schema": "flash-next/bench-decode/1", "records": records}))
    out = tmp_path / "keep.npy"
    status, stdout, err = run_script("fit_keepset", results, "--model", tiny_mtp_model, "-o", out, "--quiet")
    assert status == 0, err
    keep = np.load(out).tolist()
    assert keep == [0, 1, 2] + list(range(100, 120)) + list(range(200, 220))
    summary = json.loads((tmp_path / "keep.npy.json").read_text())
    assert summary["tokens"] == 40 and summary["keepset"]["coverage"] == 1.0
    # Every 10th text was set aside for the self-check: its ids were never seen in fitting.
    assert summary["self_check"]["held_out_texts"] == 2 and summary["self_check"]["held_out_coverage"] == 0.0
    assert "too few tokens counted" in err
    assert np.load(tmp_path / "keep.counts.npy").sum() == 40


# --------------------------------------------------------------------------- the overwrite rule
def keep_set_tool_runs(tmp_path, tiny_mtp_model, counts_file):
    """tool -> (argv, the files it writes): each tool's real invocation on real inputs."""
    write_jsonl(tmp_path / "in.jsonl", [{"text": "The cat sees the red house."}])
    results = tmp_path / "results"
    results.mkdir()
    records = [{"ok": True, "token_ids": [100 + i, 200 + i]} for i in range(20)]
    (results / "bench.json").write_text(json.dumps({"schema": "flash-next/bench-decode/1", "records": records}))
    count_out, build_out, fit_out = tmp_path / "c.npy", tmp_path / "keep.npy", tmp_path / "fit.npy"
    return {
        "count_tokens": (
            [
                tmp_path / "in.jsonl",
                "--model",
                tiny_mtp_model,
                "-o",
                count_out,
                "--summary",
                tmp_path / "c.json",
                "--quiet",
            ],
            [count_out, tmp_path / "c.json"],
        ),
        "build_keepset": (
            [counts_file, "-o", build_out, "--no-special-ids", "--summary", tmp_path / "keep.json"],
            [build_out, tmp_path / "keep.json"],
        ),
        "fit_keepset": (
            [results, "--model", tiny_mtp_model, "-o", fit_out, "--quiet"],
            [fit_out, tmp_path / "fit.counts.npy", tmp_path / "fit.npy.json"],
        ),
    }


@pytest.mark.parametrize("tool", ["count_tokens", "build_keepset", "fit_keepset"])
def test_keep_set_tools_refuse_to_overwrite_each_output_without_force(tmp_path, tiny_mtp_model, counts_file, tool):
    argv, outputs = keep_set_tool_runs(tmp_path, tiny_mtp_model, counts_file)[tool]
    for existing in outputs:  # each output alone is enough to refuse the whole run
        existing.write_text("an earlier result")
        with pytest.raises(SystemExit) as refused:
            run_script(tool, *argv)
        assert str(refused.value).startswith(f"error: {existing} exists; pass --force to replace it")
        assert existing.read_text() == "an earlier result"
        assert [p for p in outputs if p.exists()] == [existing]  # nothing else was written
        existing.unlink()


@pytest.mark.parametrize("tool", ["count_tokens", "build_keepset", "fit_keepset"])
def test_keep_set_tools_replace_their_outputs_with_force(tmp_path, tiny_mtp_model, counts_file, tool):
    argv, outputs = keep_set_tool_runs(tmp_path, tiny_mtp_model, counts_file)[tool]
    for existing in outputs:
        existing.write_text("an earlier result")
    status, _, err = run_script(tool, *argv, "--force")
    assert status == 0, err
    for path in outputs:
        if path.suffix == ".npy":
            assert np.load(path).ndim == 1
        else:
            assert json.loads(path.read_text())["schema"].startswith("magpie/")
    assert not [p.name for p in tmp_path.iterdir() if ".tmp" in p.name]  # the atomic writes left nothing behind


def test_count_tokens_add_to_may_name_its_output_without_force(tmp_path, tiny_mtp_model):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "The cat sees"}])
    args = ["--model", tiny_mtp_model, "--quiet"]
    assert run_script("count_tokens", tmp_path / "a.jsonl", "-o", tmp_path / "c.npy", *args)[0] == 0
    with pytest.raises(SystemExit, match="c.npy exists; pass --force"):  # a new count over old counts: refused
        run_script("count_tokens", tmp_path / "a.jsonl", "-o", tmp_path / "c.npy", *args)
    other = tmp_path / "other.npy"
    np.save(other, np.zeros(VOCAB, dtype=np.int64))
    with pytest.raises(SystemExit, match="c.npy exists; pass --force"):  # --add-to another file: still refused
        run_script("count_tokens", tmp_path / "a.jsonl", "--add-to", other, "-o", tmp_path / "c.npy", *args)
    before = np.load(tmp_path / "c.npy").sum()
    status, _, err = run_script("count_tokens", tmp_path / "a.jsonl", "--add-to", tmp_path / "c.npy", "-o",
                                tmp_path / "c.npy", *args)  # fmt: skip
    assert status == 0, err
    assert np.load(tmp_path / "c.npy").sum() == 2 * before


def test_gpu_bench_times_the_module_the_patch_ships(pruning_overlay):
    """bench_draft_head.py loads the patch's module from the patch file: the same code the overlay has."""
    import importlib

    bench = importlib.import_module("magpie.mtp_pruning.bench_draft_head")
    module = bench.load_module_from_patch(bench.PATCH)
    shipped = pruning_overlay / "vllm" / "v1" / "spec_decode" / "draft_vocab.py"
    assert open(module.__file__).read() == shipped.read_text()
    vocab = module.DraftVocab("k", torch.tensor([1, 5, 9]), 16)
    vocab.place(torch.device("cpu"))
    weight = torch.randn(64, 8).to(torch.bfloat16)  # 3 rows padded to 64, as ParallelLMHead pads
    hidden = torch.randn(4, 8).to(torch.bfloat16)
    argmax = bench.make_step("pruned-argmax", weight, hidden, module, vocab, 3)()
    full_vocab = bench.make_step("pruned-full-vocab", weight, hidden, module, vocab, 3)()
    expected = torch.tensor([1, 5, 9])[torch.nn.functional.linear(hidden, weight[:3]).argmax(-1)]
    assert torch.equal(argmax, expected) and torch.equal(full_vocab, expected)
