"""Cut a few engine steps out of a torch-profiler trace taken on the H200 (the fixture of
test_trace_split_h200.py): `python -m tests.serving.cut_h200_trace SRC DST FIRST LAST`.

Keeps the trace's top-level fields, every metadata ("M") event, and every other event that
starts between the start of engine-core step call FIRST and the start of call LAST (its
python_function `vllm/v1/engine/core.py(N): step*` events, counted from 0 in time order),
so steps FIRST .. LAST-1 are whole; writes DST gzipped. How the fixture was made:

    python -m tests.serving.cut_h200_trace q4e-mmap12-fp.pt.trace.json.gz \\
        tests/fixtures/h200-q4e-mmap12-fp-decode.pt.trace.json.gz 2 9
"""

from __future__ import annotations

import gzip
import json
import re
import sys

STEP = re.compile(r"vllm/v1/engine/core\.py\(\d+\): (step|step_with_batch_queue)$")


def cut(trace: dict, first: int, last: int) -> dict:
    events = trace["traceEvents"]
    starts = sorted(e["ts"] for e in events if e.get("cat") == "python_function" and STEP.search(e.get("name", "")))
    if not 0 <= first < last < len(starts):
        raise SystemExit(f"steps {first}..{last}: the trace has {len(starts)} step calls (0..{len(starts) - 1})")
    lo, hi = starts[first], starts[last]
    kept = [e for e in events if e.get("ph") == "M" or ("ts" in e and lo <= float(e["ts"]) < hi)]
    return {**{k: v for k, v in trace.items() if k != "traceEvents"}, "traceEvents": kept}


def main(argv: list[str]) -> int:
    src, dst, first, last = argv[0], argv[1], int(argv[2]), int(argv[3])
    opener = gzip.open if src.endswith(".gz") else open
    with opener(src, "rt") as f:
        trace = json.load(f)
    out = cut(trace, first, last)
    with gzip.open(dst, "wt", compresslevel=9) as f:
        json.dump(out, f, separators=(",", ":"))
    print(f"{dst}: {len(out['traceEvents'])} of {len(trace['traceEvents'])} events", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
