#!/usr/bin/env python3
"""Build an MTP draft keep-set: the fewest token ids that cover a share of the counted generated tokens.

Takes the token counts of count_tokens.py, keeps the smallest top-K reaching `--coverage` of all
counted tokens, adds the tokenizer's special and added tokens (the draft must be able to propose
end-of-turn and tool-call markers), `--extra-ids` and, with `--union`, other keep-sets (to cover
several workloads), and writes the sorted int64 ids as .npy, .pt or .json for vLLM's
`draft_vocab_path`.

    python3 magpie build-keepset counts.npy --model ~/models/Qwen3.8-Flash-Next \\
        --coverage 0.99 -o keep.npy --holdout heldout-counts.npy

It prints K, the share of the vocabulary and the coverage reached on the counts; with
`--holdout COUNTS.npy` (counts of other text, not used for fitting) also the coverage there. A
keep-set fitted on one workload covers another one poorly (an agent-fitted 99 % set covered
~73 % of chat); the script says so when the held-out coverage falls short. `--summary FILE`
writes the figures as JSON (schema "magpie/build-keepset/1").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from magpie import cli, files
from magpie.mtp_pruning.count_tokens import load_counts, read_vocab_size

SCHEMA = files.schema("build-keepset", 1)
# Held-out coverage this far under the fitted coverage gets a warning.
DRIFT_WARNING = 0.02
# The keep-set files written: what the mtp_pruning patch reads as draft_vocab_path (.json: a list of ids).
OUTPUT_SUFFIXES = (".npy", ".pt", ".json")
OUTPUT_FORMATS = "use .npy, .pt or .json (a JSON list of ids)"


def parse_id_ranges(spec: str) -> list[tuple[int, int]]:
    """'1,5-7' -> [(1, 1), (5, 7)] (inclusive ranges, not yet materialised: check_id_ranges
    bounds them by the vocabulary first, so '0-30000000' costs nothing before it is refused)."""
    ranges: list[tuple[int, int]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"--extra-ids: {part!r} is not an id or a range of ids like 5-7")
        if last and int(last) < int(first):
            raise ValueError(f"--extra-ids: range {part!r} runs backwards")
        ranges.append((int(first), int(last or first)))
    return ranges


def id_ranges_to_ids(ranges: list[tuple[int, int]], vocab_size: int):
    """The ids of `ranges` as a sorted unique int64 array, after checking every range lies in
    [0, vocab_size) (ValueError naming the range otherwise): nothing larger than the vocabulary
    is ever built."""
    import numpy as np

    for first, last in ranges:
        if last >= vocab_size:
            shown = f"{first}-{last}" if last != first else str(first)
            raise ValueError(
                f"--extra-ids: {shown} reaches id {last}, outside the vocabulary [0, {vocab_size}); "
                f"ids run from 0 to {vocab_size - 1}"
            )
    if not ranges:
        return np.empty(0, dtype=np.int64)
    return np.unique(np.concatenate([np.arange(first, last + 1, dtype=np.int64) for first, last in ranges]))


def top_k_for_coverage(counts, coverage: float) -> tuple[object, float]:
    """The smallest set of ids whose counts reach `coverage` of the total, most frequent first.

    Ties in count are broken by the lower id, so the result is deterministic.
    """
    import numpy as np

    total = int(counts.sum())
    if total == 0:
        raise ValueError("the counts are all zero: nothing to fit a keep-set on")
    order = np.lexsort((np.arange(counts.shape[0]), -counts))  # count descending, then id ascending
    cumulative = np.cumsum(counts[order])
    needed = coverage * total
    k = int(np.searchsorted(cumulative, needed - 1e-9 * total, side="left")) + 1
    k = min(k, int((counts > 0).sum()))
    return order[:k], float(cumulative[k - 1] / total)


def special_ids(tokenizer_name: str) -> list[int]:
    """Ids of the tokenizer's special and added tokens (chat markers, end of turn, tool calls)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
    ids = set(tokenizer.all_special_ids)
    ids.update(getattr(tokenizer, "added_tokens_decoder", {}).keys())
    return sorted(i for i in ids if i is not None)


def load_keep_set(path: str, vocab_size: int | None = None):
    """A keep-set to --union, read and checked by the mtp_pruning patch's own rules, those vLLM
    applies to draft_vocab_path (magpie.serving.preflight.read_keep_ids: .pt with weights_only,
    .npy and .safetensors without unpickling; integer, 1-D, non-empty, sorted, unique,
    non-negative; inside [0, vocab_size) when it is given, and what the file may hold or inflate
    to bounded by it before it is read): a file vLLM would refuse is refused here, for the same
    reason."""
    from magpie.serving import preflight

    try:
        return preflight.read_keep_ids(path, vocab_size).numpy()
    except preflight.Refused as e:
        raise ValueError(f"--union: {e}") from None


def save_keep_set(ids, path: str) -> None:
    """Write the keep-set atomically: a server reading `draft_vocab_path` never sees half a file."""
    import numpy as np

    if not path.endswith(OUTPUT_SUFFIXES):
        raise ValueError(f"--output {path}: {OUTPUT_FORMATS}")
    if path.endswith(".json"):
        files.atomic_write_text(path, json.dumps([int(i) for i in ids]) + "\n")
        return
    with files.atomic_open(path, "wb") as f:
        if path.endswith(".npy"):
            np.save(f, ids.astype(np.int64))
        else:
            import torch

            torch.save(torch.from_numpy(ids.astype(np.int64)), f)


def coverage_of(keep, counts) -> float:
    total = int(counts.sum())
    return float(counts[keep].sum() / total) if total else float("nan")


def build_keep_set(
    counts,
    coverage: float,
    specials: list[int] = (),
    extra_ids: list[int] = (),
    unions: list = (),
) -> tuple[object, dict]:
    """Sorted unique int64 keep ids and the figures of how they were chosen."""
    import numpy as np

    vocab_size = counts.shape[0]
    top, top_coverage = top_k_for_coverage(counts, coverage)
    parts = [top, np.asarray(specials, dtype=np.int64), np.asarray(extra_ids, dtype=np.int64)]
    parts.extend(np.asarray(u, dtype=np.int64) for u in unions)
    keep = np.unique(np.concatenate(parts))
    if keep.size and (keep[0] < 0 or keep[-1] >= vocab_size):
        bad = keep[(keep < 0) | (keep >= vocab_size)][0]
        raise ValueError(f"id {bad} is outside [0, {vocab_size}) (--extra-ids or --union)")
    if keep.size == vocab_size:
        raise ValueError(
            f"the keep-set would hold all {vocab_size} ids, which prunes nothing (the mtp_pruning patch refuses "
            "it as draft_vocab_path): lower --coverage, or drop the --extra-ids / --union that fill the vocabulary"
        )
    figures = {
        "vocab_size": int(vocab_size),
        "counted_tokens": int(counts.sum()),
        "distinct_counted_ids": int((counts > 0).sum()),
        "coverage_target": coverage,
        "top_k": int(top.size),
        "top_k_coverage": top_coverage,
        "special_ids": len(specials),
        "extra_ids": len(extra_ids),
        "union_ids": int(sum(len(u) for u in unions)),
        "keep_ids": int(keep.size),
        "vocab_share": float(keep.size / vocab_size),
        "coverage": coverage_of(keep, counts),
    }
    return keep, figures


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("magpie build-keepset", __doc__)
    parser.add_argument("counts", nargs="+", help="counts .npy files of count_tokens.py (summed)")
    parser.add_argument("-o", "--output", required=True, help="keep-set to write (.npy, .pt or .json)")
    parser.add_argument("--coverage", type=float, default=0.99, help="share of counted tokens to cover")
    parser.add_argument("--model", help="model folder: tokenizer for the special ids, and vocab_size check")
    parser.add_argument("--tokenizer", help="tokenizer folder or name for the special ids (unset: the --model folder)")
    parser.add_argument("--no-special-ids", action="store_true", help="do not add the tokenizer's special ids")
    parser.add_argument("--extra-ids", default="", help="ids to add, comma separated, ranges allowed: '0-10,151643'")
    parser.add_argument("--union", action="append", default=[], help="another keep-set to include (repeatable)")
    parser.add_argument("--holdout", help="counts .npy of held-out text: report the keep-set's coverage there")
    parser.add_argument("--summary", help="write the figures as JSON to this file ('-': stdout)")
    cli.add_force(parser, "the --output and --summary files")
    return parser


def check_arguments(args, outputs: list[tuple[str, str | Path | None]]) -> int | None:
    """Before any work: 2 (the error printed) for a bad --coverage, --extra-ids or a keep-set
    --output that is not .npy, .pt or .json; outputs that are one file, or one of the inputs, and
    inputs that are missing or folders refused (files.InputError); an existing file of `outputs`
    ((option, path) pairs) refused without --force (files.check_output); None when the run may
    begin."""
    problem = None
    try:
        args.extra_ranges = parse_id_ranges(getattr(args, "extra_ids", ""))
    except ValueError as e:
        args.extra_ranges, problem = [], str(e)
    if problem is None and not 0 < args.coverage <= 1:
        problem = f"--coverage must be in (0, 1], not {args.coverage}"
    elif problem is None and not args.output.endswith(OUTPUT_SUFFIXES):
        problem = f"--output {args.output}: {OUTPUT_FORMATS}"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    inputs = [("counts", c) for c in getattr(args, "counts", [])] + [("--holdout", getattr(args, "holdout", None))]
    inputs += [("--union", u) for u in getattr(args, "union", [])]
    files.check_distinct(outputs, inputs)
    for option, path in inputs:
        files.check_input(path, option)
    for option, path in outputs:
        files.check_output(path, args.force, what=option)
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cli.require_modules("build-keepset", "numpy", "torch", "transformers")
    if (status := check_arguments(args, [("--output", args.output), ("--summary", args.summary)])) is not None:
        return status
    vocab_size = read_vocab_size(Path(args.model)) if args.model else None
    counts = None
    for path in args.counts:
        part = load_counts(Path(path), vocab_size, "counts")
        if counts is not None and part.shape != counts.shape:
            print(
                f"error: counts {path} has {part.shape[0]} slots, {args.counts[0]} {counts.shape[0]}: count every "
                "file with the same model's tokenizer",
                file=sys.stderr,
            )
            return 2
        counts = part if counts is None else counts + part
    tokenizer = args.tokenizer or args.model
    if not args.no_special_ids and tokenizer is None:
        print("error: give --model or --tokenizer for the special ids (or --no-special-ids)", file=sys.stderr)
        return 2
    specials = [] if args.no_special_ids else special_ids(tokenizer)
    try:
        keep, figures = build_keep_set(
            counts,
            args.coverage,
            specials=specials,
            extra_ids=id_ranges_to_ids(args.extra_ranges, counts.shape[0]),
            unions=[load_keep_set(u, counts.shape[0]) for u in args.union],
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    figures["holdout"] = None
    warning = None
    if args.holdout:
        holdout = load_counts(Path(args.holdout), counts.shape[0], "--holdout")
        held = coverage_of(keep, holdout)
        figures["holdout"] = {"path": args.holdout, "tokens": int(holdout.sum()), "coverage": held}
        if held < figures["coverage"] - DRIFT_WARNING:
            warning = (
                f"warning: the keep-set covers {100 * held:.1f}% of the held-out tokens but "
                f"{100 * figures['coverage']:.1f}% of the fitted ones. Keep-sets transfer badly across "
                "workloads and need hundreds of thousands of counted tokens: count more of the traffic "
                "you serve, or --union a keep-set fitted on the other workload."
            )
    save_keep_set(keep, args.output)
    figures = {"schema": SCHEMA, "output": args.output, **figures}
    lines = [
        f"keep-set {args.output}: K = {figures['keep_ids']} of {figures['vocab_size']} ids "
        f"({100 * figures['vocab_share']:.2f}% of the vocabulary)",
        f"  top {figures['top_k']} ids reach {100 * figures['top_k_coverage']:.2f}% "
        f"(target {100 * args.coverage:.2f}%) of {figures['counted_tokens']} counted tokens; "
        f"+ {figures['special_ids']} special, {figures['extra_ids']} extra, {figures['union_ids']} union ids",
        f"  coverage of the counted tokens: {100 * figures['coverage']:.2f}%",
    ]
    if figures["holdout"]:
        lines.append(
            f"  coverage of the held-out tokens ({figures['holdout']['tokens']}): "
            f"{100 * figures['holdout']['coverage']:.2f}%"
        )
    if args.summary == "-":
        print(json.dumps(figures, indent=2))
        print("\n".join(lines), file=sys.stderr)
    else:
        if args.summary:
            files.atomic_write_json(args.summary, figures, indent=2)
        print("\n".join(lines))
    if warning:
        print(warning, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_tool("build-keepset", main, sys.argv[1:]))
