"""The harness's configurations: one dict = one vLLM process (worker.py).

Fields: name; about; model (folder under the staged models); compile (eager | fdo = mode 0 +
FULL_DECODE_ONLY | fp = torch.compile mode 3 + FULL_AND_PIECEWISE | pw | full); mtp (draft
tokens); keep (keep-set name, models.keep_sets); checks (worker.CHECKS); compare_to (the
configuration whose outputs this one must reproduce); timeout_s; env; hf_overrides; draft_quant
(the drafter head's draft_lm_head_quantization: fp8 | nvfp4, vLLM 0.33+); min_release (the oldest
vLLM release the configuration runs on: `run` skips it on an older staged release); reps (decode
windows per concurrency in the speed check, median and range reported); ...
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from magpie import releases


def _inc(name, compile_, keep=None, about="", **extra):
    cfg = {
        "name": name,
        "about": about,
        "model": "inc",
        "compile": compile_,
        "mtp": 3,
        "keep": keep,
        "checks": ["greedy_increment"],
        "timeout_s": 150,
        "max_num_seqs": 8,
    }
    cfg.update(extra)
    return cfg


MTP = [
    _inc("inc-fdo-base", "fdo", None, "unpruned, mode 0 + FULL_DECODE_ONLY (first process: JIT)", timeout_s=330),
    _inc("inc-fdo-cover", "fdo", "cover", "4,000 of 4,096 ids, covering every id used", compare_to="inc-fdo-base"),
    _inc("inc-fdo-miss", "fdo", "miss", "259 ids, none of them used: every draft misses", compare_to="inc-fdo-base"),
    _inc(
        "inc-fdo-even",
        "fdo",
        "even",
        "even ids only: position 0 accepted once a request is in step (after at most one miss), 1+ never",
        compare_to="inc-fdo-base",
    ),
    {
        "name": "big-fp-base",
        "about": "248,320 ids, hidden 2560, unpruned, compiled FULL_AND_PIECEWISE: decode tok/s c=1, c=4",
        "model": "big",
        "compile": "fp",
        "mtp": 3,
        "keep": None,
        "checks": ["speed"],
        "profile": True,
        "max_num_seqs": 4,
        "timeout_s": 200,
        "min_s": 90,
    },
    {
        "name": "big-fp-k10k",
        "about": "the same with a 10,000-id keep-set (every continuation inside it)",
        "model": "big",
        "compile": "fp",
        "mtp": 3,
        "keep": "big10k",
        "checks": ["speed"],
        "profile": True,
        "max_num_seqs": 4,
        "timeout_s": 200,
        "min_s": 90,
        "compare_to": "big-fp-base",
    },
    {
        "name": "soft-fdo-base",
        "about": "temperature 0.7, fixed seeds, unpruned (and a second seed set: the noise floor)",
        "model": "soft",
        "compile": "fdo",
        "mtp": 3,
        "keep": None,
        "checks": ["sampling"],
        "second_seed_run": True,
        "max_num_seqs": 64,
        "timeout_s": 150,
    },
    {
        "name": "soft-fdo-allbut0",
        "about": "every id but 0: the unpruned drafts (but after a 4095): the same seed must give the same text",
        "model": "soft",
        "compile": "fdo",
        "mtp": 3,
        "keep": "allbut0",
        "checks": ["sampling"],
        "max_num_seqs": 64,
        "timeout_s": 150,
        "compare_to": "soft-fdo-base",
    },
    {
        "name": "soft-fdo-even",
        "about": "keep-set = even ids: other drafts, the same output distribution (frequency test)",
        "model": "soft",
        "compile": "fdo",
        "mtp": 3,
        "keep": "even",
        "checks": ["sampling"],
        "max_num_seqs": 64,
        "timeout_s": 150,
        "compare_to": "soft-fdo-base",
    },
    _inc(
        "inc-fp-base",
        "fp",
        None,
        "unpruned, torch.compile + FULL_AND_PIECEWISE (the first compiled process of the model: compile)",
        compare_to="inc-fdo-base",
        timeout_s=300,
        min_s=150,
    ),
    _inc("inc-fp-cover", "fp", "cover", "cover keep-set, compiled", compare_to="inc-fp-base"),
    _inc("inc-fp-miss", "fp", "miss", "miss keep-set, compiled", compare_to="inc-fp-base"),
]


def _ple(name, compile_, mmap, about, env=None, **extra):
    cfg = {
        "name": name,
        "about": about,
        "model": "q4e",
        "compile": compile_,
        "mtp": None,
        "keep": None,
        "checks": ["ple"],
        "max_num_seqs": 8,
        "max_num_batched_tokens": 128,
        "max_model_len": 1024,
        # A configuration's first Qwen4Exp process took 143-186 s on the H200 (2026-12-01: ~100 s of
        # it the profile run compiling that graph's Inductor kernels), a rerun 45-75 s; one started
        # with less left than that is lost (q4e-mmap1-pw was, with 119 s left).
        "timeout_s": 260,
        "min_s": 190,
        "gpu_memory_utilization": 0.3,
        "hf_overrides": {"ple_mmap": True} if mmap else None,
        "env": env or {},
        "llm_extra": {"enable_prefix_caching": False, "language_model_only": True, "moe_backend": "triton"},
    }
    cfg.update(extra)
    return cfg


PLE = [
    _ple("q4e-resident-fp", "fp", False, "resident table (stock path), FULL_AND_PIECEWISE (first: JIT)", timeout_s=330),
    _ple(
        "q4e-mmap12-fp",
        "fp",
        True,
        "ple_mmap, 0001+0002: FULL_AND_PIECEWISE kept, rows staged before the forward (+ a torch-profiler trace)",
        compare_to="q4e-resident-fp",
        profile=True,
    ),
    _ple(
        "q4e-mmap1-pw",
        "fp",
        True,
        "ple_mmap, 0001 alone: cudagraph mode forced to PIECEWISE",
        site="site-0001",
        compare_to="q4e-resident-pw",
    ),
    _ple("q4e-resident-pw", "pw", False, "resident table, PIECEWISE: the reference of 0001 alone"),
    _ple(
        "q4e-mmap12-fp-mtp",
        "fp",
        True,
        "ple_mmap 0001+0002 with the checkpoint's MTP layer drafting (k=1)",
        mtp=1,
        compare_to="q4e-mmap12-fp",
    ),
]


def _scale(name, keep, about, **extra):
    cfg = {
        "name": name,
        "about": about,
        "model": "scale",
        "compile": "fp",
        "mtp": 3,
        "keep": keep,
        "checks": ["speed"],
        "profile": True,
        "trace": True,
        "max_num_seqs": 4,
        "gpu_memory_utilization": 0.4,
        "timeout_s": 300,
        "min_s": 150,
    }
    cfg.update(extra)
    return cfg


# Issue 18: the draft head where it is a real share of a GPU-bound decode step (models.SCALE_*).
# Issue 29 adds upstream's own speed-up beside it, the drafter's head in fp8
# (draft_lm_head_quantization, vLLM 0.33+; nvfp4 needs a Blackwell GPU, the H200 has none), and the
# pruned head quantized (mtp_pruning 0002). Every one: 5 decode windows per concurrency (median and
# range), greedy ids equal to the unpruned bf16 run's.
SCALE = [
    _scale(
        "scale-fp-base",
        None,
        "64 real-size layers at hidden 2560, 248,320 ids, unpruned, compiled FULL_AND_PIECEWISE (first: compile)",
        timeout_s=420,
        min_s=300,
        reps=5,
    ),
    _scale(
        "scale-fp-k10k",
        "big10k",
        "the same with the 10,000-id keep-set (every continuation inside it)",
        compare_to="scale-fp-base",
        reps=5,
    ),
    _scale(
        "scale-fp-base-fp8",
        None,
        "unpruned, the drafter's head an fp8 copy of the target's (draft_lm_head_quantization: upstream's speed-up)",
        compare_to="scale-fp-base",
        draft_quant="fp8",
        min_release="0.33.0",
        reps=5,
    ),
    _scale(
        "scale-fp-k10k-fp8",
        "big10k",
        "the 10,000-id pruned head quantized to fp8 (mtp_pruning 0002)",
        compare_to="scale-fp-base",
        draft_quant="fp8",
        min_release="0.33.0",
        reps=5,
    ),
]

# Issue 18: a 17.4 GB table (16 heads x a prime above 3.4 M rows, 128 shards in 4 files), four
# times the page cache the bounded configuration gets (a cgroup v2 memory.max: gpu_harness.py).
PLE_SCALE_TABLE_BASE = 3_400_000


def _ple_scale(name, mmap, about, **extra):
    return _ple(
        name,
        "fdo",
        mmap,
        about,
        model="q4e16",
        checks=["ple_scale"],
        max_num_batched_tokens=None,
        gpu_memory_utilization=0.35,
        timeout_s=300,
        min_s=200,
        **extra,
    )


PLE_SCALE = [
    _ple_scale("q4e16-resident", False, "17.4 GB table resident in GPU memory (stock path): the reference"),
    _ple_scale(
        "q4e16-mmap-warm",
        True,
        "ple_mmap 0001+0002, the table's pages in the page cache (the resident run read them)",
        compare_to="q4e16-resident",
    ),
    _ple_scale(
        "q4e16-mmap-bound",
        True,
        "ple_mmap, table evicted first, the worker in a cgroup whose memory.max leaves a quarter of the "
        "table for the page cache (the GB10 case)",
        compare_to="q4e16-resident",
        evict_table=True,
        page_cache_fraction=0.25,
        bound_after="q4e16-mmap-warm",
    ),
]


# Issue 30: vLLM 0.34.0's own Engram disk_offload (one os.preadv per row) against the same with
# ple_ssd 0.34 0001's disk_offload_gather (rows gathered from mapped shards), on the 17.4 GB table:
# warm, cold (evicted first) and bounded (a cgroup leaving a quarter of the table to the page
# cache, filled before the decode window); each also times one 16,384-token prompt's TTFT; token
# ids compared with the GPU-resident table's run (cpu_offload false).
def _ple_scale_034(name, engram, about, **extra):
    # _ple_scale's fields, with room for the long prompt and its upstream staging.
    cfg = _ple(
        name,
        "fdo",
        False,
        about,
        model="q4e16",
        checks=["ple_scale"],
        max_num_batched_tokens=None,
        gpu_memory_utilization=0.35,
        min_release="0.34.0",
        max_model_len=17_408,
        timeout_s=480,
        min_s=300,
        **extra,
    )
    cfg["llm_extra"] = {**cfg["llm_extra"], "engram_config": engram}
    return cfg


_DISK_034 = {"disk_offload": True}
_GATHER_034 = {"disk_offload": True, "disk_offload_gather": True}
PLE_SCALE_034 = [
    _ple_scale_034(
        "q4e16-034-resident",
        {"cpu_offload": False},
        "17.4 GB table resident in GPU memory: the reference",
        long_prompt_tokens=16_384,
    ),
    *(
        _ple_scale_034(
            f"q4e16-034-{kind}-warm",
            engram,
            f"{what}, the table's pages in the page cache",
            compare_to="q4e16-034-resident",
            long_prompt_tokens=16_384,
        )
        for kind, engram, what in (
            ("disk", _DISK_034, "upstream disk_offload (a preadv per row)"),
            ("gather", _GATHER_034, "disk_offload + disk_offload_gather (ple_ssd 0.34 0001)"),
        )
    ),
    *(
        _ple_scale_034(
            f"q4e16-034-{kind}-cold",
            engram,
            f"{what}, the table evicted first",
            compare_to="q4e16-034-resident",
            long_prompt_tokens=16_384,
            evict_table=True,
        )
        for kind, engram, what in (
            ("disk", _DISK_034, "upstream disk_offload"),
            ("gather", _GATHER_034, "disk_offload_gather"),
        )
    ),
    *(
        _ple_scale_034(
            f"q4e16-034-{kind}-bound",
            engram,
            f"{what}, table evicted, a cgroup memory.max leaving a quarter of the table to the page "
            "cache, 8 GiB of the table read first to fill it",
            compare_to="q4e16-034-resident",
            long_prompt_tokens=16_384,
            evict_table=True,
            page_cache_fraction=0.25,
            bound_after=f"q4e16-034-{kind}-warm",
            fill_table_gib=8,
        )
        for kind, engram, what in (
            ("disk", _DISK_034, "upstream disk_offload"),
            ("gather", _GATHER_034, "disk_offload_gather"),
        )
    ),
]
# The suites whose checkpoints prepare_models writes as another suite's.
MODELS_OF_SUITE = {"ple-scale-034": "ple-scale"}

SUITES = {"mtp": MTP, "ple": PLE, "scale": SCALE, "ple-scale": PLE_SCALE, "ple-scale-034": PLE_SCALE_034}


def not_on_release(cfg: dict, release: str) -> str | None:
    """Why CFG cannot run on vLLM RELEASE (the staged site's), or None."""
    oldest = cfg.get("min_release")
    if oldest and releases.key(release) < releases.key(oldest):
        return f"needs vLLM {oldest} or later (min_release), the staged site is {release}"
    if "VLLM_USE_V2_MODEL_RUNNER" in cfg.get("env", {}) and not releases.has_runner_switch(release):
        return (
            f"its env sets VLLM_USE_V2_MODEL_RUNNER, which vLLM {release} no longer has (only =1 is "
            "accepted, with a warning): drop it from the configuration's env"
        )
    return None


def prepare_models(suite: str, models_dir: Path) -> None:
    """Write the suite's large checkpoints on the GPU machine (they never travel)."""
    from magpie.gpu import models

    suite = MODELS_OF_SUITE.get(suite, suite)
    if suite == "mtp" and not (models_dir / "big" / "model.safetensors").exists():
        models.materialize_big(models_dir / "big-spec", models_dir / "big")
        print(f"[models] wrote {models_dir / 'big'}", flush=True)
    if suite == "scale" and not (models_dir / "scale" / "config.json").exists():
        t0 = time.time()
        models.materialize_scale(models_dir / "tokenizer", models_dir / "scale")
        print(f"[models] wrote {models_dir / 'scale'} in {time.time() - t0:.0f} s", flush=True)
    for name, table_base, wanted in (("q4e", None, "ple"), ("q4e16", PLE_SCALE_TABLE_BASE, "ple-scale")):
        if suite != wanted or (models_dir / name / "config.json").exists():
            continue
        import subprocess
        import sys

        from magpie import tool_env

        # In a child whose PYTHONPATH starts with the carried vLLM tree (its table layout).
        env = tool_env()
        env["PYTHONPATH"] = os.pathsep.join([str(models_dir.parent / "site"), env["PYTHONPATH"]])
        cmd = [sys.executable, "-m", "magpie.gpu.qwen4exp", str(models_dir / "q4e-spec"), str(models_dir / name)]
        t0 = time.time()
        subprocess.run(cmd + ([str(table_base)] if table_base else []), env=env, check=True)
        print(f"[models] wrote {models_dir / name} in {time.time() - t0:.0f} s", flush=True)
