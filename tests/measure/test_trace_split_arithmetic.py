"""Trace split arithmetic on hand-made traces (no GPU, no server)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from magpie.measure import trace_split

# --------------------------------------------------------------------------------------------
# Trace split arithmetic (GPU events cannot be recorded on this machine: a hand-made trace with
# known overlaps checks the union and the launch counts)


def _synthetic_gpu_trace(path: Path) -> None:
    engine = "vllm/v1/engine/core.py(1468): _process_engine_step"
    events = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "EngineCore"}}]
    for step in range(3):
        t = step * 1000.0
        events += [
            {"ph": "X", "cat": "python_function", "name": engine, "pid": 1, "tid": 1, "ts": t, "dur": 900},
            {
                "ph": "X",
                "cat": "python_function",
                "name": "vllm/v1/core/sched/scheduler.py(501): schedule",
                "pid": 1,
                "tid": 1,
                "ts": t + 10,
                "dur": 50,
            },
            {
                "ph": "X",
                "cat": "python_function",
                "name": "vllm/v1/worker/gpu_worker.py(1107): execute_model",
                "pid": 1,
                "tid": 1,
                "ts": t + 100,
                "dur": 700,
            },
            {
                "ph": "X",
                "cat": "python_function",
                "name": "vllm/v1/core/sched/scheduler.py(1802): update_from_output",
                "pid": 1,
                "tid": 1,
                "ts": t + 820,
                "dur": 40,
            },
            # Two overlapping kernels on two streams (busy = 300 us, not 400) and one later kernel.
            {"ph": "X", "cat": "kernel", "name": "nvjet_tst_gemm_bf16", "pid": 0, "tid": 7, "ts": t + 200, "dur": 200},
            {
                "ph": "X",
                "cat": "kernel",
                "name": "flash_fwd_splitkv_kernel",
                "pid": 0,
                "tid": 8,
                "ts": t + 300,
                "dur": 200,
            },
            {"ph": "X", "cat": "kernel", "name": "rms_norm_kernel", "pid": 0, "tid": 7, "ts": t + 600, "dur": 100},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t + 150, "dur": 5},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 1, "tid": 1, "ts": t + 160, "dur": 5},
        ]
    with gzip.open(path, "wt") as f:
        json.dump({"schemaVersion": 1, "traceEvents": events, "traceName": "synthetic"}, f)


def test_trace_split_counts_overlapping_kernels_once_and_never_makes_other_negative(tmp_path):
    trace = tmp_path / "synthetic.pt.trace.json.gz"
    _synthetic_gpu_trace(trace)
    result = trace_split.split(str(trace))
    assert result["anchor"].startswith("engine-core")
    assert len(result["steps"]) == 3
    # A step runs to the next step's start; the last one to the end of its own work.
    assert [s["step_ms"] for s in result["steps"]] == pytest.approx([1.0, 1.0, 0.9])
    for step in result["steps"][:2]:
        assert step["worker_ms"] == pytest.approx(0.7)
        assert step["scheduler_ms"] == pytest.approx(0.09)
        assert step["other_ms"] == pytest.approx(1.0 - 0.7 - 0.09) and step["other_ms"] >= 0
        assert step["gpu_busy_ms"] == pytest.approx(0.4)  # [200, 500) and [600, 700)
        assert step["kernel_launches"] == 1 and step["graph_launches"] == 1
        assert step["gpu_ms_by_family"] == pytest.approx({"attention": 0.2, "GEMM (BF16 dense)": 0.2, "norms": 0.1})


def test_trace_split_streams_a_large_trace_in_small_chunks(tmp_path, monkeypatch):
    trace = tmp_path / "synthetic.json"
    _synthetic_gpu_trace(tmp_path / "synthetic.json.gz")
    trace.write_bytes(gzip.decompress((tmp_path / "synthetic.json.gz").read_bytes()))
    whole = json.loads(trace.read_text())["traceEvents"]
    # A 7-byte read size cuts every number, string and object across reads.
    monkeypatch.setattr(trace_split._Stream.__init__, "__defaults__", (7,))
    streamed = [item[1] for item in trace_split.iter_trace(str(trace)) if item[0] == "event"]
    assert streamed == whole
