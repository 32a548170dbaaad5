"""The keep-set size sweep: `magpie sweep --keepset-sizes ... --corpus FILE` against real servers.

One test launches the real patched vLLM (CPU build, the tiny Qwen3.5 + MTP "increment" model)
through serve.sh once per keep-set: two small sizes, one repeat, one short run each, eager
(--enforce-eager: no torch.compile, the bulk of a CPU server's start under load). The others
need no server: the refusals come before any server starts, and fit-keepset's .json output is
read back by the mtp_pruning patch's own reader.
"""

from __future__ import annotations

import csv
import json
import re

import pytest

from magpie.measure import bench_decode, report
from magpie.serving import preflight
from tests.serving.helpers import PYTHON, run_tool, vllm_env

SIZES = (256, 2048)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Generations as a bench result holds them (records with token_ids), in runs of consecutive
    ids as the increment model writes: the low ids counted most, 4,000 distinct ids in all, so a
    256-id keep-set covers clearly less of it than a 2,048-id one."""
    path = tmp_path_factory.mktemp("corpus") / "bench.json"
    records = [{"ok": True, "token_ids": list(range(100 + 100 * j))} for j in range(40)]
    path.write_text(json.dumps({"schema": "magpie/bench-decode/4", "records": records}))
    return path


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("text-corpus") / "generations.txt"
    path.write_text("\n\n".join(bench_decode.BUILTIN_PROMPTS))
    return path


def sweep(run_dir, *args, env=None):
    return run_tool("sweep", str(run_dir), *args, env=env, timeout=900)


@pytest.mark.slow
def test_keepset_size_sweep_starts_one_server_per_size_and_names_the_best(
    tmp_path, tiny_mtp_model, patched_vllm, corpus
):
    run_dir = tmp_path / "run"
    env = vllm_env(patched_vllm, VLLM_PYTHON=PYTHON, MAX_MODEL_LEN="2048", PLE="0")
    proc = sweep(
        run_dir, "--model", str(tiny_mtp_model), "--keepset-sizes", ",".join(map(str, SIZES)),
        "--corpus", str(corpus), "--input-lens", "64", "--concurrency", "1", "--repeats", "1",
        "--output-len", "12", "--prompts-per-point", "1", "--min-free", "1GiB",
        "--serve-arg=--no-enable-prefix-caching", "--serve-arg=--enforce-eager", env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "one server start each (vLLM loads the keep-set at start)" in proc.stderr
    for number, size in enumerate(SIZES, 1):
        assert f"keep{size}: server start {number} of 2 of the keep-set sweep ({size} ids" in proc.stderr
    result = json.loads((run_dir / "results.json").read_text())
    assert result["schema"] == "magpie/sweep/4" and result["status"] == "complete"
    # Each server really served its keep-set: the launch line carries the file, the patch logs the pruning.
    for size in SIZES:
        log = next((run_dir / "servers").glob(f"keep{size}-*.log")).read_text()
        assert str(run_dir / "keepsets" / f"keep{size}.npy") in log
        assert len(preflight.read_keep_ids(str(run_dir / "keepsets" / f"keep{size}.npy"), 4096)) == size
    section = result["keepset_sweep"]
    rows = {r["config"]: r for r in section["rows"]}
    assert [rows[f"keep{k}"]["keep_ids"] for k in SIZES] == list(SIZES)
    # The tokenizer's special ids first, then the most counted: ids 0 up, each counted 40 - id // 100 times.
    counts = [40 - i // 100 for i in range(4000)]
    for size in SIZES:
        ids = preflight.read_keep_ids(str(run_dir / "keepsets" / f"keep{size}.npy"), 4096).tolist()
        assert rows[f"keep{size}"]["corpus_coverage"] == pytest.approx(
            sum(counts[i] for i in ids if i < 4000) / sum(counts)
        )
    small, large = (rows[f"keep{k}"]["corpus_coverage"] for k in SIZES)
    assert 0 < small < large < 1
    for row in rows.values():
        assert row["acceptance_length"] >= 1 and len(row["per_position_acceptance"]) == 3
        assert row["decode_tok_s_median"] > 0 and row["repeats"] == 1
    (best,) = section["best"]
    assert best["config"] == max(rows.values(), key=lambda r: r["decode_tok_s_median"])["config"]
    assert best["versus_runner_up"].endswith("(one run: noise unknown)")
    assert re.search(
        rf"^best keep-set at in=64 c=1: {best['config']} \(\d+ ids\), .* tok/s median; vs keep", proc.stdout, re.M
    )
    table = list(csv.DictReader((run_dir / "keepsets.csv").open()))
    assert [r["config"] for r in table] == [f"keep{k}" for k in SIZES]
    assert sum(r["best"] == "True" for r in table) == 1
    page = "".join(report.sweep_section(report.load_sweep(str(run_dir))))
    assert "Keep-set sizes (one server start per keep-set)" in page and "Best keep-set at input 64" in page


def test_a_size_not_below_the_vocabulary_is_refused_before_any_server(tmp_path, tiny_mtp_model, corpus):
    proc = sweep(tmp_path / "run", "--model", str(tiny_mtp_model), "--keepset-sizes", "1024,4096,65536",
                 "--corpus", str(corpus))  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: --keepset-sizes 4096,65536: not below the vocabulary of {tiny_mtp_model} (4096 ids); a keep-set "
        "holds fewer ids than the vocabulary (the full head is --config NAME:mtp=K)"
    ]
    assert not (tmp_path / "run").exists()


def test_a_keepset_file_in_an_unknown_format_is_refused_naming_the_formats(tmp_path, tiny_mtp_model):
    listed = tmp_path / "keep.txt"
    listed.write_text("1 2 3\n")
    proc = sweep(tmp_path / "run", "--model", str(tiny_mtp_model), "--keepsets", str(listed))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert ".npy" in proc.stderr and ".json" in proc.stderr and str(listed) in proc.stderr
    assert not (tmp_path / "run").exists()


def test_fit_keepset_writes_a_json_id_list_the_patch_reads(tmp_path, tiny_mtp_model, text_corpus):
    out = tmp_path / "keep.json"
    proc = run_tool("fit-keepset", str(text_corpus), "--model", str(tiny_mtp_model), "-o", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    ids = json.loads(out.read_text())
    assert ids == sorted(set(ids)) and 0 < len(ids) < 4096
    assert preflight.read_keep_ids(str(out), 4096).tolist() == ids
    bad = run_tool("fit-keepset", str(text_corpus), "--model", str(tiny_mtp_model), "-o", str(tmp_path / "keep.txt"))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        f"error: --output {tmp_path / 'keep.txt'}: use .npy, .pt or .json (a JSON list of ids)"
    ]
