#!/usr/bin/env python3
"""Time one MTP draft step's head on a GPU, under CUDA-graph replay: full head vs pruned heads.

This is the work the draft-vocab pruning patch removes: per draft token, the full head is a
248,320 x 2560 bf16 GEMV (1.27 GB read); the pruned head reads K rows. Timed per draft step at
each batch size, including the post-processing each path ships with:

- `full`: F.linear over all V rows, argmax over V (stock: `compute_logits(...).argmax(-1)`);
- `pruned-argmax` (shipped for greedy drafting): F.linear over the K rows, padded to a multiple of
  64 as ParallelLMHead pads them, -inf on the padding rows, max over K, then target id =
  row + d2t[row] (vLLM 0.29's LogitsProcessor.get_top_tokens + LocalArgmaxMixin at TP=1);
- `pruned-full-vocab` (shipped for consumers of full-vocabulary logits): F.linear over the K rows,
  the patch's own `DraftVocab.expand_logits` (-inf row of V, index_copy of the K logits), argmax;
- `*-gemv`: the GEMV alone, the floor of each.

Each path is captured in CUDA graphs and replayed (as vLLM decodes). Between steps a real decode
runs the target and the MTP layer, so the head is not in L2: each replay reads its own copy of
the weights, rotated through enough copies to exceed L2 several times ("cold"). The patch's
module is loaded from the patch file itself (torch only), so the post-processing timed is the
one shipped. Needs only torch and a CUDA GPU.

    python3 scripts/mtp_pruning/bench_draft_head.py --output head.json

Output: JSON (schema "mtp-pruning/bench-draft-head/1": device, settings, then one record per
path, rows and batch: median ms per step over trials, GB read, fraction of the bandwidth
roofline, speed-up over the full head, and the projection to a GB10 at its 273 GB/s roofline),
then a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SCHEMA = "mtp-pruning/bench-draft-head/1"
REPO = Path(__file__).resolve().parent.parent.parent
PATCH = REPO / "patches" / "vllm-0.29.0" / "mtp-pruning" / "0001-draft-vocab-pruning.patch"
MODULE_PATH = "vllm/v1/spec_decode/draft_vocab.py"
PAD = 64  # DEFAULT_VOCAB_PADDING_SIZE of vLLM's ParallelLMHead


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def load_module_from_patch(patch: Path, path: str = MODULE_PATH):
    """The new file that a patch adds, imported as a module (the patch tool's own parser)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import patches
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return patches.load_new_module(patch, path, "draft_vocab")


def padded(rows: int) -> int:
    return (rows + PAD - 1) // PAD * PAD


def make_step(path: str, weight, hidden, module, draft_vocab, num_rows: int):
    """A closure computing one draft step's head work on WEIGHT (padded rows) for HIDDEN."""
    import torch.nn.functional as F

    num_pad = weight.shape[0] - num_rows
    if path == "full":
        return lambda: F.linear(hidden, weight).argmax(dim=-1)
    if path.endswith("-gemv"):
        return lambda: F.linear(hidden, weight)
    d2t = module.draft_to_target_offsets(draft_vocab.keep_ids.to(weight.device))
    if path == "pruned-argmax":

        def step():
            logits = F.linear(hidden, weight)
            if num_pad > 0:
                logits[..., -num_pad:] = -float("inf")
            _, index = logits.max(dim=-1)
            index = index + 0  # + org_vocab_start_index (0 at TP=1): a kernel in vLLM too
            return index + d2t[index]

        return step
    if path == "pruned-full-vocab":

        def step():
            logits = F.linear(hidden, weight)[..., :num_rows]
            return draft_vocab.expand_logits(logits).argmax(dim=-1)

        return step
    raise ValueError(path)


def time_graphs(steps, replays: int, trials: int) -> tuple[float, float]:
    """Median ms per replay over TRIALS, replaying the captured graphs round-robin; and eager ms."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for step in steps:  # warm up outside capture (cuBLAS picks its kernels here)
            for _ in range(3):
                step()
    torch.cuda.current_stream().wait_stream(stream)
    graphs = []
    for step in steps:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graphs.append(graph)
    for graph in graphs * 3:
        graph.replay()
    torch.cuda.synchronize()
    results = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(replays):
            graphs[i % len(graphs)].replay()
        end.record()
        end.synchronize()
        results.append(start.elapsed_time(end) / replays)
    eager = []
    for _ in range(trials):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(replays // 4):
            steps[i % len(steps)]()
        torch.cuda.synchronize()
        eager.append((time.perf_counter() - t0) * 1000 / (replays // 4))
    return statistics.median(results), statistics.median(eager)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=248320, help="rows of the full head")
    parser.add_argument("--hidden-size", type=int, default=2560, help="hidden size (Flash-Next)")
    parser.add_argument("--keep", type=int, nargs="+", default=[7696, 10010], help="pruned head sizes K")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="sequences per draft step")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="roofline bytes/s of this GPU (H200)")
    parser.add_argument("--gb10-bandwidth", type=float, default=273e9, help="GB10 unified memory bytes/s")
    parser.add_argument("--cold-bytes", type=float, default=4e8, help="rotate weight copies until they exceed this")
    parser.add_argument("--replays", type=int, default=400, help="graph replays per trial")
    parser.add_argument("--trials", type=int, default=7, help="trials per measurement (median reported)")
    parser.add_argument("--patch", default=str(PATCH), help="the mtp-pruning patch to load the shipped module from")
    parser.add_argument("--output", help="JSON results file")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    module = load_module_from_patch(Path(args.patch))
    device = torch.device("cuda")
    vocab, hidden_size = args.vocab_size, args.hidden_size
    generator = torch.Generator(device="cpu").manual_seed(0)
    keep_sets = {k: torch.randperm(vocab, generator=generator)[:k].sort().values for k in args.keep}

    # Correctness first: the three pruned forms agree with the full head restricted to the keep-set.
    k0 = args.keep[0]
    torch.manual_seed(0)
    full = torch.randn(vocab, hidden_size, device=device, dtype=torch.bfloat16) * 0.02
    vocab_k0 = module.DraftVocab("bench", keep_sets[k0], vocab)
    vocab_k0.place(device)
    keep_k0 = keep_sets[k0].to(device)
    sliced = torch.zeros(padded(k0), hidden_size, dtype=torch.bfloat16, device=device)
    sliced[:k0] = full[keep_k0]
    h = torch.randn(4, hidden_size, device=device, dtype=torch.bfloat16)
    reference = keep_k0[torch.nn.functional.linear(h, full)[:, keep_k0].argmax(-1)]
    for path in ("pruned-argmax", "pruned-full-vocab"):
        got = make_step(path, sliced, h, module, vocab_k0, k0)()
        if not torch.equal(got, reference):
            print(f"error: {path} ids {got.tolist()} != full head restricted to the keep-set {reference.tolist()}")
            return 1
    del sliced

    records = []
    for batch in args.batch:
        hidden = torch.randn(batch, hidden_size, device=device, dtype=torch.bfloat16)
        configs = [("full", vocab, full), ("full-gemv", vocab, full)]
        for k in args.keep:
            configs += [(p, k, None) for p in ("pruned-argmax", "pruned-full-vocab", "pruned-gemv")]
        for path, rows, weight in configs:
            draft_vocab = module.DraftVocab("bench", keep_sets[rows], vocab) if rows != vocab else None
            if draft_vocab is not None:
                draft_vocab.place(device)
            row_count = padded(rows) if rows != vocab else vocab
            weight_bytes = row_count * hidden_size * 2
            copies = 1 if weight_bytes >= args.cold_bytes else int(args.cold_bytes // weight_bytes) + 1
            weights = (
                [weight]
                if weight is not None
                else [
                    torch.randn(row_count, hidden_size, device=device, dtype=torch.bfloat16) * 0.02
                    for _ in range(copies)
                ]
            )
            steps = [make_step(path, w, hidden, module, draft_vocab, rows) for w in weights]
            graph_ms, eager_ms = time_graphs(steps, args.replays, args.trials)
            records.append(
                {
                    "path": path,
                    "rows": rows,
                    "padded_rows": row_count,
                    "batch": batch,
                    "weight_copies": len(weights),
                    "graph_ms": graph_ms,
                    "eager_ms": eager_ms,
                    "weight_gb": weight_bytes / 1e9,
                    "roofline_ms": weight_bytes / args.bandwidth * 1000,
                    "roofline_fraction": weight_bytes / args.bandwidth * 1000 / graph_ms,
                    "gb10_roofline_ms": weight_bytes / args.gb10_bandwidth * 1000,
                }
            )
            del weights, steps
            torch.cuda.empty_cache()
    for record in records:
        base = next(r for r in records if r["path"] == "full" and r["batch"] == record["batch"])
        record["speedup_vs_full"] = base["graph_ms"] / record["graph_ms"]
        record["gb10_speedup_vs_full"] = base["gb10_roofline_ms"] / record["gb10_roofline_ms"]

    result = {
        "schema": SCHEMA,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "check": "pruned-argmax and pruned-full-vocab ids equal the full head's argmax over the keep-set",
        "records": records,
    }
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['device']}, torch {result['torch']}; per draft step, CUDA-graph replay, cold weights")
    print(
        f"{'path':18} {'rows':>7} {'batch':>5} {'graph ms':>9} {'eager ms':>9} {'vs full':>8} {'roofline':>8} "
        f"{'GB10 ms':>8}"
    )
    for r in records:
        print(
            f"{r['path']:18} {r['rows']:>7} {r['batch']:>5} {r['graph_ms']:>9.4f} {r['eager_ms']:>9.4f} "
            f"{r['speedup_vs_full']:>7.1f}x {100 * r['roofline_fraction']:>7.0f}% {r['gb10_roofline_ms']:>8.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
