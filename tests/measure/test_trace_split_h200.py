"""trace_split.py on a real GPU trace: torch.profiler inside vLLM 0.29.0 on an NVIDIA H200.

The fixture (tests/fixtures/h200-q4e-mmap12-fp-decode.pt.trace.json.gz, 0.4 MB) is 7 decode
steps cut by tests/measure/cut_h200_trace.py out of the trace the GPU harness recorded on
2026-12-01 (`magpie gpu-harness run --suite ple`, configuration q4e-mmap12-fp: the tiny
Qwen4Exp with the PLE table served by ple_ssd 0001 + 0002, FULL_AND_PIECEWISE, the V2 model
runner, `vllm.LLM` in-process with VLLM_ENABLE_V1_MULTIPROCESSING=0; torch 2.11.0+cu130,
CPU + CUDA activity, with_stack=True, record_shapes=True). Each decode step is one FULL CUDA
graph replay of the model (kernels with no host launch of their own), then the logits on the
host's eager path (the head's kernel launched inside LogitsProcessor), with ple_mmap's
`stage()` before the forward.

Every expected figure is computed here from the trace's own events by code that shares
nothing with the tool (an independent oracle): the steps from the EngineCore step calls, the
worker from the uniprocess executor's calls, the head's kernel from its correlation id and
the logits processor's `_get_logits` call around its launch.
"""

from __future__ import annotations

import collections
import gzip
import json
import re

import jsonschema
import pytest

from magpie.measure import trace_split
from tests.serving.helpers import MEASURE, REPO, run_tool

FIXTURE = REPO / "tests" / "fixtures" / "h200-q4e-mmap12-fp-decode.pt.trace.json.gz"
STEPS = 7


def _events() -> list[dict]:
    with gzip.open(FIXTURE, "rt") as f:
        return json.load(f)["traceEvents"]


def _python(events, pattern: str) -> list[dict]:
    regex = re.compile(pattern)
    return sorted(
        (e for e in events if e.get("cat") == "python_function" and regex.search(e["name"])), key=lambda e: e["ts"]
    )


def _union(spans) -> float:
    total, end = 0.0, None
    for lo, hi in sorted(spans):
        if end is None or lo > end:
            total, end = total + hi - lo, hi
        elif hi > end:
            total, end = total + hi - end, hi
    return total


def _clip(spans, lo, hi):
    return [(max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi]


@pytest.fixture(scope="module")
def oracle() -> dict:
    events = _events()
    anchors = _python(events, r"vllm/v1/engine/core\.py\(\d+\): step_with_batch_queue$")
    # The uniprocess executor's calls hold all the worker's work (gpu_worker, model runner).
    worker = _python(events, r"vllm/v1/executor/uniproc_executor\.py\(\d+\): (execute_model|sample_tokens|result)$")
    worker_spans = [(e["ts"], e["ts"] + e["dur"]) for e in worker]
    windows = [(a["ts"], b["ts"]) for a, b in zip(anchors, anchors[1:], strict=False)]
    last = anchors[-1]
    tail = max([last["ts"] + last["dur"]] + [b for a, b in worker_spans if a >= last["ts"]])
    windows.append((last["ts"], tail))
    kernels = [e for e in events if e.get("cat") == "kernel"]
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["name"] in ("cudaLaunchKernel", "cuLaunchKernelEx")
    }
    get_logits = _python(events, r"vllm/model_executor/layers/logits_processor\.py\(\d+\): _get_logits$")

    def in_logits(kernel) -> bool:
        launch = launches.get(kernel["args"].get("correlation"))
        return launch is not None and any(
            g["tid"] == launch["tid"] and g["ts"] <= launch["ts"] <= g["ts"] + g["dur"] for g in get_logits
        )

    stages = _python(events, r"vllm/models/qwen4_exp/ple_mmap\.py\(\d+\): stage$")
    steps = []
    per_name = collections.defaultdict(lambda: [0, 0.0])
    for lo, hi in windows:
        mine = [
            (k, max(k["ts"], lo), min(k["ts"] + k["dur"], hi))
            for k in kernels
            if k["ts"] + k["dur"] > lo and k["ts"] < hi
        ]
        spans = [(a, b) for _, a, b in mine]
        work = _clip(worker_spans, lo, hi)
        head = [(k, a, b) for k, a, b in mine if in_logits(k)]
        # cuBLAS's GEMV kernels: gemvx, and dot / reduce kernels over cublasGemvTensor operands.
        gemv = [(k, a, b) for k, a, b in mine if "gemv" in k["name"].lower() and not in_logits(k)]
        for k, a, b in mine:
            per_name[k["name"]][0] += 1
            per_name[k["name"]][1] += b - a
        steps.append(
            {
                "step_ms": (hi - lo) / 1000,
                "gpu_busy_ms": _union(spans) / 1000,
                "worker_uncovered_ms": (_union(work) - (_union(work) + _union(spans) - _union(work + spans))) / 1000,
                "head": head,
                "head_ms": sum(b - a for _, a, b in head) / 1000,
                "gemv_ms": sum(b - a for _, a, b in gemv) / 1000,
                "stage_ms": _union(_clip([(s["ts"], s["ts"] + s["dur"]) for s in stages], lo, hi)) / 1000,
                "replays": sum(1 for e in events if e.get("name") == "cudaGraphLaunch" and lo <= e["ts"] < hi),
            }
        )
    top = sorted(per_name.items(), key=lambda kv: -kv[1][1])[: trace_split.TOP_KERNELS]
    return {"anchors": anchors, "stages": stages, "steps": steps, "top": top}


@pytest.fixture(scope="module")
def split() -> dict:
    return trace_split.split(str(FIXTURE))


def test_the_in_process_engine_steps_are_found(split, oracle):
    """vllm.LLM in-process has no `_process_engine_step` loop: the steps are EngineCore's
    step_with_batch_queue calls (async scheduling), one CUDA-graph replay and one stage() each."""
    assert split["anchor"] == "in-process engine-core step (EngineCore.step*)"
    assert any("VLLM_ENABLE_V1_MULTIPROCESSING=0" in note for note in split["notes"])
    assert len(oracle["anchors"]) == STEPS and len(split["steps"]) == STEPS
    assert split["summary"]["steps"] == STEPS and split["summary"]["idle_steps_left_out"] == 0
    for step, want in zip(split["steps"], oracle["steps"], strict=True):
        assert step["step_ms"] == pytest.approx(want["step_ms"])
        assert step["graph_launches"] == want["replays"] == 1  # the FULL-graph replay of the decode step
        assert step["gpu_busy_ms"] == pytest.approx(want["gpu_busy_ms"])
        assert step["jit_compile_ms"] == 0


def test_the_head_gemm_is_told_apart_from_the_graph_replayed_matmuls(split, oracle):
    """The head's kernel is a cuBLASLt GEMM by name (nvjet), launched by the host inside the
    logits processor once per step: it is 'lm_head GEMV (logits)'. The gemv kernels replayed
    from the CUDA graph (the model's own small products) stay 'GEMV'."""
    heads = [want["head"] for want in oracle["steps"]]
    assert all(len(h) == 1 for h in heads)
    names = {h[0][0]["name"] for h in heads}
    assert len(names) == 1 and next(iter(names)).startswith("nvjet_sm90")
    for step, want in zip(split["steps"], oracle["steps"], strict=True):
        families = step["gpu_ms_by_family"]
        assert families["lm_head GEMV (logits)"] == pytest.approx(want["head_ms"])
        assert families["GEMV"] == pytest.approx(want["gemv_ms"]) and want["gemv_ms"] > 0
        assert "GEMM (BF16 dense)" in families  # the model's other cuBLAS kernels, from the graph
    share = split["summary"]["gpu_share_by_family"]["lm_head GEMV (logits)"]
    total = sum(w["head_ms"] for w in oracle["steps"]) / sum(
        sum(s["gpu_ms_by_family"].values()) for s in split["steps"]
    )
    assert share == pytest.approx(total) and 0 < share < 0.05  # a 4,096-id head: under 5 % of GPU time


def test_top_kernels_are_the_traces_own(split, oracle):
    top = split["summary"]["top_kernels"]
    assert [k["name"] for k in top] == [name for name, _ in oracle["top"]]
    for kernel, (_, (count, us)) in zip(top, oracle["top"], strict=True):
        assert kernel["count"] == count
        assert kernel["gpu_ms"] == pytest.approx(us / 1000)
        assert kernel["gpu_ms_per_step"] == pytest.approx(us / 1000 / STEPS)
    head_name = oracle["steps"][0]["head"][0][0]["name"]
    assert {k["family"] for k in top if k["name"] == head_name} <= {"lm_head GEMV (logits)"}


def test_ple_staging_and_the_worker_time_no_kernel_covers(split, oracle):
    """One stage() per step on the host (H200, with_stack's own overhead included), and the
    worker's CPU time with no kernel running: this tiny model's decode step is host-bound."""
    assert len(oracle["stages"]) == STEPS
    for step, want in zip(split["steps"], oracle["steps"], strict=True):
        assert step["ple_staging_ms"] == pytest.approx(want["stage_ms"]) and want["stage_ms"] > 0.1
        assert step["worker_cpu_not_covered_by_gpu_ms"] == pytest.approx(want["worker_uncovered_ms"])
    s = split["summary"]
    assert s["ple_staging_ms_mean"] == pytest.approx(sum(w["stage_ms"] for w in oracle["steps"]) / STEPS)
    total = sum(w["step_ms"] for w in oracle["steps"])
    assert s["worker_cpu_not_covered_by_gpu_share"] == pytest.approx(
        sum(w["worker_uncovered_ms"] for w in oracle["steps"]) / total
    )
    assert s["worker_cpu_not_covered_by_gpu_share"] > 0.5 and s["gpu_busy_share"] < 0.1


def test_the_cli_on_the_h200_trace(tmp_path):
    out = tmp_path / "split.json"
    proc = run_tool("trace-split", str(FIXTURE), "--output", str(out), "--keep-steps")
    assert proc.returncode == 0, proc.stderr
    jsonschema.validate(
        json.loads(out.read_text()), json.loads((MEASURE / "schemas" / "trace-split.schema.json").read_text())
    )
    assert "anchor: in-process engine-core step" in proc.stdout and "lm_head GEMV (logits)" in proc.stdout
    assert "PLE staging on the host" in proc.stdout and "worker CPU time with no kernel running" in proc.stdout
