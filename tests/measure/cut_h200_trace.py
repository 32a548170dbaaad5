"""Cut a few engine steps out of a torch-profiler trace taken on the H200 (the fixtures of
test_trace_split_h200.py and test_trace_split_heads.py):
`python -m tests.measure.cut_h200_trace SRC DST FIRST LAST [--launched]`.

Keeps the trace's top-level fields, every metadata ("M") event, and every other event that
starts between the start of engine-core step call FIRST and the start of call LAST (its
python_function `vllm/v1/engine/core.py(N): step*` events, counted from 0 in time order),
so steps FIRST .. LAST-1 are whole; writes DST gzipped.

With `--launched`, the GPU events (kernels, memcpy, memset) are the ones the kept host events
launched instead: those whose `correlation` is a kept cudaLaunchKernel / cuLaunchKernelEx /
cudaGraphLaunch (or other launch) event, wherever they ran in time. The GPU runs behind the
host under async scheduling, so a window of host time holds kernels launched before it (whose
launch, and so their call site, would be cut away) and misses the tail of its own; the flow
("ac2g") events of dropped kernels go too. How the fixtures were made:

    python -m tests.measure.cut_h200_trace q4e-mmap12-fp.pt.trace.json.gz \\
        tests/fixtures/h200-q4e-mmap12-fp-decode.pt.trace.json.gz 2 9
    python -m tests.measure.cut_h200_trace scale-fp-base.pt.trace.json.gz \\
        tests/fixtures/h200-scale-base-decode.pt.trace.json.gz 5 7 --launched
    python -m tests.measure.cut_h200_trace scale-fp-k10k.pt.trace.json.gz \\
        tests/fixtures/h200-scale-k10k-decode.pt.trace.json.gz 5 7 --launched
"""

from __future__ import annotations

import gzip
import json
import re
import sys

STEP = re.compile(r"vllm/v1/engine/core\.py\(\d+\): (step|step_with_batch_queue)$")
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def cut(trace: dict, first: int, last: int, launched: bool = False) -> dict:
    events = trace["traceEvents"]
    starts = sorted(e["ts"] for e in events if e.get("cat") == "python_function" and STEP.search(e.get("name", "")))
    if not 0 <= first < last < len(starts):
        raise SystemExit(f"steps {first}..{last}: the trace has {len(starts)} step calls (0..{len(starts) - 1})")
    lo, hi = starts[first], starts[last]

    def in_window(e) -> bool:
        return "ts" in e and lo <= float(e["ts"]) < hi

    if not launched:
        kept = [e for e in events if e.get("ph") == "M" or in_window(e)]
        return {**{k: v for k, v in trace.items() if k != "traceEvents"}, "traceEvents": kept}
    launches = {
        (e.get("args") or {}).get("correlation")
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and in_window(e) and "correlation" in (e.get("args") or {})
    }
    kept = []
    for e in events:
        if e.get("ph") == "M":
            kept.append(e)
        elif e.get("cat") in GPU_CATEGORIES:
            if (e.get("args") or {}).get("correlation") in launches:
                kept.append(e)
        elif e.get("cat") == "ac2g":
            if e.get("id") in launches:
                kept.append(e)
        elif in_window(e):
            kept.append(e)
    return {**{k: v for k, v in trace.items() if k != "traceEvents"}, "traceEvents": kept}


def main(argv: list[str]) -> int:
    launched = "--launched" in argv
    argv = [a for a in argv if a != "--launched"]
    src, dst, first, last = argv[0], argv[1], int(argv[2]), int(argv[3])
    opener = gzip.open if src.endswith(".gz") else open
    with opener(src, "rt") as f:
        trace = json.load(f)
    out = cut(trace, first, last, launched)
    with gzip.open(dst, "wt", compresslevel=9) as f:
        json.dump(out, f, separators=(",", ":"))
    print(f"{dst}: {len(out['traceEvents'])} of {len(trace['traceEvents'])} events", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
