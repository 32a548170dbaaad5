"""One harness configuration in one process: `python3 worker.py CONFIG.json`.

Started by gpu_harness.py (`run`), never by hand in normal use. Builds `vllm.LLM` in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, so the engine core, the model runner and the model live in
this process), installs counters on vLLM's own dispatch and CUDA-graph replay functions,
runs the configuration's checks and prints one line `RESULT {json}` at the end. The log
lines that prove which path ran are read from this process's output by gpu_harness.py.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

from magpie.gpu import models

COUNTS: dict = {"steps": collections.Counter(), "step_tokens": collections.Counter(), "replays": collections.Counter()}
STAGE: dict = {"calls": 0, "seconds": [], "tokens": []}
LOOKUP: dict = {"calls": 0, "seconds": []}


def install_hooks() -> list[str]:
    """Count vLLM's own per-step CUDA-graph decisions and FULL-graph replays (the V2 runner has
    no cudagraph metrics of its own); time ple_mmap's stage() where the patch is applied."""
    installed = []
    try:
        import vllm.v1.worker.gpu.cudagraph_utils as cu
        import vllm.v1.worker.gpu.model_runner as mr

        dispatch = mr.dispatch_cg_and_sync_dp

        def counted_dispatch(*args, **kwargs):
            desc, sync = dispatch(*args, **kwargs)
            mode = getattr(desc.cg_mode, "name", str(desc.cg_mode))
            if desc.num_tokens:
                COUNTS["steps"][mode] += 1
                COUNTS["step_tokens"][f"{mode}:{desc.num_tokens}"] += 1
            return desc, sync

        mr.dispatch_cg_and_sync_dp = counted_dispatch
        installed.append("model_runner.dispatch_cg_and_sync_dp")
        for cls in (cu.CudaGraphManager, cu.ModelCudaGraphManager):
            if "run_fullgraph" not in cls.__dict__:
                continue

            def make(orig):
                def run_fullgraph(self, *args, **kwargs):
                    # A subclass's run_fullgraph may call the base one: count the outer call only.
                    outer = not getattr(self, "_gpuh_in_replay", False)
                    if outer:
                        COUNTS["replays"][type(self).__name__] += 1
                        self._gpuh_in_replay = True
                    try:
                        return orig(self, *args, **kwargs)
                    finally:
                        if outer:
                            self._gpuh_in_replay = False

                return run_fullgraph

            cls.run_fullgraph = make(cls.__dict__["run_fullgraph"])
            installed.append(f"{cls.__name__}.run_fullgraph")
    except Exception as exc:  # V1 runner or another release: report, do not fail
        installed.append(f"dispatch hooks failed: {exc!r}")
    try:
        from vllm.models.qwen4_exp import ple_mmap

        if hasattr(ple_mmap.MmapNGramTable, "stage"):
            stage = ple_mmap.MmapNGramTable.stage

            def timed_stage(self, input_ids, *args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return stage(self, input_ids, *args, **kwargs)
                finally:
                    STAGE["calls"] += 1
                    STAGE["seconds"].append(time.perf_counter() - t0)
                    STAGE["tokens"].append(int(input_ids.shape[0]))

            ple_mmap.MmapNGramTable.stage = timed_stage
            installed.append("MmapNGramTable.stage")
        if hasattr(ple_mmap.MmapNGramTable, "lookup"):
            lookup = ple_mmap.MmapNGramTable.lookup

            def timed_lookup(self, *args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return lookup(self, *args, **kwargs)
                finally:
                    LOOKUP["calls"] += 1
                    LOOKUP["seconds"].append(time.perf_counter() - t0)

            ple_mmap.MmapNGramTable.lookup = timed_lookup
            installed.append("MmapNGramTable.lookup")
    except ImportError:
        pass
    try:  # vLLM 0.34+: the step's rows are staged by model_state's stage_checkpoint_rows (upstream's
        # disk_offload reader and ours alike run inside it), called by its module-level name.
        import vllm.models.qwen4_exp.nvidia.model_state as model_state

        if hasattr(model_state, "stage_checkpoint_rows"):
            stage_rows = model_state.stage_checkpoint_rows

            def timed_stage_rows(modules, input_ids, *args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return stage_rows(modules, input_ids, *args, **kwargs)
                finally:
                    STAGE["calls"] += 1
                    STAGE["seconds"].append(time.perf_counter() - t0)
                    STAGE["tokens"].append(int(input_ids.shape[0]))

            model_state.stage_checkpoint_rows = timed_stage_rows
            installed.append("model_state.stage_checkpoint_rows")
    except ImportError:
        pass
    return installed


def reset_counts() -> None:
    for counter in COUNTS.values():
        counter.clear()
    STAGE.update(calls=0, seconds=[], tokens=[])
    LOOKUP.update(calls=0, seconds=[])


def snapshot_counts() -> dict:
    out = {k: dict(v) for k, v in COUNTS.items()}
    if STAGE["calls"]:
        us = sorted(s * 1e6 for s in STAGE["seconds"])
        out["stage"] = {
            "calls": STAGE["calls"],
            "us_median": round(statistics.median(us), 1),
            "us_p90": round(us[int(0.9 * (len(us) - 1))], 1),
            "us_max": round(us[-1], 1),
            "tokens_max": max(STAGE["tokens"]),
            "calls_over_64_tokens": sum(t > 64 for t in STAGE["tokens"]),
        }
    if LOOKUP["calls"]:
        us = sorted(s * 1e6 for s in LOOKUP["seconds"])
        out["lookup"] = {
            "calls": LOOKUP["calls"],
            "us_median": round(statistics.median(us), 1),
            "us_p90": round(us[int(0.9 * (len(us) - 1))], 1),
            "us_max": round(us[-1], 1),
        }
    return out


def spec_metrics(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        name = metric.name
        if name == "vllm:spec_decode_num_drafts":
            out["drafts"] = metric.value
        elif name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] = metric.value
        elif name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] = metric.value
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] = list(metric.values)
    return out


def metrics_delta(before: dict, after: dict) -> dict:
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("drafts", "draft_tokens", "accepted")}
    pos_after, pos_before = after.get("per_pos", []), before.get("per_pos", [])
    d["accepted_per_pos"] = [a - (pos_before[i] if i < len(pos_before) else 0) for i, a in enumerate(pos_after)]
    if d["drafts"]:
        d["acceptance_rate"] = round(d["accepted"] / max(d["draft_tokens"], 1), 4)
        d["mean_acceptance_length"] = round(1 + d["accepted"] / d["drafts"], 4)
        d["acceptance_per_pos"] = [round(a / d["drafts"], 4) for a in d["accepted_per_pos"]]
    return d


def llm_kwargs(cfg: dict, model_dir: str) -> dict:
    compile_modes = {
        "eager": {"enforce_eager": True},
        "fdo": {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}},
        "fp": {"compilation_config": {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}},
        "pw": {"compilation_config": {"mode": 3, "cudagraph_mode": "PIECEWISE"}},
        "full": {"compilation_config": {"mode": 3, "cudagraph_mode": "FULL"}},
    }
    kw = {
        "model": model_dir,
        "dtype": "bfloat16",
        "max_model_len": cfg.get("max_model_len", 1024),
        "gpu_memory_utilization": cfg.get("gpu_memory_utilization", 0.3),
        "max_num_seqs": cfg.get("max_num_seqs", 8),
        "seed": 0,
        "disable_log_stats": False,
    }
    if cfg.get("device", "cuda") == "cuda":
        kw["additional_config"] = {"gdn_prefill_backend": "triton"}
        kw["attention_config"] = {"backend": cfg.get("attention", "TRITON_ATTN")}
    kw.update(compile_modes[cfg["compile"]])
    if cfg.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = cfg["max_num_batched_tokens"]
    if cfg.get("mtp"):
        spec = {"method": "mtp", "num_speculative_tokens": cfg["mtp"]}
        if cfg.get("keep"):
            spec["draft_vocab_path"] = str(Path(os.environ["GPUH_MODELS"]) / "keep" / f"{cfg['keep']}.npy")
        if cfg.get("draft_quant"):
            spec["draft_lm_head_quantization"] = cfg["draft_quant"]
        kw["speculative_config"] = spec
    if cfg.get("hf_overrides"):
        kw["hf_overrides"] = cfg["hf_overrides"]
    kw.update(cfg.get("llm_extra", {}))
    return kw


def check_greedy_increment(llm, cfg: dict) -> dict:
    from vllm import SamplingParams

    n = models.GREEDY_TOKENS
    prompts = [{"prompt_token_ids": list(range(s, s + 5 + i))} for i, s in enumerate(models.GREEDY_STARTS)]
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    llm.generate(prompts[:2], sp, use_tqdm=False)
    before = spec_metrics(llm)
    reset_counts()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    ids = [list(o.outputs[0].token_ids) for o in outs]
    exact = sum(
        got == [(p["prompt_token_ids"][-1] + 1 + k) for k in range(n)] for p, got in zip(prompts, ids, strict=False)
    )
    return {
        "exact": f"{exact}/{len(prompts)}",
        "exact_all": exact == len(prompts),
        "ids": ids,
        "seconds": round(seconds, 3),
        "spec": metrics_delta(before, spec_metrics(llm)),
        "counts": snapshot_counts(),
    }


def check_sampling(llm, cfg: dict) -> dict:
    from vllm import SamplingParams

    n, count = cfg.get("sample_tokens", 128), cfg.get("sample_prompts", 64)
    prompts = [{"prompt_token_ids": list(range(100 + 60 * i, 106 + 60 * i))} for i in range(count)]

    def run(seed0):
        sps = [SamplingParams(temperature=0.7, seed=seed0 + i, max_tokens=n, ignore_eos=True) for i in range(count)]
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sps, use_tqdm=False)]

    run(50_000)  # warm-up
    before = spec_metrics(llm)
    reset_counts()
    a = run(0)
    spec = metrics_delta(before, spec_metrics(llm))
    counts = snapshot_counts()
    a2 = run(0)
    b = run(10_000) if cfg.get("second_seed_run") else None
    return {
        "prompts_last_ids": [p["prompt_token_ids"][-1] for p in prompts],
        "ids_seed0": a,
        "ids_seed10000": b,
        "same_seed_same_text_in_process": a == a2,
        "spec": spec,
        "counts": counts,
    }


def _kernel_table(trace_path: str, steps: int) -> dict:
    import gzip

    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    total = collections.Counter()
    calls = collections.Counter()
    for e in kernels:
        key = e["name"][:90] + " grid" + str(e.get("args", {}).get("grid", ""))
        total[key] += e.get("dur", 0)
        calls[key] += 1
    top = [
        {"kernel": k, "calls": calls[k], "us_total": round(v, 1), "us_per_step": round(v / max(steps, 1), 2)}
        for k, v in total.most_common(12)
    ]
    return {"kernels": len(kernels), "gpu_us_per_step": round(sum(total.values()) / max(steps, 1), 1), "top": top}


def check_speed(llm, cfg: dict) -> dict:
    from vllm import SamplingParams

    n = cfg.get("decode_tokens", 256)
    out: dict = {"decode_tokens": n}
    for c in cfg.get("concurrency", (1, 4)):
        prompts = [{"prompt_token_ids": list(range(s, s + 8))} for s in models.BIG_STARTS[:c]]
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        full = SamplingParams(temperature=0.0, max_tokens=n + 1, ignore_eos=True)
        llm.generate(prompts, full, use_tqdm=False)
        before = spec_metrics(llm)
        decode = []
        for _ in range(cfg.get("reps", 3)):
            t0 = time.perf_counter()
            llm.generate(prompts, one, use_tqdm=False)
            t1 = time.perf_counter()
            outs = llm.generate(prompts, full, use_tqdm=False)
            t2 = time.perf_counter()
            decode.append((t2 - t1) - (t1 - t0))
        ids = [list(o.outputs[0].token_ids) for o in outs]
        exact = sum(
            got == [p["prompt_token_ids"][-1] + 1 + k for k in range(n + 1)]
            for p, got in zip(prompts, ids, strict=False)
        )
        med = statistics.median(decode)
        out[f"c{c}"] = {
            "decode_seconds": [round(x, 4) for x in decode],
            "decode_tok_s": round(c * n / med, 1),
            "decode_tok_s_range": [round(c * n / max(decode), 1), round(c * n / min(decode), 1)],
            "exact": f"{exact}/{c}",
            "spec": metrics_delta(before, spec_metrics(llm)),
        }
    if cfg.get("profile"):
        try:
            out["profile"] = profile_decode(llm, cfg)
        except Exception as exc:  # the speeds stand without the profile
            out["profile_error"] = repr(exc)[:1000]
    return out


def profile_decode(llm, cfg: dict) -> dict:
    """Kernels of a c=1 decode window under torch.profiler (CUPTI sees kernels replayed inside
    CUDA graphs): per decode step, and the top kernels, for the side-by-side head comparison."""
    import torch
    from vllm import SamplingParams

    n = cfg.get("profile_tokens", 64)
    prompt = [{"prompt_token_ids": list(range(models.BIG_STARTS[0], models.BIG_STARTS[0] + 8))}]
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    llm.generate(prompt, sp, use_tqdm=False)
    before = spec_metrics(llm)
    reset_counts()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    # trace: as vLLM's own profiler records (with_stack, record_shapes), gzipped into $OUT for
    # `magpie trace-split` (its step anchors are the engine's Python function events).
    stack = bool(cfg.get("trace"))
    with torch.profiler.profile(activities=acts, with_stack=stack, record_shapes=stack) as prof:
        llm.generate(prompt, sp, use_tqdm=False)
        torch.cuda.synchronize()
    spec = metrics_delta(before, spec_metrics(llm))
    steps = sum(COUNTS["steps"].values())
    folder = Path(os.environ.get("OUT") or "/tmp/gpuh") if stack else Path("/tmp/gpuh")
    path = str(folder / (f"{cfg['name']}.pt.trace.json.gz" if stack else f"trace-{cfg['name']}.json"))
    prof.export_chrome_trace(path)
    table = _kernel_table(path, steps)
    table.update(decode_steps=steps, spec=spec, counts=snapshot_counts())
    if stack:
        table["trace"] = Path(path).name
    return table


def check_ple(llm, cfg: dict) -> dict:
    """Greedy ids of prompts long enough for chunked prefill (> 64 tokens a chunk) while other
    requests decode; the stage() counts against forwards; RSS and the shard mappings' flags."""
    from vllm import SamplingParams

    prompts = []
    for i in range(cfg.get("ple_prompts", 6)):
        length = 8 + 150 * (i % 3)  # 8, 158, 308 tokens: long ones are prefilled in chunks
        prompts.append({"prompt_token_ids": [(17 * i + 31 * j) % 4000 + 3 for j in range(length)]})
    sp = SamplingParams(temperature=0.0, max_tokens=cfg.get("ple_tokens", 48), ignore_eos=True)
    llm.generate(prompts[:1], sp, use_tqdm=False)
    before = spec_metrics(llm)
    reset_counts()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    result = {
        "ids": [list(o.outputs[0].token_ids) for o in outs],
        "seconds": round(seconds, 3),
        "spec": metrics_delta(before, spec_metrics(llm)),
        "counts": snapshot_counts(),
        "memory": proc_memory(cfg.get("table_glob", "model-")),
    }
    if cfg.get("profile"):
        try:
            result["profile"] = profile_ple(llm, cfg, prompts)
        except Exception as exc:  # the ids and counts stand without the trace
            result["profile_error"] = repr(exc)[:1000]
    return result


def profile_ple(llm, cfg: dict, prompts: list[dict]) -> dict:
    """A few engine steps under torch.profiler, recorded as vLLM's own profiler records them
    (CPU + CUDA activity, `with_stack=True`, `record_shapes=True`): the 8- and the 158-token
    prompt (a 128-token chunk beside the short one's prefill, the rest of the chunk beside a
    decode, then decode steps), written gzipped to $OUT for `magpie trace-split`."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    window = prompts[:2]
    sp = SamplingParams(temperature=0.0, max_tokens=cfg.get("profile_tokens", 8), ignore_eos=True)
    reset_counts()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True, record_shapes=True) as prof:
        outs = llm.generate(window, sp, use_tqdm=False)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    counts = snapshot_counts()
    folder = Path(os.environ.get("OUT") or "/tmp/gpuh")  # $OUT: the call brings it back
    path = folder / f"{cfg['name']}.pt.trace.json.gz"
    t0 = time.perf_counter()
    prof.export_chrome_trace(str(path))
    return {
        "trace": path.name,
        "bytes": path.stat().st_size,
        "profiled_s": round(seconds, 3),
        "export_s": round(time.perf_counter() - t0, 1),
        "prompt_tokens": [len(p["prompt_token_ids"]) for p in window],
        "ids": [list(o.outputs[0].token_ids) for o in outs],
        "counts": counts,
    }


def proc_memory(file_marker: str) -> dict:
    status = Path("/proc/self/status").read_text().splitlines()
    mem = {line.split(":")[0]: line.split(":")[1].strip() for line in status if line.startswith(("Rss", "VmRSS"))}
    maps, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        parts = line.split()
        if parts and "-" in parts[0] and len(parts) >= 5 and not line.startswith(("VmFlags", " ")):
            current = {"path": parts[5] if len(parts) > 5 else "", "range": parts[0]}
        elif line.startswith("Rss:") and current is not None:
            current["rss_kb"] = int(parts[1])
        elif line.startswith("VmFlags:") and current is not None:
            current["flags"] = parts[1:]
            if file_marker in current["path"] and current["path"].endswith(".safetensors"):
                maps.append(current)
            current = None
    mem["safetensors_mappings"] = len(maps)
    mem["mappings_with_rr"] = sum("rr" in m["flags"] for m in maps)
    mem["safetensors_rss_kb"] = sum(m.get("rss_kb", 0) for m in maps)
    return mem


def _block_sectors_read() -> int:
    """Sectors (512 B) read from every whole block device (/sys/block/*/stat, field 3): what the
    disk served, whoever asked: in this VM the worker's own counters missed mapped-file reads."""
    total = 0
    for stat in Path("/sys/block").glob("*/stat"):
        if stat.parent.name.startswith(("loop", "ram", "zram")):
            continue
        try:
            total += int(stat.read_text().split()[2])
        except (OSError, IndexError, ValueError):
            continue
    return total


def io_counters() -> dict:
    """Storage reads as every layer sees them: this process's bytes read from storage
    (/proc/self/io read_bytes; preads of upstream's reader land here), bytes read through
    read(2)-like calls (rchar), its major / minor page faults (/proc/self/stat); the machine's
    pages paged in and major faults (/proc/vmstat pgpgin in KiB, pgmajfault: mapped-file faults
    land here); the block devices' bytes read; and, in a memory cgroup, its file refaults (a page
    read again after the cgroup's bound evicted it) and major faults (memory.stat)."""
    io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    vmstat = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    out = {
        "read_bytes": int(io["read_bytes"]),
        "rchar": int(io["rchar"]),
        "minflt": int(stat[7]),
        "majflt": int(stat[9]),
        "vm_pgpgin_kib": int(vmstat.get("pgpgin", 0)),
        "vm_pgmajfault": int(vmstat.get("pgmajfault", 0)),
        "block_read_bytes": 512 * _block_sectors_read(),
    }
    group = cgroup_memory()
    if group:
        for key in ("workingset_refault_file", "pgmajfault"):
            if key in group:
                out[f"cgroup_{key}"] = group[key]
    return out


def cgroup_memory() -> dict | None:
    """The limit of this process's memory cgroup and the page cache ("file" / v1 "cache") it
    holds: cgroup v2 where this process sits in one with a memory controller, else v1."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        v2 = Path("/sys/fs/cgroup") / rel.lstrip("/")
        if controllers == "" and (v2 / "memory.max").exists() and rel != "/":
            names = {"limit": "memory.max", "current": "memory.current", "peak": "memory.peak"}
            folder, version = v2, 2
            break
        if "memory" in controllers.split(","):
            names = {
                "limit": "memory.limit_in_bytes",
                "current": "memory.usage_in_bytes",
                "peak": "memory.max_usage_in_bytes",
            }
            folder, version = Path("/sys/fs/cgroup/memory") / rel.lstrip("/"), 1
            break
    else:
        return None
    try:
        out: dict = {"cgroup": str(folder), "version": version}
        for key, name in names.items():
            if (folder / name).exists():
                out[key] = (folder / name).read_text().strip()
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
        keep = (
            "anon",
            "file",
            "file_mapped",
            "active_file",
            "inactive_file",
            "rss",
            "cache",
            "mapped_file",
            "workingset_refault_file",
            "pgmajfault",
        )
        out.update({k: int(stat[k]) for k in keep if k in stat})
        return out
    except (OSError, ValueError):
        return None


def _percentiles(values: list[float]) -> dict:
    us = sorted(v * 1e6 for v in values)
    if not us:
        return {}
    return {
        "calls": len(us),
        "us_p50": round(us[len(us) // 2], 1),
        "us_p99": round(us[min(len(us) - 1, int(0.99 * len(us)))], 1),
        "us_max": round(us[-1], 1),
    }


def ple_scale_prompts(kind: str, count: int, length: int = 64) -> list[dict]:
    """`distinct`: every prompt's ids different (ids i, i + 7, ...): every n-gram new, the worst
    case; `repeated`: a 16-token phrase said length / 16 times, the n-grams reused as in real text."""
    if kind == "distinct":
        return [{"prompt_token_ids": [(300 + 997 * i + 7 * j) % 4000 + 3 for j in range(length)]} for i in range(count)]
    return [
        {"prompt_token_ids": [(50 + 13 * i + 5 * j) % 4000 + 3 for j in range(16)] * (length // 16)}
        for i in range(count)
    ]


def check_ple_scale(llm, cfg: dict) -> dict:
    """Decode tok/s at c = 1 and 4, for distinct and repeated prompts, each decoded greedily (this
    random-weight model soon repeats a token: its n-grams, and so its table rows, recur: the best
    case) and sampled at temperature 1 with fixed seeds (a new random token each step: nearly
    every n-gram new, the worst case). A short warm-up on other prompts first (JIT, graphs), then
    the runs in that order. Per run: the prefill call's and the decode window's bytes read from
    storage and page faults, per decode step the stage() p50/p99; the ids; after each prompt
    kind the table's share in the page cache (mincore over the shards' byte ranges)."""
    from vllm import SamplingParams

    from magpie.serving import ple_warmup

    model_dir = str(Path(os.environ["GPUH_MODELS"]) / cfg["model"])
    ranges = ple_warmup.table_ranges(model_dir, ple_warmup.DEFAULT_PATTERN)
    n = cfg.get("decode_tokens", 128)
    concurrency = cfg.get("concurrency", (1, 4))
    fill = None
    if cfg.get("fill_table_gib"):
        # A bounded cache must be full before the decode window, or nothing is evicted and the
        # bound is never met: read that many GiB of the table inside this process's cgroup first.
        fill = ple_warmup.warm(ranges, int(cfg["fill_table_gib"] * 1024**3), 0, 1 << 20, True)
        fill["cgroup_after"] = cgroup_memory()
    warm = [{"prompt_token_ids": [3900 + 11 * i + j for j in range(16)]} for i in range(max(concurrency))]
    for c in concurrency:
        llm.generate(warm[:c], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    runs, ids, residency = {}, {}, {}
    for kind in ("distinct", "repeated"):
        for mode in ("greedy", "sampled"):
            for c in concurrency:
                prompts = ple_scale_prompts(kind, c)

                def params(tokens, mode=mode, c=c):
                    if mode == "greedy":
                        return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
                    return [
                        SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=tokens, ignore_eos=True)
                        for i in range(c)
                    ]

                io0 = io_counters()
                t0 = time.perf_counter()
                llm.generate(prompts, params(1), use_tqdm=False)
                t1 = time.perf_counter()
                io1 = io_counters()
                reset_counts()
                outs = llm.generate(prompts, params(n + 1), use_tqdm=False)
                t2 = time.perf_counter()
                io2 = io_counters()
                steps = max(sum(COUNTS["steps"].values()), 1)
                decode_s = (t2 - t1) - (t1 - t0)
                name = f"{kind}-{mode}-c{c}"
                runs[name] = {
                    "decode_tok_s": round(c * n / decode_s, 1) if decode_s > 0 else None,
                    "prefill_s": round(t1 - t0, 4),
                    "window_s": round(t2 - t1, 3),
                    "steps": dict(COUNTS["steps"]),
                    "replays": dict(COUNTS["replays"]),
                    "stage": _percentiles(STAGE["seconds"]),
                    "prefill_call": {k: io1[k] - io0[k] for k in io0},
                    "per_step": {k: round((io2[k] - io1[k]) / steps, 1) for k in io0},
                    "window": {k: io2[k] - io1[k] for k in io0},
                }
                ids[name] = [list(o.outputs[0].token_ids) for o in outs]
        t0 = time.perf_counter()
        residency[kind] = ple_warmup.status(ranges)
        residency[kind]["mincore_s"] = round(time.perf_counter() - t0, 2)
    long_prompt = None
    if cfg.get("long_prompt_tokens"):
        # TTFT of one long prompt: its prefill is staged in chunks of max_num_batched_tokens.
        length = cfg["long_prompt_tokens"]
        prompt = {"prompt_token_ids": [(17 + 31 * j) % 4000 + 3 for j in range(length)]}
        reset_counts()
        io0 = io_counters()
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        ttft = time.perf_counter() - t0
        io1 = io_counters()
        long_prompt = {
            "tokens": length,
            "ttft_s": round(ttft, 4),
            "stage": _percentiles(STAGE["seconds"]),
            "stage_tokens_max": max(STAGE["tokens"], default=0),
            "io": {k: io1[k] - io0[k] for k in io0},
        }
    return {
        "decode_tokens": n,
        "fill": fill,
        "long_prompt": long_prompt,
        "runs": runs,
        "ids": ids,
        "distinct_ids_per_run": {k: [len(set(x)) for x in v] for k, v in ids.items()},
        "table_residency_after": residency,
        "memory": proc_memory(cfg.get("table_glob", "model-")),
        "cgroup": cgroup_memory(),
    }


CHECKS = {
    "greedy_increment": check_greedy_increment,
    "sampling": check_sampling,
    "speed": check_speed,
    "ple": check_ple,
    "ple_scale": check_ple_scale,
}


# vLLM 0.34.0's CUDA kernel warm-up imports the MiniMax M3 warm-up module unconditionally, which
# imports CuTe DSL (`cutlass`, nvidia-cutlass-dsl: too large to come to the lent machine) at
# module level; its function returns at once for a model without MiniMax M3 sparse attention.
MINIMAX_WARMUP = "vllm.model_executor.warmup.minimax_m3_msa_warmup"


def skip_unneeded_warmups() -> list[str]:
    """Where CuTe DSL is absent, stand in for the MiniMax M3 warm-up module with one whose
    function does nothing (what upstream's does for every other model). Returns what it did."""
    import importlib.util
    import types

    if importlib.util.find_spec("cutlass") is not None:
        return []
    try:
        if importlib.util.find_spec(MINIMAX_WARMUP) is None:
            return []
    except ModuleNotFoundError:
        return []
    stand_in = types.ModuleType(MINIMAX_WARMUP)
    stand_in.minimax_m3_msa_warmup = lambda worker: None
    sys.modules[MINIMAX_WARMUP] = stand_in
    return [f"{MINIMAX_WARMUP}: no-op (no cutlass; not a MiniMax M3 model)"]


QWEN4EXP_HC = "vllm.models.qwen4_exp.nvidia.hyperconnection"
QWEN4EXP_MODEL = "vllm.models.qwen4_exp.nvidia.model"
QWEN4EXP_FUSED = "vllm.models.qwen4_exp.nvidia.ops.cute_dsl.hc_down_silu"


def unfused_hc_down_without_cutedsl() -> list[str]:
    """Where CuTe DSL is absent, keep vLLM 0.34's CUDA Qwen4Exp on its own unfused path for the
    hyper-connection's down projection + SiLU (the merged linear, split, then hc_silu: what it runs
    above its fused kernel's token range or batch-invariant), instead of JIT-compiling the fused
    CuTe DSL kernel at warm-up (which imports `cutlass`). Returns what it did."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("cutlass") is not None:
        return []
    try:  # the fused kernel's module: 0.34 on; 0.29's Qwen4Exp has the layer without it
        if importlib.util.find_spec(QWEN4EXP_FUSED) is None:
            return []
    except ModuleNotFoundError:
        return []
    hc = importlib.import_module(QWEN4EXP_HC)
    model = importlib.import_module(QWEN4EXP_MODEL)
    original = hc.GatedResidual.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if hasattr(self, "_use_hc_down_silu"):
            self._use_hc_down_silu = False

    hc.GatedResidual.__init__ = init
    model.request_hc_down_silu_warmup = lambda *args, **kwargs: None
    return [f"{QWEN4EXP_HC}.GatedResidual: unfused down+SiLU (no cutlass for the CuTe DSL kernel)"]


def main(argv: list[str]) -> int:
    cfg = json.loads(Path(argv[0]).read_text())
    info: dict = {"config": cfg["name"], "about": cfg.get("about"), "compare_to": cfg.get("compare_to"), "ok": False}
    try:
        info["hooks"] = install_hooks()
        info["stand_ins"] = skip_unneeded_warmups() + unfused_hc_down_without_cutedsl()
        import torch
        import vllm
        from vllm import LLM

        info["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
        if torch.cuda.is_available():
            info["versions"]["device"] = torch.cuda.get_device_name(0)
        model_dir = str(Path(os.environ["GPUH_MODELS"]) / cfg["model"])
        kw = llm_kwargs(cfg, model_dir)
        info["llm_kwargs"] = kw
        t0 = time.perf_counter()
        llm = LLM(**kw)
        info["init_s"] = round(time.perf_counter() - t0, 1)
        vc = llm.llm_engine.vllm_config
        cc = vc.compilation_config
        info["engine"] = {
            "v2_model_runner": getattr(vc, "use_v2_model_runner", None),
            "cudagraph_mode": str(cc.cudagraph_mode),
            "compile_mode": str(cc.mode),
            "capture_sizes": cc.cudagraph_capture_sizes,
            "attention_backend": str(getattr(getattr(vc, "attention_config", None), "backend", None)),
        }
        info["capture_counts"] = snapshot_counts()
        for check in cfg["checks"]:
            t0 = time.perf_counter()
            info[check] = CHECKS[check](llm, cfg)
            info[check]["check_s"] = round(time.perf_counter() - t0, 1)
        info["ok"] = True
    except Exception as exc:
        info["error"] = repr(exc)[:2000]
        info["traceback"] = traceback.format_exc()[-4000:]
    print("RESULT " + json.dumps(info), flush=True)
    return 0 if info["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
