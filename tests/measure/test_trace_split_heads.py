"""trace_split.py files the head by what it computes, on two real H200 scale traces.

The fixtures are real excerpts, nothing reconstructed: two decode steps (engine-core step
calls 5 and 6) cut by `tests/measure/cut_h200_trace.py --launched` out of the torch-profiler
traces of `gpu-harness run --suite scale` under vLLM 0.34.0 on an NVIDIA H200 (2026-12-03:
measurements/vllm-0.34.0/mtp-scale-h200-2026-12-03.json; the scale model, 248,320-id
vocabulary, MTP k = 3, FULL_AND_PIECEWISE, `vllm.LLM` in-process, with_stack and
record_shapes on). `base` is the unpruned draft head, `k10k` the K = 10,000 keep-set (its
head has 10,048 rows). The excerpt keeps the host events of the two steps and the GPU work
those events launched (so every kernel's launch is in it). The vLLM 0.29.0 traces behind
measurements/mtp_pruning/h200-scale-2026-12-01-trace-split-*.json are not on this machine.

In both traces each step runs the target's head once on the host's eager path (inside
LogitsProcessor) and the drafter's three heads inside CUDA-graph replays (no host launch of
their own). The unpruned draft head is the same cuBLAS kernel as the target's
(`nvjet_sm90_tst_512x8_64x3_2x1_v_bz_TNT`); the pruned one shares its kernel and launch
geometry with the MTP layer's own qkv GEMM, so neither the name nor the geometry tells it.

The oracle shares nothing with the tool: eager heads from the Python stack around each
kernel's launch; replayed heads from the drafter graph's structure (each MTP step starts
with `_fused_pre_fc_norms_kernel`, and its last cuBLAS GEMM is the head).
"""

from __future__ import annotations

import collections
import functools
import gzip
import json
import re

import jsonschema
import pytest

from magpie.measure import trace_split
from tests.serving.helpers import MEASURE, REPO, run_tool

FIXTURES = REPO / "tests" / "fixtures"
TRACES = {name: FIXTURES / f"h200-scale-{name}-decode.pt.trace.json.gz" for name in ("base", "k10k")}
FULL_HEAD = "nvjet_sm90_tst_512x8_64x3_2x1_v_bz_TNT"
HEAD = trace_split.LM_HEAD_FAMILY
STEPS = 2


@functools.cache
def _events(name: str) -> list[dict]:
    with gzip.open(TRACES[name], "rt") as f:
        return json.load(f)["traceEvents"]


@functools.cache
def _oracle(name: str) -> dict:
    """The heads among the trace's kernels: (ts, name) -> "call site" / "graph replay"."""
    events = _events(name)
    launches = {e["args"]["correlation"]: e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    python = [e for e in events if e.get("cat") == "python_function"]
    stacks: dict[int, list[str]] = {}

    def stack(launch: dict) -> list[str]:
        """The Python functions running on the launching thread at the launch."""
        key = launch["args"]["correlation"]
        if key not in stacks:
            at, tid = launch["ts"], launch["tid"]
            stacks[key] = [p["name"] for p in python if p["tid"] == tid and p["ts"] <= at <= p["ts"] + p["dur"]]
        return stacks[key]

    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    heads = {}
    replays: dict[int, list[dict]] = {}
    for k in kernels:
        launch = launches[k["args"]["correlation"]]  # every kernel of the excerpt has its launch
        if launch["name"] == "cudaGraphLaunch":
            if any("spec_decode" in n for n in stack(launch)):
                replays.setdefault(k["args"]["correlation"], []).append(k)
        elif k["name"].startswith("nvjet"):
            if any(re.search(r"logits_processor\.py\(\d+\): _get_logits$", n) for n in stack(launch)):
                heads[(k["ts"], k["name"])] = "call site"
    for members in replays.values():
        draft_steps: list[list[dict]] = []
        for k in members:  # the kernels before the first MTP step prepare its inputs
            if k["name"] == "_fused_pre_fc_norms_kernel":
                draft_steps.append([])
            if draft_steps:
                draft_steps[-1].append(k)
        for step in draft_steps:
            gemms = [k for k in step if k["name"].startswith("nvjet")]
            heads[(gemms[-1]["ts"], gemms[-1]["name"])] = "graph replay"
    return {"heads": heads, "kernels": kernels}


@pytest.fixture(scope="module", params=list(TRACES))
def traced(request):
    name = request.param
    return name, _oracle(name), trace_split.collect(str(TRACES[name]))


def test_every_head_launch_and_replay_is_filed_as_the_head_and_nothing_else(traced):
    name, oracle, data = traced
    # Two steps: one eager target head and three replayed draft heads each.
    assert sorted(oracle["heads"].values()) == ["call site"] * STEPS + ["graph replay"] * 3 * STEPS
    names = trace_split.family_names()
    kernel_names = {i: n for n, i in data.kernel_names.items()}
    filed = {
        (data.kernel_ts[i], kernel_names[data.kernel_name[i]]): (
            names[data.kernel_family[i]],
            trace_split.RULES[data.kernel_rule[i]],
        )
        for i in range(len(data.kernel_ts))
    }
    assert len(filed) == len(oracle["kernels"])
    for key, (family, rule) in filed.items():
        if key in oracle["heads"]:
            assert (family, rule) == (HEAD, oracle["heads"][key]), key
        else:
            assert family != HEAD and rule == "name", key
    drafts = {n for (_, n), rule in oracle["heads"].items() if rule == "graph replay"}
    if name == "base":
        assert drafts == {FULL_HEAD}
    else:
        # The pruned head's kernel also runs the MTP layer's qkv GEMM: one launch of it per
        # draft step is the head, the other is not.
        assert drafts == {"nvjet_sm90_tst_128x8_64x12_4x1_v_bz_TNT"}
        same = [k for k in filed if k[1] in drafts]
        assert sum(1 for k in same if filed[k][0] == HEAD) == 3 * STEPS < len(same)
    assert sorted(data.head_rows) == [248320]  # the target head's N, from the aten::mm around it


@pytest.fixture(scope="module")
def splits() -> dict:
    return {name: trace_split.split(str(path)) for name, path in TRACES.items()}


def _head_ms_in_steps(name: str, split: dict) -> float:
    """The oracle's heads' GPU time inside the split's step windows."""
    oracle = _oracle(name)
    windows = [(s["start_us"], s["start_us"] + s["step_ms"] * 1000) for s in split["steps"]]
    total = 0.0
    for k in oracle["kernels"]:
        if (k["ts"], k["name"]) in oracle["heads"]:
            for lo, hi in windows:
                total += max(0.0, min(k["ts"] + k["dur"], hi) - max(k["ts"], lo))
    return total / 1000


def test_unpruned_and_pruned_agree_on_the_heads_family_and_share(splits):
    """The full head's kernel is filed under the head in both traces, every launch of it; the
    family's GPU time is the oracle's heads' time; the unpruned head family holds the four
    calls a step (what the kernel's own row says), the pruned one the target's call (the same
    0.29 ms a call as unpruned) plus the three small draft GEMMs."""
    per_call = {}
    for name, split in splits.items():
        s = split["summary"]
        rows = [k for k in s["top_kernels"] if k["name"] == FULL_HEAD]
        assert [k["family"] for k in rows] == [HEAD], rows
        assert s["gpu_ms_by_family"][HEAD] == pytest.approx(_head_ms_in_steps(name, split))
        assert set(s["family_rules"][HEAD]) == {"call site", "graph replay"}
        assert all(set(rules) == {"name"} for family, rules in s["family_rules"].items() if family != HEAD)
        per_call[name] = rows[0]["gpu_ms"] / rows[0]["count"]
        if name == "base":
            # Every launch of the head's kernel in the steps is the head: the family is the kernel.
            assert s["gpu_ms_by_family"][HEAD] == pytest.approx(rows[0]["gpu_ms"])
            assert s["gpu_share_by_family"][HEAD] == pytest.approx(rows[0]["share_of_gpu_time"])
            assert set(rows[0]["rules"]) == {"call site", "graph replay"}
            assert sum(rows[0]["rules"].values()) == rows[0]["count"]
        else:
            assert rows[0]["rules"] == {"call site": rows[0]["count"]}
            assert s["gpu_ms_by_family"][HEAD] > rows[0]["gpu_ms"]  # plus the pruned draft heads
    assert per_call["k10k"] == pytest.approx(per_call["base"], rel=0.1)
    base, pruned = (splits[n]["summary"]["gpu_share_by_family"][HEAD] for n in ("base", "k10k"))
    assert base > 3 * pruned > 0


def test_the_shape_rule_finds_a_head_called_outside_the_logits_processor(tmp_path):
    """The base excerpt with the logits processor's Python events taken out (a head computed
    from elsewhere): with --head-rows 248320 the target's head is filed by its aten::mm's N,
    without it by name (GEMM); the draft heads stay filed by graph replay either way."""
    with gzip.open(TRACES["base"], "rt") as f:
        trace = json.load(f)
    trace["traceEvents"] = [e for e in trace["traceEvents"] if "logits_processor.py" not in e.get("name", "")]
    path = tmp_path / "no-logits-processor.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    for head_rows, rule in (((248320,), "shape"), ((), "name")):
        data = trace_split.collect(str(path), head_rows)
        names = trace_split.family_names()
        head = data.kernel_names[FULL_HEAD]
        filed = collections.Counter(
            (names[data.kernel_family[i]], trace_split.RULES[data.kernel_rule[i]])
            for i in range(len(data.kernel_ts))
            if data.kernel_name[i] == head
        )
        # All eight launches of the head's kernel: the two targets' by shape (or name), the six replays.
        want_target = (HEAD, "shape") if rule == "shape" else ("GEMM (BF16 dense)", "name")
        assert filed == {want_target: STEPS, (HEAD, "graph replay"): 3 * STEPS}
        s = trace_split.split(str(path), head_rows)["summary"]
        assert set(s["family_rules"][HEAD]) == ({"shape", "graph replay"} if rule == "shape" else {"graph replay"})


def test_the_cli_says_which_rule_filed_each_family_and_help_describes_the_rules(tmp_path):
    out = tmp_path / "split.json"
    proc = run_tool("trace-split", str(TRACES["base"]), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.strip().endswith("]") and HEAD in x)
    assert "call site" in line and "graph replay" in line
    assert "head rows (the N of the head's GEMMs): 248320" in proc.stdout
    schema = json.loads((MEASURE / "schemas" / "trace-split.schema.json").read_text())
    jsonschema.validate(json.loads(out.read_text()), schema)
    result = json.loads(out.read_text())["traces"][0]["summary"]
    assert result["head_rows"] == [248320] and "family_rules" in result
    # The committed splits of the full 0.34.0 traces: the head's family holds every call of
    # the full head's kernel unpruned (the kernel's share), and the same rules fill it.
    committed = {
        n: json.loads(
            (REPO / "measurements" / "vllm-0.34.0" / f"mtp-scale-h200-2026-12-03-trace-split-{n}.json").read_text()
        )
        for n in ("base", "k10k")
    }
    for split in committed.values():
        jsonschema.validate(split, schema)
    base, k10k = (committed[n]["traces"][0]["summary"] for n in ("base", "k10k"))
    row = next(k for k in base["top_kernels"] if k["name"] == FULL_HEAD)
    assert row["family"] == HEAD and base["gpu_share_by_family"][HEAD] == pytest.approx(row["share_of_gpu_time"])
    assert set(base["family_rules"][HEAD]) == set(k10k["family_rules"][HEAD]) == {"call site", "graph replay"}
    helped = run_tool("trace-split", "--help")
    assert helped.returncode == 0
    for words in ('"call site"', '"shape"', '"graph replay"', '"name"', "--head-rows", "family_rules"):
        assert words in helped.stdout, words
    bad = run_tool("trace-split", str(TRACES["base"]), "--head-rows", "12,x")
    assert bad.returncode == 2 and "--head-rows" in bad.stderr and "positive integers" in bad.stderr
