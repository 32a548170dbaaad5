"""trace_split.py on a GPU-style trace built from the torch profiler's real output.

No GPU here, so the trace is made in two steps, and the test says so:
1. torch 2.13's profiler really records, on this CPU, an engine loop whose Python functions live
   in files at vLLM's paths (vllm/v1/engine/core.py `_process_engine_step`,
   vllm/v1/worker/gpu_model_runner.py `execute_model`, vllm/models/qwen4_exp/ple_mmap.py `stage`,
   vllm/model_executor/layers/logits_processor.py `_get_logits`) and runs real aten ops, with
   `with_stack=True` and `record_shapes=True` as vLLM's profiler does. Everything CPU-side in the
   trace (python_function, cpu_op, user_annotation events, metadata) is torch's own output.
2. For every aten matmul op of that trace the test adds what the CUDA build's profiler (kineto)
   writes for one kernel launch, in kineto's format (libkineto/src/output_json.cpp): a
   `cuda_runtime` cudaLaunchKernel event inside the op with `correlation` and `External id`
   args, the `kernel` event on the device's pid and the stream's tid with the same `correlation`
   and kineto's kernel args, and the `ac2g` flow pair ("s" at the launch, "f" with "bp": "e" at
   the kernel). Durations are chosen, so every expected figure is known.
"""

from __future__ import annotations

import gzip
import json
import textwrap
from pathlib import Path

import jsonschema
import pytest

from magpie import patches
from magpie.measure import trace_split
from tests.serving.helpers import MEASURE, run_tool

FILES = {
    "vllm/v1/engine/core.py": """
        import time

        def _process_engine_step(runner, x, w_dense, w_head):
            out = runner(x, w_dense, w_head)
            time.sleep(0.003)  # the step's kernels finish inside the step
            return out
    """,
    "vllm/v1/worker/gpu_model_runner.py": """
        import torch

        def execute_model(x, w_dense, w_head, ple, logits):
            hidden = torch.mm(x, w_dense)
            torch.mv(w_dense, x[0])
            ple.stage(hidden)
            return logits._get_logits(hidden, w_head)
    """,
    "vllm/models/qwen4_exp/ple_mmap.py": """
        import time

        def stage(hidden):
            time.sleep(0.002)
            return hidden.sum()
    """,
    "vllm/model_executor/layers/logits_processor.py": """
        import torch

        def _get_logits(hidden, weight):
            return torch.mm(hidden, weight.t())
    """,
}
STEPS = 4
# Kernel per aten op, in launch order within a step: (name, GPU stream, duration in us).
KERNELS = {
    "dense": ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", 7, 300.0),
    "mv": ("void gemvx::kernel<int, int, __nv_bfloat16, float, false, true, true, false, 6, false>", 8, 50.0),
    # cuBLASLt picks a GEMM-named kernel for the head: only the launch context says it is lm_head.
    "head": ("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", 7, 120.0),
}


def _load(root: Path, relative: str, name: str):
    return patches.load_file(root / relative, name, register=False)


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory) -> Path:
    """A real torch-profiler trace of the fake engine loop (CPU events only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    root = tmp_path_factory.mktemp("fake-vllm")
    for relative, source in FILES.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(textwrap.dedent(source))
    core = _load(root, "vllm/v1/engine/core.py", "fake_core")
    runner = _load(root, "vllm/v1/worker/gpu_model_runner.py", "fake_runner")
    ple = _load(root, "vllm/models/qwen4_exp/ple_mmap.py", "fake_ple")
    logits = _load(root, "vllm/model_executor/layers/logits_processor.py", "fake_logits")
    x, w_dense, w_head = torch.randn(2, 64), torch.randn(64, 64), torch.randn(512, 64)

    def run(a, b, c):
        return runner.execute_model(a, b, c, ple, logits)

    with profile(activities=[ProfilerActivity.CPU], with_stack=True, record_shapes=True) as prof:
        for _ in range(STEPS):
            core._process_engine_step(run, x, w_dense, w_head)
    path = root / "engine.pt.trace.json"
    prof.export_chrome_trace(str(path))
    return path


def add_gpu_events(trace: dict) -> list[dict]:
    """kineto's events for one kernel per matmul op; returns the kernels added, with their roles."""
    events = trace["traceEvents"]
    mm_ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e["name"] in ("aten::mm", "aten::mv")),
                    key=lambda e: e["ts"])  # fmt: skip
    assert len(mm_ops) == 3 * STEPS, [e["name"] for e in mm_ops]
    added = []
    for number, op in enumerate(mm_ops):
        role = ("dense", "mv", "head")[number % 3]
        name, stream, duration = KERNELS[role]
        correlation = 1000 + number
        launch_ts = op["ts"] + op["dur"] / 2
        kernel_ts = launch_ts + 20.0
        pid, tid = op["pid"], op["tid"]
        external = op["args"]["External id"]
        events += [
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": tid, "ts": launch_ts,
             "dur": 4.0, "args": {"External id": external, "cbid": 211, "correlation": correlation}},
            {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": kernel_ts, "dur": duration,
             "args": {"External id": external, "queued": 0, "device": 0, "context": 1, "stream": stream,
                      "correlation": correlation, "registers per thread": 168, "shared memory": 0,
                      "blocks per SM": 0.5, "warps per SM": 2.0, "grid": [66, 1, 1], "block": [128, 1, 1],
                      "est. achieved occupancy %": 6}},
            {"ph": "s", "id": correlation, "pid": pid, "tid": tid, "ts": launch_ts, "cat": "ac2g", "name": "ac2g"},
            {"ph": "f", "id": correlation, "pid": 0, "tid": stream, "ts": kernel_ts, "cat": "ac2g", "name": "ac2g",
             "bp": "e"},
        ]  # fmt: skip
        added.append({"role": role, "ts": kernel_ts, "end": kernel_ts + duration})
    events += [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 7, "args": {"name": "stream 7"}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 8, "args": {"name": "stream 8"}},
    ]
    return added


@pytest.fixture(scope="module")
def gpu_trace(cpu_trace, tmp_path_factory) -> tuple[Path, dict, list[dict]]:
    trace = json.loads(cpu_trace.read_text())
    kernels = add_gpu_events(trace)
    path = tmp_path_factory.mktemp("gpu-style") / "engine.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    return path, trace, kernels


def _union(intervals):
    total, end = 0.0, None
    for lo, hi in sorted(intervals):
        if end is None or lo > end:
            total, end = total + hi - lo, hi
        elif hi > end:
            total, end = total + hi - end, hi
    return total


def _python(trace: dict, function: str) -> list[dict]:
    return sorted(
        (e for e in trace["traceEvents"] if e.get("cat") == "python_function" and e["name"].endswith(f": {function}")),
        key=lambda e: e["ts"],
    )


def test_real_cpu_trace_gives_ple_staging_time_and_no_gpu_figures(cpu_trace):
    trace = json.loads(cpu_trace.read_text())
    result = trace_split.split(str(cpu_trace))
    assert result["anchor"] == "engine-core _process_engine_step" and len(result["steps"]) == STEPS
    assert result["gpu_events"] is False and result["summary"]["top_kernels"] is None
    stages = _python(trace, "stage")
    assert len(stages) == STEPS and all(e["dur"] >= 2000 for e in stages)
    for step, stage in zip(result["steps"], stages, strict=True):
        assert step["ple_staging_ms"] == pytest.approx(stage["dur"] / 1000)
    assert result["summary"]["ple_staging_ms_mean"] == pytest.approx(sum(e["dur"] for e in stages) / STEPS / 1000)


def test_lm_head_gemv_gemm_top_kernels_and_uncovered_worker_time(gpu_trace):
    path, trace, kernels = gpu_trace
    result = trace_split.split(str(path))
    assert result["gpu_events"] is True and len(result["steps"]) == STEPS
    anchors = _python(trace, "_process_engine_step")
    workers = _python(trace, "execute_model")
    for number, step in enumerate(result["steps"]):
        start = anchors[number]["ts"]
        end = anchors[number + 1]["ts"] if number + 1 < STEPS else anchors[number]["ts"] + anchors[number]["dur"]
        mine = [k for k in kernels if start <= k["ts"] < end]
        assert [k["role"] for k in mine] == ["dense", "mv", "head"]
        # The head's kernel has a GEMM name, but was launched inside the logits processor.
        assert step["gpu_ms_by_family"] == pytest.approx(
            {"GEMM (BF16 dense)": 0.300, "GEMV": 0.050, "lm_head GEMV (logits)": 0.120}
        )
        spans = [(k["ts"], k["end"]) for k in mine]
        assert step["gpu_busy_ms"] == pytest.approx(_union(spans) / 1000)
        worker = (workers[number]["ts"], workers[number]["ts"] + workers[number]["dur"])
        covered = _union(spans) + (worker[1] - worker[0]) - _union(spans + [worker])  # |worker ∩ kernels|
        assert step["worker_cpu_not_covered_by_gpu_ms"] == pytest.approx((worker[1] - worker[0] - covered) / 1000)
        # The PLE staging (2 ms of sleep) runs with the GPU idle wherever no kernel overlaps it:
        # all of that time is worker CPU time not covered by a kernel.
        stage = _python(trace, "stage")[number]
        stage_span = (stage["ts"], stage["ts"] + stage["dur"])
        idle_in_stage = stage["dur"] - (_union(spans) + stage["dur"] - _union(spans + [stage_span]))
        assert idle_in_stage > 1000
        assert step["worker_cpu_not_covered_by_gpu_ms"] >= idle_in_stage / 1000 - 1e-6
        assert step["kernel_launches"] == 3
    s = result["summary"]
    assert s["gpu_share_by_family"]["lm_head GEMV (logits)"] == pytest.approx(120 / 470)
    top = s["top_kernels"]
    assert [k["name"] for k in top] == [KERNELS[r][0] for r in ("dense", "head", "mv")]
    assert [k["family"] for k in top] == ["GEMM (BF16 dense)", "lm_head GEMV (logits)", "GEMV"]
    assert all(k["count"] == STEPS for k in top)
    assert top[0]["gpu_ms_per_step"] == pytest.approx(0.300)
    assert sum(k["share_of_gpu_time"] for k in top) == pytest.approx(1.0)
    assert 0 < s["worker_cpu_not_covered_by_gpu_share"] < 1 and s["ple_staging_share"] > 0


def test_trace_split_cli_prints_and_writes_the_new_figures(gpu_trace, tmp_path):
    path, _, _ = gpu_trace
    out = tmp_path / "split.json"
    proc = run_tool("trace-split", str(path), "--output", str(out), "--keep-steps")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    jsonschema.validate(result, json.loads((MEASURE / "schemas" / "trace-split.schema.json").read_text()))
    assert "steps" in result["traces"][0] and "_kernels" not in result["traces"][0]["steps"][0]
    assert "lm_head GEMV (logits)" in proc.stdout and "top kernels" in proc.stdout
    assert "worker CPU time with no kernel running" in proc.stdout and "PLE staging on the host" in proc.stdout
