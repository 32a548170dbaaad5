#!/usr/bin/env python3
# Over ~800 lines on purpose: one benchmark with two suites (server, full) over the same table,
# cache control, timers and report, which every published figure of docs/ple_ssd.md names by
# its keys; split across files, a reader of one figure would follow its key through several.
# The suites are classes (ServerRun, FullRun) whose methods each time one part.
"""Per-step cost of serving the Qwen4Exp n-gram (PLE) table from disk, in a serving vLLM's conditions.

H200: python3 magpie bench-staging --dir /var/tmp/ple-bench --table-gib 8 \\
    --before-patch measurements/ple_ssd/0001-ple-mmap-table.before-issue-14.patch --out $OUT/ple-staging-h200.json

Writes a table with the real row width (160 bf16 = 320 B) as 128 `shard_<i>` tensors in
safetensors files, opens them the way vLLM's default loader does (zero-copy mmaps), and times
staging one step's rows for decode steps (1 token; 4 = c=1 with MTP k=3; 16 = c=4, k=3; 32 =
c=8, k=3) and a prefill chunk (2048 tokens), 16 hashed heads per token. The code under test is
the module that patch 0001 adds to vLLM, read from the patch file itself (so the benchmark
needs only torch, numpy and safetensors), beside the same module as it was before the
server-conditions rework (one torch thread outside the gather, the pool only after a disk wait;
`--before-patch`: the checkout keeps that patch with the measurements it was timed for,
`measurements/ple_ssd/0001-ple-mmap-table.before-issue-14.patch`; the package does not ship
it), in one run:

`--suite server` (the default) times the conditions a serving vLLM worker runs in, warm (every
page of the table cached and mapped first):

- `stage/*`: `MmapNGramTable.stage()` from the step's inputs on the device, as
  `Qwen4ExpModelState.prepare_inputs` calls it (the new one with `query_start_loc` from the
  runner's host copy), old beside new, with ONE torch thread (`server`: vLLM calls
  `set_torch_threads_for_runtime()` after warm-up) and with torch's free thread count (`free`).
- `gather/*`: the row gather alone over N random rows, same two conditions: the old
  `torch.index_select` over the byte view (parallel only through torch's threads), the new
  numpy gather in the calling thread, and the new gather as shipped (the probe, then numpy up
  to `index_select_min_rows` rows and one `index_select` above; its thread pool only after a
  disk wait, or from `pool_min_rows` rows when set): where the switch points belong with one
  torch thread.
- `gpu/*` (CUDA only, one torch thread): staging with the GPU `idle`, `busy` (a matmul
  workload on another stream runs through the whole step, standing in for the previous
  step's kernels) and `after_previous_step` (the workload is enqueued on the same stream just
  before staging, so the copy of the step's ids waits for it, as in a server; the workload's
  own time alone is subtracted). Each record also holds the staging thread's CPU time
  (`cpu_ms`): a wait that spins costs CPU time, a blocking wait does not.
- `breakdown_us`: a decode step's `stage()` split into its parts; `cuda_graph`: a graph
  captured over the staged rows reads freshly staged rows on each replay; `stale_replay`: a
  replay with no stage before it is refused by the device-side check (in a child process).

`--suite full` runs the earlier, longer comparison (every method, warm / cached / cold, several
gather thread counts, the disk's own random-read rate) with the current module.

    python3 magpie bench-staging --dir /var/tmp/ple-bench --table-gib 8 \\
        --out results/ple_ssd_bench.json

JSON output: {"summary": {"KEY/PARTS": {"median_ms", "p90_ms", "n", ["cpu_median_ms"]}},
"matches_resident": {...: bool}, "breakdown_us": {...}, "cuda_graph": {...}, "stale_replay": {...},
"environment": {...}, "errors": [...], "skipped": [...], "records": [...every timed step, in ms...]}.
A CPU smoke run (no GPU, a small table): `--device cpu --table-gib 0.02 --warm-iters 5
--sweep-rows 256,4096 --tokens 1,4,2048`."""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib
import importlib.util
import json
import mmap
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from magpie import cli, files, patches

DEFAULT_PATCH = Path(patches.PATCHES_DIR).resolve() / "vllm-0.29.0" / "ple_ssd" / "0001-ple-mmap-table.patch"
MODULE_PATH = "vllm/models/qwen4_exp/ple_mmap.py"
ROW_WIDTH = 160
NGRAM_SIZE, HEADS_PER_NGRAM = 3, 8
HEADS = (NGRAM_SIZE - 1) * HEADS_PER_NGRAM
TEXT_VOCAB = 248_320
EOS = 248_044
# (label, requests, tokens per request): decode c=1; c=1/4/8 with MTP k=3; a prefill chunk.
STEPS = {1: (1, 1), 4: (1, 4), 16: (4, 4), 32: (8, 4), 2048: (1, 2048)}


def load_module_from_patch(patch: Path, path: str = MODULE_PATH, name: str = "ple_mmap"):
    """The new file that a patch adds, imported as a module of a scratch package that holds every
    file the patch creates beside it (ple_mmap imports its row I/O from ple_rows); the patch
    tool's own parser reads the patch."""
    parsed = patches.parse_patch(str(patch), Path(patch).read_text(encoding="utf-8"))
    folder = os.path.dirname(path)
    created = {
        os.path.basename(fp.path): "".join(line for hunk in fp.hunks for line in hunk.new_lines)
        for fp in parsed.files
        if not fp.old_exists and fp.new_exists and os.path.dirname(fp.path) == folder and fp.path.endswith(".py")
    }
    if os.path.basename(path) not in created:
        raise SystemExit(f"error: {patch} does not create {path}")
    root = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    atexit.register(shutil.rmtree, root, True)  # kept while this process runs (tracebacks read it)
    package = f"_{name}_from_patch_{len(_LOADED)}"
    (root / package).mkdir()
    (root / package / "__init__.py").write_text("")
    for file_name, text in created.items():
        (root / package / file_name).write_text(text, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(
        package, root / package / "__init__.py", submodule_search_locations=[str(root / package)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[package] = module
    spec.loader.exec_module(module)
    _LOADED.append(package)
    return importlib.import_module(f"{package}.{os.path.basename(path).removesuffix('.py')}")


_LOADED: list[str] = []


def write_table(folder: Path, table_gib: float, shards: int, files: int, device: str) -> list[Path]:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    rows = int(table_gib * 2**30 / (ROW_WIDTH * 2)) // shards * shards
    shard_rows = rows // shards
    paths = [folder / f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
    expected = shard_rows * ROW_WIDTH * 2 * shards // files
    if all(p.exists() and p.stat().st_size >= expected for p in paths):
        return paths
    generator = torch.Generator(device=device).manual_seed(0)
    per_file = shards // files
    for number, path in enumerate(paths):
        tensors = {}
        for index in range(number * per_file, (number + 1) * per_file):
            shard = torch.randn(shard_rows, ROW_WIDTH, generator=generator, device=device, dtype=torch.bfloat16)
            tensors[f"ngram_embedding.shard_{index}.weight"] = shard.cpu()
        save_file(tensors, str(path))
        with open(path, "rb+") as handle:
            os.fsync(handle.fileno())
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB)", file=sys.stderr, flush=True)
    return paths


def open_shards(paths: list[Path]) -> dict[int, torch.Tensor]:
    """Zero-copy views, as vLLM's default safetensors iterator yields them."""
    from safetensors import safe_open

    shards = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                shards[int(name.split("shard_")[1].split(".")[0])] = handle.get_tensor(name)
    return shards


class CacheControl:
    """Drop the table's pages from this process's mappings and from the page cache."""

    MADV_DONTNEED = 4

    def __init__(self, shards: dict[int, torch.Tensor], paths: list[Path], ple_mmap):
        self.shards = list(shards.values())
        self.paths = paths
        self.ple_mmap = ple_mmap
        self.ple_rows = importlib.import_module(".ple_rows", ple_mmap.__package__)

    def unmap(self) -> None:
        for shard in self.shards:
            self.ple_mmap.madvise(shard, self.MADV_DONTNEED)

    def drop(self) -> None:
        self.unmap()
        for path in self.paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def touch_all(self) -> None:
        """Read one byte of every page: all pages cached and mapped (the warm state)."""
        for shard in self.shards:
            shard.view(torch.uint8).view(-1)[:: mmap.PAGESIZE].sum()

    def resident_fraction(self, samples: int = 4096) -> float:
        """Fraction of sampled table pages in the page cache (ple_rows' mincore sample)."""
        rng = random.Random(1)
        picks = (rng.choice(self.shards) for _ in range(samples))
        addresses = [shard.data_ptr() + rng.randrange(shard.numel() * 2) for shard in picks]
        return self.ple_rows.resident_fraction(addresses)


# --------------------------------------------------------------------------- the baseline
class StraightforwardGather:
    """GPU unique, one D2H, per-shard index_select runs over a thread pool, pinned, one H2D."""

    def __init__(self, shards, shard_rows: int, max_ids: int, threads: int, device: torch.device):
        self.shards = shards
        self.shard_rows = shard_rows
        self.device = device
        self.pool = ThreadPoolExecutor(threads)
        self.threads = threads
        pin = device.type == "cuda"
        self.staging = torch.empty(max_ids, ROW_WIDTH, dtype=torch.bfloat16, pin_memory=pin)
        self.bounds = torch.arange(len(shards) + 1, dtype=torch.long) * shard_rows

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        unique, inverse = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
        host = unique.cpu()
        edges = torch.searchsorted(host, self.bounds).tolist()
        tasks = []
        for shard, (start, end) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
            if end > start:
                step = max(1, -(-(end - start) // self.threads))
                tasks += [(shard, a, min(end, a + step)) for a in range(start, end, step)]

        def run(task):
            shard, start, end = task
            torch.index_select(
                self.shards[shard], 0, host[start:end] - shard * self.shard_rows, out=self.staging[start:end]
            )

        for future in [self.pool.submit(run, task) for task in tasks]:
            future.result()
        rows = self.staging[: host.numel()].to(self.device, non_blocking=True)
        return rows[inverse].view(ids.shape[0], -1)


# --------------------------------------------------------------------------- steps
def make_hasher(ple_mmap, num_rows: int):
    """Qwen3.8-Flash-Next's layout scaled to this table: 16 heads, vocab split evenly."""
    rng = random.Random(1234)
    half = ((1 << 63) - 1) // TEXT_VOCAB // 2
    multipliers = [2 * rng.randrange(half) + 1 for _ in range(NGRAM_SIZE)]
    head_rows = num_rows // HEADS - 7
    offsets = [h * (num_rows // HEADS) for h in range(HEADS)]
    return ple_mmap.NGramHasher(
        multipliers=multipliers,
        head_vocab_sizes=[head_rows] * HEADS,
        head_offsets=offsets,
        ngram_size=NGRAM_SIZE,
        heads_per_ngram=HEADS_PER_NGRAM,
        eos_token_id=EOS,
    )


def make_step(rng: random.Random, tokens: int):
    requests, per_request = STEPS[tokens]
    input_ids = [rng.randrange(TEXT_VOCAB) for _ in range(requests * per_request)]
    query_start_loc = [r * per_request for r in range(requests + 1)]
    context = [[rng.randrange(TEXT_VOCAB) for _ in range(NGRAM_SIZE - 1)] for _ in range(requests)]
    return (
        torch.tensor(input_ids, dtype=torch.int32),
        torch.tensor(query_start_loc, dtype=torch.int32),
        torch.tensor(context, dtype=torch.int32),
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- measurements
def disk_random_reads(paths: list[Path], threads: int, seconds: float) -> dict:
    """Random 4 KiB O_DIRECT preads over the table files, `threads` at a time."""
    sizes = [p.stat().st_size // 4096 for p in paths]
    latencies: list[float] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds
    errors = []

    def worker(seed: int):
        rng = random.Random(seed)
        buffer = mmap.mmap(-1, 4096)
        local = []
        fds = []
        try:
            fds = [os.open(p, os.O_RDONLY | getattr(os, "O_DIRECT", 0)) for p in paths]
            while time.perf_counter() < deadline:
                which = rng.randrange(len(paths))
                offset = rng.randrange(sizes[which]) * 4096
                begin = time.perf_counter()
                os.preadv(fds[which], [buffer], offset)
                local.append(time.perf_counter() - begin)
        except OSError as exc:
            errors.append(repr(exc))
        finally:
            for fd in fds:
                os.close(fd)
            buffer.close()
        with lock:
            latencies.extend(local)

    started = time.perf_counter()
    workers = [threading.Thread(target=worker, args=(seed,)) for seed in range(threads)]
    for worker_thread in workers:
        worker_thread.start()
    for worker_thread in workers:
        worker_thread.join()
    elapsed = time.perf_counter() - started
    return {
        "threads": threads,
        "reads": len(latencies),
        "iops": len(latencies) / elapsed,
        "latency_ms_median": statistics.median(latencies) * 1e3 if latencies else None,
        "latency_ms_mean": statistics.fmean(latencies) * 1e3 if latencies else None,
        "errors": errors[:3],
    }


def time_steps(method, threads, next_step, iterations, warmups, device, before=None, budget_s=20.0) -> list[float]:
    """Wall time of `method` per step, GPU work included; inputs and cache drops untimed."""
    for _ in range(warmups):
        method(threads, *next_step())
    times = []
    stop = time.perf_counter() + budget_s
    for _ in range(iterations):
        step = next_step()
        if before is not None:
            before()
        sync(device)
        begin = time.perf_counter()
        method(threads, *step)
        sync(device)
        times.append(time.perf_counter() - begin)
        if time.perf_counter() > stop:
            break
    return times


# --------------------------------------------------------------------------- server conditions
FREE = "free"
SERVER = "server"


def busy_workload(device: torch.device):
    """A GPU workload standing in for the previous step: `run(ms, stream)` enqueues ~ms of
    bf16 matmuls on `stream` (calibrated once) and returns without waiting."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    for _ in range(3):
        torch.matmul(a, a, out=c)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(20):
        torch.matmul(a, a, out=c)
    torch.cuda.synchronize()
    per_matmul_ms = (time.perf_counter() - began) * 1e3 / 20

    def run(ms: float, stream) -> None:
        with torch.cuda.stream(stream):
            for _ in range(max(1, round(ms / per_matmul_ms))):
                torch.matmul(a, a, out=c)

    run.per_matmul_ms = per_matmul_ms
    return run


def time_one(step_fn, device, stream_sync: bool) -> tuple[float, float]:
    """(wall ms, this thread's CPU ms) of one call, its GPU work included."""
    wall, cpu = time.perf_counter(), time.thread_time()
    step_fn()
    if device.type == "cuda":
        if stream_sync:
            torch.cuda.current_stream().synchronize()
        else:
            torch.cuda.synchronize()
    return (time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3


def scoped_index_select(rows_at: torch.Tensor, out: torch.Tensor, threads: int, offs: np.ndarray) -> None:
    """One torch.index_select with `threads` intra-op threads, then back to the caller's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.index_select(rows_at, 0, torch.from_numpy(offs), out=out[: offs.size])
    finally:
        torch.set_num_threads(before)


def run_server(args, ctx: dict, results: dict, save) -> None:
    """The server conditions: one torch thread beside the free count, the GPU idle beside
    busy, the module before the server-conditions rework beside the current one."""
    run = ServerRun(args, ctx, results)
    run.check_against_resident()
    run.time_thread_conditions(save)
    run.time_gpu_states(save)
    run.check_staging()


class ServerRun:
    """The parts of the server suite, over one pair of tables (the module before the
    server-conditions rework and the current one) built over the same mapped shards."""

    def __init__(self, args, ctx: dict, results: dict):
        self.args, self.ctx, self.results = args, ctx, results
        self.device, self.hasher = ctx["device"], ctx["hasher"]
        self.token_sizes = ctx["token_sizes"]
        free_threads = torch.get_num_threads()
        self.conditions = {SERVER: 1, FREE: free_threads}
        results["environment"]["torch_threads_free"] = free_threads
        self.new = self.build(ctx["new"])
        self.old = self.build(ctx["old"], num_threads=args.pool_threads)
        # Warm: every page of the table cached and mapped, as after a server's first requests.
        cache = CacheControl(ctx["shards"], ctx["paths"], ctx["new"])
        cache.touch_all()
        results["environment"]["resident_fraction_warm"] = cache.resident_fraction()
        results["environment"]["table"] = self.new.describe()
        results["environment"]["old_table"] = self.old.describe()
        self.rng = random.Random(11)
        self.np_rng = np.random.default_rng(11)
        self.stages = {"old_stage": self.old_stage, "new_stage": self.new_stage}

    def build(self, module, **settings):
        ctx = self.ctx
        with torch.device(self.device):
            table = module.MmapNGramTable(
                num_rows=ctx["num_rows"],
                row_width=ROW_WIDTH,
                dtype=torch.bfloat16,
                num_shards=len(ctx["shards"]),
                max_tokens=max(self.token_sizes),
                heads=HEADS,
                hasher=self.hasher,
                static_output=True,
                **settings,
            )
        for index, shard in ctx["shards"].items():
            table.add_shard(index, shard)
        if module is ctx["new"]:
            table.finish_loading(release=False)  # the bench's files hold nothing else
        else:
            table.finish_loading()
        return table

    def inputs(self, tokens: int):
        host = make_step(self.rng, tokens)
        dev = tuple(t.to(self.device) for t in host)
        sync(self.device)
        return host, dev

    def new_stage(self, host, dev) -> None:
        # As Qwen4ExpModelState.prepare_inputs calls it: query_start_loc from the host copy.
        self.new.stage(*dev, query_start_loc_host=host[1].numpy())
        self.new.check_staged_host()  # the forward's read, host side

    def old_stage(self, host, dev) -> None:
        self.old.stage(*dev)

    def record(self, section, method, condition, size, walls, cpus=None) -> None:
        entry = {"key": [section, method, condition, str(size)], "times_ms": walls}
        if cpus is not None:
            entry["cpu_ms"] = cpus
        self.results["records"].append(entry)
        print(
            f"{section:6s} {method:22s} {condition:14s} {size:>6} median {statistics.median(walls):8.3f} ms"
            + (f"  cpu {statistics.median(cpus):8.3f} ms" if cpus else "")
            + f" (n={len(walls)})",
            file=sys.stderr,
            flush=True,
        )

    def iterations(self, size: int) -> int:
        return max(5, self.args.warm_iters // 4) if size >= 1024 else self.args.warm_iters

    def check_against_resident(self) -> None:
        """Correctness first: both stages against the resident table."""
        checks = {}
        for tokens in self.token_sizes:
            host, dev = self.inputs(tokens)
            want = torch.nn.functional.embedding(self.hasher.ids_tensor(*dev), self.ctx["resident"])
            want = want.reshape(tokens, -1)
            for name, fn in self.stages.items():
                fn(host, dev)
                table = self.new if name == "new_stage" else self.old
                checks[f"{name}/{tokens}"] = bool(
                    torch.equal(table.staged(tokens).view(torch.int16), want.view(torch.int16))
                )
        self.results["matches_resident"] = checks
        print("matches resident:", checks, file=sys.stderr, flush=True)

    def time_thread_conditions(self, save) -> None:
        """torch threads 1 (vLLM after warm-up) beside the free count; old beside new."""
        for condition, threads in self.conditions.items():
            torch.set_num_threads(threads)
            self.time_stages(condition)
            self.time_gathers(condition)
            save()
        torch.set_num_threads(1)

    def time_stages(self, condition: str) -> None:
        for tokens in self.token_sizes:
            for name, fn in self.stages.items():
                walls = []
                for index in range(self.iterations(tokens) + 3):
                    host, dev = self.inputs(tokens)
                    wall, _ = time_one(lambda fn=fn, host=host, dev=dev: fn(host, dev), self.device, False)
                    if index >= 3:
                        walls.append(wall)
                self.record("stage", name, condition, tokens, walls)

    def gathers(self, condition: str) -> dict:
        old, new = self.old, self.new
        gathers = {
            # What the old code did above 256 rows (and for a prefill chunk's unique rows):
            # one torch.index_select over the byte view, parallel only through torch's threads.
            "old_index_select": lambda offs: torch.index_select(
                old.rows_at, 0, torch.from_numpy(offs), out=old.host_rows[: offs.size]
            ),
            "new_calling_thread": lambda offs: new._copy_rows(offs, 0, offs.size, new.host_rows_np),
            "new_gather": lambda offs: new.gather_offsets(offs, new.host_rows_np),
        }
        if condition == SERVER:
            # Scoped threads: torch's own threads for the one index_select only, the server's
            # single thread restored after it (the switch is inside the timed call).
            for scoped in self.args.scoped_threads:
                gathers[f"index_select_scoped_{scoped}t"] = functools.partial(
                    scoped_index_select, old.rows_at, old.host_rows, scoped
                )
        return gathers

    def time_gathers(self, condition: str) -> None:
        new = self.new
        for rows in self.args.sweep_rows:
            offsets_of = functools.partial(self.np_rng.integers, 0, self.ctx["num_rows"], rows, dtype=np.int64)
            for name, fn in self.gathers(condition).items():
                walls = []
                for index in range(self.iterations(rows) + 3):
                    ids = offsets_of()
                    offs = new.shard_base_np[ids // new.shard_size] + ids * new.row_bytes
                    wall, _ = time_one(lambda fn=fn, offs=offs: fn(offs), torch.device("cpu"), False)
                    if index >= 3:
                        walls.append(wall)
                self.record("gather", name, condition, rows, walls)

    def time_gpu_states(self, save) -> None:
        """The server condition (one torch thread), GPU idle / busy / after the previous step."""
        if self.device.type != "cuda":
            self.results["skipped"].append("GPU busy and after-previous-step modes: no CUDA device")
            return
        args, device = self.args, self.device
        workload = busy_workload(device)
        side = torch.cuda.Stream()
        main = torch.cuda.current_stream()
        self.results["environment"]["busy_matmul_ms"] = workload.per_matmul_ms
        prev_ms = args.previous_step_ms
        # The previous step alone, for the after-previous-step figures.
        alone = []
        for _ in range(20):
            alone.append(time_one(lambda: workload(prev_ms, main), device, True)[0])
        previous_alone = statistics.median(alone)
        self.results["environment"]["previous_step_alone_ms"] = previous_alone
        for tokens in self.token_sizes:
            for name, fn in self.stages.items():
                for state in ("idle", "busy", "after_previous_step"):
                    walls, cpus = [], []
                    for index in range(self.iterations(tokens) + 3):
                        host, dev = self.inputs(tokens)
                        if state == "busy":
                            # Another stream keeps the GPU busy for longer than the step takes.
                            workload(args.busy_ms if tokens < 1024 else 4 * args.busy_ms, side)
                        if state == "after_previous_step":
                            # The step's inputs wait for the previous step's kernels (same stream).
                            def step(fn=fn, host=host, dev=dev):
                                workload(prev_ms, main)
                                fn(host, dev)
                        else:

                            def step(fn=fn, host=host, dev=dev):
                                fn(host, dev)

                        wall, cpu = time_one(step, device, True)
                        side.synchronize()
                        if state == "after_previous_step":
                            wall -= previous_alone
                        if index >= 3:
                            walls.append(wall)
                            cpus.append(cpu)
                    self.record("gpu", name, state, tokens, walls, cpus)
            save()

    def check_staging(self) -> None:
        """A decode step's stage() in parts; on CUDA, a captured graph over staged rows and a replay
        without a stage (refused); the new table's counters."""
        results, new, device = self.results, self.new, self.device
        try:
            results["breakdown_us"] = breakdown(new, self.hasher, self.rng, device, self.token_sizes)
        except Exception:
            results["errors"].append({"breakdown": traceback.format_exc()})
        if device.type == "cuda":
            try:
                results["cuda_graph"] = cuda_graph_check(new, self.hasher, self.ctx["resident"], self.rng, device)
            except Exception:
                results["errors"].append({"cuda_graph": traceback.format_exc()})
            results["stale_replay"] = stale_replay_check(self.args)
        results["stats"] = dict(new.stats)


def stale_replay_check(args) -> dict:
    """A captured forward replayed without a stage must stop the process (device-side
    assert). Run in a child process: the assert ends its CUDA context."""
    command = [sys.executable, __file__, "--stale-replay-child", "--dir", str(args.dir)]
    command += ["--table-gib", str(args.table_gib), "--shards", str(args.shards), "--files", str(args.files)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "timed out"}
    log = proc.stdout + proc.stderr
    staged_ok = "replay after stage: ok" in log
    refused = proc.returncode != 0 and "device-side assert" in log.lower()
    return {"ok": staged_ok and refused, "returncode": proc.returncode, "log_tail": log[-1500:]}


def stale_replay_child(args) -> int:
    ple_mmap = load_module_from_patch(args.patch)
    device = torch.device("cuda")
    paths = write_table(args.dir, args.table_gib, args.shards, args.files, "cuda")
    shards = open_shards(paths)
    num_rows = next(iter(shards.values())).shape[0] * len(shards)
    hasher = make_hasher(ple_mmap, num_rows)
    with torch.device(device):
        table = ple_mmap.MmapNGramTable(
            num_rows=num_rows,
            row_width=ROW_WIDTH,
            dtype=torch.bfloat16,
            num_shards=len(shards),
            max_tokens=4,
            heads=HEADS,
            hasher=hasher,
            static_output=True,
        )
    for index, shard in shards.items():
        table.add_shard(index, shard)
    table.finish_loading(release=False)
    weight = torch.randn(HEADS * ROW_WIDTH, 64, device=device, dtype=torch.bfloat16)
    rng = random.Random(3)
    table.stage_dummy()  # as Qwen4ExpModelState.prepare_dummy_inputs does before capture

    def forward():
        table.check_staged_device()
        return table.staged(4) @ weight

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for _ in range(3):
        table.stage(*(t.to(device) for t in make_step(rng, 4)))
        graph.replay()
        torch.cuda.synchronize()
    print("replay after stage: ok", flush=True)
    graph.replay()  # no stage before it: the device-side assert must fire
    torch.cuda.synchronize()
    print("stale replay was NOT refused", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("magpie bench-staging", __doc__)
    parser.add_argument("--dir", type=Path, required=True, help="where the table files go (a disk, not tmpfs)")
    parser.add_argument("--table-gib", type=float, default=8.0, help="table size in GiB")
    parser.add_argument("--shards", type=int, default=128, help="checkpoint shards (the real model has 128)")
    parser.add_argument("--files", type=int, default=16, help="safetensors files holding the shards")
    parser.add_argument("--tokens", default="1,4,16,32,2048", help="step sizes in tokens (16 rows each)")
    parser.add_argument("--threads", default="1,4,16", help="gather thread counts to try")
    parser.add_argument("--warm-iters", type=int, default=200, help="timed warm steps per configuration")
    parser.add_argument("--cold-iters", type=int, default=15, help="timed cold steps per configuration")
    parser.add_argument("--disk-seconds", type=float, default=2.0, help="seconds per disk read test")
    parser.add_argument("--modes", default="warm,cached,cold", help="cache states to time")
    parser.add_argument("--deadline-s", type=float, default=1e9, help="skip timings started after this")
    parser.add_argument("--patch", type=Path, default=DEFAULT_PATCH, help="patch that adds ple_mmap.py")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--suite", choices=["server", "full"], default="server", help="see above")
    parser.add_argument("--sweep-rows", default="256,512,1024,2048,4096,8192,32768", help="gather sizes (server)")
    parser.add_argument("--pool-threads", type=int, default=16, help="the old module's pool threads (server)")
    parser.add_argument(
        "--scoped-threads",
        type=lambda text: [int(x) for x in text.split(",") if x],
        default="2,4,8",
        help="torch thread counts set around one index_select only, with one thread (server; '' for none)",
    )
    parser.add_argument("--busy-ms", type=float, default=5.0, help="GPU-busy workload per decode step (server)")
    parser.add_argument("--previous-step-ms", type=float, default=1.0, help="'previous step' workload (server)")
    parser.add_argument(
        "--before-patch",
        type=Path,
        help="0001 as it was before the server-conditions rework, timed beside the current one "
        "(--suite server needs it; a checkout keeps it as "
        "measurements/ple_ssd/0001-ple-mmap-table.before-issue-14.patch)",
    )
    parser.add_argument("--stale-replay-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("ple_ssd_bench.json"), help="JSON results")
    cli.add_force(parser, "the --out file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.sweep_rows = [int(r) for r in args.sweep_rows.split(",")]
    if args.stale_replay_child:
        return stale_replay_child(args)
    files.check_output(args.out, args.force, what="--out")
    if args.suite == "server" and args.before_patch is None:
        raise SystemExit(
            "error: --suite server times the module before the server-conditions rework beside the "
            "current one: give "
            "--before-patch PATH (in a checkout: measurements/ple_ssd/0001-ple-mmap-table.before-issue-14.patch), "
            "or run --suite full (the current module alone)"
        )
    if args.before_patch is not None and not args.before_patch.is_file():
        raise SystemExit(f"error: --before-patch {args.before_patch}: no such file")
    ple_mmap = load_module_from_patch(args.patch)
    device = torch.device(args.device)
    token_sizes = [int(t) for t in args.tokens.split(",")]
    results: dict = {"environment": environment(device, args), "records": [], "errors": [], "skipped": []}

    def save():
        results["summary"] = summarize(results["records"])
        first = ["summary", "matches_resident", "breakdown_us", "cuda_graph", "stale_replay", "disk", "stats"]
        first += ["environment", "errors", "skipped"]
        ordered = {key: results[key] for key in first if key in results}
        ordered["records"] = results["records"]
        files.atomic_write_json(args.out, ordered)  # saved after each part: a reader sees a whole file

    began = time.perf_counter()
    paths = write_table(args.dir, args.table_gib, args.shards, args.files, args.device)
    results["environment"]["write_s"] = time.perf_counter() - began
    shards = open_shards(paths)
    shard_rows = next(iter(shards.values())).shape[0]
    num_rows = shard_rows * len(shards)
    results["environment"].update(table_rows=num_rows, table_bytes=num_rows * ROW_WIDTH * 2, shard_rows=shard_rows)
    hasher = make_hasher(ple_mmap, num_rows)
    began = time.perf_counter()
    resident = torch.cat([shards[i] for i in range(len(shards))]).to(device)
    results["environment"]["resident_copy_s"] = time.perf_counter() - began
    ctx = {
        "new": ple_mmap,
        "device": device,
        "shards": shards,
        "paths": paths,
        "hasher": hasher,
        "resident": resident,
        "num_rows": num_rows,
        "shard_rows": shard_rows,
        "token_sizes": token_sizes,
    }
    if args.suite == "server":
        ctx["old"] = load_module_from_patch(args.before_patch, name="ple_mmap_before_server_rework")
        run_server(args, ctx, results, save)
    else:
        run_full(args, ctx, results, save)
    save()
    print_table(results)
    return 0


def run_full(args, ctx: dict, results: dict, save) -> None:
    """The earlier comparison: every method, warm / cached / cold, several thread counts."""
    run = FullRun(args, ctx, results)
    run.check_against_resident()
    run.time_modes(save)
    run.extras()


class FullRun:
    """The full suite's tables (as shipped, every step deduplicated, none deduplicated), the
    straightforward baseline and the resident table, each timed per cache state."""

    def __init__(self, args, ctx: dict, results: dict):
        self.args, self.ctx, self.results = args, ctx, results
        self.device, self.hasher, self.resident = ctx["device"], ctx["hasher"], ctx["resident"]
        self.token_sizes = ctx["token_sizes"]
        self.thread_counts = [int(t) for t in args.threads.split(",")]
        self.cache = CacheControl(ctx["shards"], ctx["paths"], ctx["new"])
        self.tables = {t: self.make_table(t, 1024) for t in self.thread_counts}
        # The same table with every step taking the sorted, deduplicated path (for the threshold).
        self.sorted_tables = {t: self.make_table(t, 0) for t in self.thread_counts}
        # ... and with none deduplicated: large steps hashed on the host, rows in token order.
        self.direct_tables = {t: self.make_table(t, 1 << 40) for t in self.thread_counts}
        results["environment"]["table"] = self.tables[self.thread_counts[0]].describe()
        max_ids = max(self.token_sizes) * HEADS
        self.baselines = {
            t: StraightforwardGather(ctx["shards"], ctx["shard_rows"], max_ids, t, self.device)
            for t in self.thread_counts
        }
        print("table ready:", results["environment"]["table"], file=sys.stderr, flush=True)
        self.rng = random.Random(7)
        self.methods = self.make_methods()

    def make_table(self, threads: int, direct_copy_max_rows: int):
        ctx = self.ctx
        with torch.device(self.device):
            table = ctx["new"].MmapNGramTable(
                num_rows=ctx["num_rows"],
                row_width=ROW_WIDTH,
                dtype=torch.bfloat16,
                num_shards=len(ctx["shards"]),
                max_tokens=max(self.token_sizes),
                heads=HEADS,
                hasher=self.hasher,
                static_output=True,
                num_threads=threads,
                direct_copy_max_rows=direct_copy_max_rows,
            )
        for index, shard in ctx["shards"].items():
            table.add_shard(index, shard)
        table.finish_loading()
        return table

    def make_methods(self) -> dict:
        tables, sorted_tables, direct_tables = self.tables, self.sorted_tables, self.direct_tables
        baselines, resident = self.baselines, self.resident
        return {
            "ple_mmap_stage": lambda t, host, dev, ids: tables[t].stage(*dev),
            "ple_mmap_stage_host": lambda t, host, dev, ids: tables[t].stage(*host),
            "ple_mmap_lookup": lambda t, host, dev, ids: tables[t].lookup(ids),
            "ple_mmap_stage_sorted": lambda t, host, dev, ids: sorted_tables[t].stage(*dev),
            "ple_mmap_stage_direct": lambda t, host, dev, ids: direct_tables[t].stage(*dev),
            "baseline": lambda t, host, dev, ids: baselines[t].lookup(ids),
            "resident": lambda t, host, dev, ids: torch.nn.functional.embedding(ids, resident),
            "sync_only": lambda t, host, dev, ids: None,  # the timer's own floor: one device sync
        }

    def next_step(self, tokens: int):
        host = make_step(self.rng, tokens)  # fresh tokens every step: no row is reused on purpose
        dev = tuple(t.to(self.device) for t in host)
        ids = self.hasher.ids_tensor(*dev)
        sync(self.device)
        return host, dev, ids

    def check_against_resident(self) -> None:
        """Correctness first: every method against the resident table, each step size."""
        checks = {}
        threads = self.thread_counts[-1]
        for tokens in self.token_sizes:
            host, dev, ids = self.next_step(tokens)
            want = torch.nn.functional.embedding(ids, self.resident).reshape(len(host[0]), -1).view(torch.int16)
            for name, method in self.methods.items():
                try:
                    got = method(threads, host, dev, ids)
                    if name == "sync_only":
                        continue
                    if name.startswith("ple_mmap_stage"):
                        kind = name.rsplit("_", 1)[1]
                        table = {"sorted": self.sorted_tables, "direct": self.direct_tables}.get(kind, self.tables)
                        got = table[threads].staged(len(host[0]))
                    same = torch.equal(got.reshape(len(host[0]), -1).view(torch.int16), want)
                    checks[f"{name}/{tokens}"] = bool(same)
                except Exception:
                    self.results["errors"].append({"check": name, "tokens": tokens, "error": traceback.format_exc()})
        self.results["matches_resident"] = checks
        print("matches resident:", checks, file=sys.stderr, flush=True)

    def time_modes(self, save) -> None:
        """Every method per cache state: warm (mapped and cached), cached (unmapped), cold."""
        cache, environment = self.cache, self.results["environment"]
        deadline = time.perf_counter() + self.args.deadline_s
        cache.touch_all()
        environment["resident_fraction_warm"] = cache.resident_fraction()
        for mode in self.args.modes.split(","):
            if mode == "cold":
                cache.drop()
                environment["resident_fraction_after_drop"] = cache.resident_fraction()
            for tokens in self.token_sizes:
                for name in self.methods:
                    if mode != "warm" and name not in ("ple_mmap_stage", "baseline"):
                        continue  # the other ple_mmap entries share the stage's gather
                    single = name in ("resident", "sync_only")
                    for threads in self.thread_counts[:1] if single else self.thread_counts:
                        if time.perf_counter() > deadline:
                            self.results["skipped"].append(f"{mode}/{name}/{tokens}/t{threads}")
                            continue
                        self.time_method(name, mode, tokens, threads)
                save()
            if mode == "cold":
                cache.touch_all()

    def time_method(self, name: str, mode: str, tokens: int, threads: int) -> None:
        before = {"warm": None, "cached": self.cache.unmap, "cold": self.cache.drop}[mode]
        iters = self.args.warm_iters if mode == "warm" else self.args.cold_iters
        if tokens >= 1024:
            iters = max(3, iters // 4)
        warmups = 3 if mode == "warm" else 0
        budget = 10.0 if mode == "warm" else 5.0
        step_of = functools.partial(self.next_step, tokens)
        try:
            times = time_steps(self.methods[name], threads, step_of, iters, warmups, self.device, before, budget)
        except Exception:
            error = {"method": name, "tokens": tokens, "mode": mode, "error": traceback.format_exc()}
            self.results["errors"].append(error)
            return
        self.results["records"].append(
            {
                "key": [name, mode, str(tokens), f"t{threads}"],
                "method": name,
                "tokens": tokens,
                "mode": mode,
                "threads": threads,
                "times_ms": [t * 1e3 for t in times],
            }
        )
        print(
            f"{mode:6s} {name:20s} tokens={tokens:5d} threads={threads:2d} "
            f"median={statistics.median(times) * 1e3:8.3f} ms (n={len(times)})",
            file=sys.stderr,
            flush=True,
        )

    def extras(self) -> None:
        """The disk's random-read rate, the per-part breakdown, and (CUDA) a graph replay check."""
        results, threads = self.results, self.thread_counts
        results["disk"] = []
        for count in sorted(set(threads)):
            try:
                results["disk"].append(disk_random_reads(self.ctx["paths"], count, self.args.disk_seconds))
            except Exception:
                results["errors"].append({"disk": count, "error": traceback.format_exc()})
        try:
            table = self.tables[threads[0]]
            results["breakdown_us"] = breakdown(table, self.hasher, self.rng, self.device, self.token_sizes)
        except Exception:
            results["errors"].append({"breakdown": traceback.format_exc()})
        if self.device.type == "cuda":
            try:
                table = self.tables[threads[-1]]
                results["cuda_graph"] = cuda_graph_check(table, self.hasher, self.resident, self.rng, self.device)
            except Exception:
                results["errors"].append({"cuda_graph": traceback.format_exc()})


def cuda_graph_check(table, hasher, resident, rng, device) -> dict:
    """Capture a forward over the staged rows once; replay after staging other steps."""
    tokens = 4
    weight = torch.randn(HEADS * ROW_WIDTH, 256, device=device, dtype=torch.bfloat16)
    # As vLLM captures: dummy inputs (Qwen4ExpModelState.prepare_dummy_inputs marks them),
    # warm-up runs, capture; the forward checks the step counter, then reads the rows.
    table.stage_dummy()

    def forward():
        if hasattr(table, "check_staged_device"):
            table.check_staged_device()
        return table.staged(tokens) @ weight

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            output = forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = forward()
    report = {"replays": []}
    previous = None
    for replay in range(4):
        step = tuple(t.to(device) for t in make_step(rng, tokens))
        table.stage(*step)
        graph.replay()
        torch.cuda.synchronize()
        ids = hasher.ids_tensor(*step)
        want = torch.nn.functional.embedding(ids, resident).reshape(tokens, -1) @ weight
        report["replays"].append(
            {
                "replay": replay,
                "equals_fresh_rows": bool(torch.equal(output, want)),
                "differs_from_previous_step": previous is None or not torch.equal(output, previous),
            }
        )
        previous = output.clone()
    report["ok"] = all(r["equals_fresh_rows"] and r["differs_from_previous_step"] for r in report["replays"])
    return report


def breakdown(table, hasher, rng, device, token_sizes, iterations: int = 200) -> dict:
    """Median microseconds of each part of a decode step's `stage()`, each part timed alone."""
    report = {}
    for tokens in token_sizes:
        if tokens * HEADS > table.direct_copy_max_rows:
            continue  # the large-step path (device hashing, dedup) is not split up here
        host = make_step(rng, tokens)
        dev = tuple(t.to(device) for t in host)
        arrays = [t.numpy() for t in host]
        ids = hasher.ids_numpy(*arrays).reshape(-1)
        staging, out = table.gather_host(ids)
        qsl = arrays[1]
        parts = {
            # token ids and context copied back (query_start_loc from the host), one wait
            "ids_to_host": lambda dev=dev, qsl=qsl: table._host_arrays(dev[0], qsl, dev[2]),
            "hash_numpy": lambda arrays=arrays: hasher.ids_numpy(*arrays),
            "gather_host": lambda ids=ids: table.gather_host(ids),  # offsets + rows into the pinned buffer
            "upload_and_sync": lambda out=out, staging=staging: (out.copy_(staging, non_blocking=True), sync(device)),
            "stage_host_ids_and_sync": lambda host=host: (table.stage(*host), sync(device)),
            "stage_device_ids_and_sync": lambda dev=dev, qsl=qsl: (
                table.stage(*dev, query_start_loc_host=qsl),
                sync(device),
            ),
        }
        report[tokens] = {}
        for name, part in parts.items():
            part()
            times = []
            for _ in range(iterations):
                begin = time.perf_counter()
                part()
                times.append(time.perf_counter() - begin)
            report[tokens][name] = round(statistics.median(times) * 1e6, 1)
    return report


def environment(device: torch.device, args) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "device": str(device),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        info["cpu_model"] = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return info


def summarize(records: list[dict]) -> dict:
    summary: dict = {}
    for record in records:
        times = record["times_ms"]
        entry = {
            "median_ms": statistics.median(times),
            "p90_ms": sorted(times)[int(0.9 * (len(times) - 1))],
            "n": len(times),
        }
        if record.get("cpu_ms"):
            entry["cpu_median_ms"] = statistics.median(record["cpu_ms"])
        summary["/".join(record["key"])] = entry
    return summary


def side_by_side(summary: dict, rows: list[str], columns: list[tuple[str, str]], title: str, cpu=False) -> None:
    """One table: a row per size, a column per (label, key template with {size})."""
    width = max(12, *(len(label) + 1 for label, _ in columns))
    print(f"\n{title}")
    print(f"{'size':>6s} " + " ".join(f"{label:>{width}s}" for label, _ in columns))
    for size in rows:
        cells = []
        for _, template in columns:
            if template.startswith("ratio:"):
                slow, fast = template[6:].split("|")
                a, b = summary.get(slow.format(size=size)), summary.get(fast.format(size=size))
                value = a["median_ms"] / b["median_ms"] if a and b and b["median_ms"] else None
                cells.append(f"{value:>{width}.2f}" if value is not None else f"{'-':>{width}s}")
                continue
            entry = summary.get(template.format(size=size))
            if entry is None:
                cells.append(f"{'-':>{width}s}")
            elif cpu:
                text = f"{entry['median_ms']:.3f}/{entry.get('cpu_median_ms', float('nan')):.3f}"
                cells.append(f"{text:>{width}s}")
            else:
                cells.append(f"{entry['median_ms']:>{width}.3f}")
        print(f"{size:>6s} " + " ".join(cells))


def print_table(results: dict) -> None:
    summary = results["summary"]
    env = results["environment"]
    print(
        f"machine: {env.get('gpu', 'no GPU')}, {env.get('cpu_model', '?')}, {env.get('cpus')} CPUs, "
        f"torch {env.get('torch')}, free torch threads {env.get('torch_threads_free', '-')}"
    )
    if any(key.startswith("stage/") for key in summary):
        sizes = sorted({key.split("/")[3] for key in summary if key.startswith("stage/")}, key=int)
        side_by_side(
            summary,
            sizes,
            [
                ("old 1 thr", "stage/old_stage/server/{size}"),
                ("new 1 thr", "stage/new_stage/server/{size}"),
                ("old/new 1 thr", "ratio:stage/old_stage/server/{size}|stage/new_stage/server/{size}"),
                ("old free", "stage/old_stage/free/{size}"),
                ("new free", "stage/new_stage/free/{size}"),
            ],
            "stage() per step, median ms, tokens per step; one torch thread (server) vs free",
        )
        sizes = sorted({key.split("/")[3] for key in summary if key.startswith("gather/")}, key=int)
        side_by_side(
            summary,
            sizes,
            [
                ("old idxsel 1", "gather/old_index_select/server/{size}"),
                ("new 1-thread 1", "gather/new_calling_thread/server/{size}"),
                ("new shipped 1", "gather/new_gather/server/{size}"),
                ("old/new 1", "ratio:gather/old_index_select/server/{size}|gather/new_gather/server/{size}"),
                ("old idxsel free", "gather/old_index_select/free/{size}"),
                ("new shipped free", "gather/new_gather/free/{size}"),
            ],
            "gather of N random warm rows, median ms (N rows); 1 = one torch thread",
        )
    if any(key.startswith("gpu/") for key in summary):
        sizes = sorted({key.split("/")[3] for key in summary if key.startswith("gpu/")}, key=int)
        columns = []
        for state in ("idle", "busy", "after_previous_step"):
            for method in ("old_stage", "new_stage"):
                columns.append((f"{method[:3]} {state[:10]}", f"gpu/{method}/{state}/{{size}}"))
        side_by_side(
            summary,
            sizes,
            columns,
            "GPU states: stage() per step, one torch thread, wall ms / staging thread's CPU ms "
            "(after_previous_step: minus the previous step's own time)",
            cpu=True,
        )
    if not any(key.split("/")[0] in ("stage", "gather", "gpu") for key in summary):
        print(f"{'key':50s} {'median ms':>10s} {'p90 ms':>8s}")
        for key, value in summary.items():
            print(f"{key:50s} {value['median_ms']:10.3f} {value['p90_ms']:8.3f}")
    for disk in results.get("disk", []):
        print(
            f"disk 4 KiB random O_DIRECT reads, {disk['threads']:2d} threads: {disk['iops']:.0f} IOPS, "
            f"median {disk['latency_ms_median'] or float('nan'):.3f} ms"
        )
    for tokens, parts in results.get("breakdown_us", {}).items():
        print(f"stage() parts, {tokens} tokens, median us:", json.dumps(parts))
    if "cuda_graph" in results:
        print("CUDA graph replays read freshly staged rows:", results["cuda_graph"]["ok"])
    if "stale_replay" in results:
        print("CUDA graph replay without a stage refused by the device-side check:", results["stale_replay"]["ok"])
    print("matches resident:", all(results.get("matches_resident", {}).values()), "; stats:", results.get("stats"))
    for error in results["errors"]:
        print("ERROR", json.dumps(error)[:2000])


if __name__ == "__main__":
    sys.exit(main())
