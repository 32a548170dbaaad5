#!/usr/bin/env python3
"""Fit an MTP draft keep-set from a folder of the model's generations, end to end.

Reads every result file under the folders given (bench_decode.py and gsm8k.py JSON, chat
logs as JSONL: the formats of count_tokens.py), counts the generated tokens, and writes the
keep-set for vLLM's `draft_vocab_path`, next to it the counts (`<output stem>.counts.npy`,
to feed `count_tokens.py --add-to` later) and a JSON summary (`<output>.json`, schema
"magpie/fit-keepset/1": the count summary, the keep-set figures, the self-check).

    python3 magpie fit-keepset results/ --model ~/models/Qwen3.8-Flash-Next -o keep.npy

The keep-set is written as .npy, .pt or .json (a JSON list of ids, as community recipes pass
them around); the mtp_pruning patch reads all three as `draft_vocab_path`. `magpie sweep
--keepset-sizes` fits keep-sets of given sizes from one corpus with this module's counting.

Self-check: every `--holdout-every`-th text is set aside, a keep-set is fitted on the rest, and
its coverage of the set-aside texts is reported. When that falls clearly under the target,
the counts are too few for this workload (a keep-set fitted on 50k tokens covered only ~77 % of
a 541k-token corpus): count more before serving with it. The keep-set written is always
fitted on all texts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from magpie import cli, files
from magpie.mtp_pruning.build_keepset import (
    DRIFT_WARNING,
    build_keep_set,
    check_arguments,
    coverage_of,
    save_keep_set,
    special_ids,
)
from magpie.mtp_pruning.count_tokens import (
    Progress,
    count_items,
    input_files,
    items_from_file,
    load_tokenizer,
    read_vocab_size,
    save_counts,
)

SCHEMA = files.schema("fit-keepset", 1)


def output_paths(output: Path) -> tuple[Path, Path, Path]:
    """What fit_keepset writes: the keep-set, its counts (for count_tokens --add-to), its summary."""
    return output, output.with_name(output.stem + ".counts.npy"), Path(str(output) + ".json")


def count_corpus(paths: list[str], model: str, tokenizer: str | None = None, quiet: bool = True):
    """The generated-token counts of a corpus (files or folders of generations, as fit-keepset
    reads them): (counts, input files, texts). ValueError naming the corpus when it holds none."""
    import numpy as np

    inputs = input_files(paths)
    if not inputs:
        raise ValueError(f"--corpus {', '.join(paths)}: no .json, .jsonl or .txt files of generations")
    vocab_size = read_vocab_size(Path(model))
    counts = np.zeros(vocab_size, dtype=np.int64)
    items = [item for path in inputs for item in items_from_file(path) if item.token_ids or item.text]
    progress = Progress(quiet)
    texts, _ = count_items(items, load_tokenizer(tokenizer or model), counts, "corpus", progress=progress)
    progress.close()
    if counts.sum() == 0:
        raise ValueError(f"--corpus {', '.join(paths)}: no generated tokens in {len(inputs)} file(s)")
    return counts, inputs, texts


def keep_set_of_size(counts, size: int, specials=()):
    """The `size` ids a draft head of that many rows keeps: the tokenizer's special ids first
    (the draft must propose end-of-turn markers), then the most counted ids (ties and uncounted
    ids by the lower id), sorted. ValueError when `size` is not below the vocabulary."""
    import numpy as np

    vocab_size = counts.shape[0]
    if not 0 < size < vocab_size:
        raise ValueError(f"keep-set size {size}: give 1 to {vocab_size - 1} ids (the vocabulary has {vocab_size})")
    chosen = dict.fromkeys(int(i) for i in specials if 0 <= int(i) < vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))  # count descending, then id ascending
    for i in order[: size + len(chosen)]:
        if len(chosen) >= size:
            break
        chosen.setdefault(int(i))
    return np.array(sorted(chosen)[:size], dtype=np.int64)


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("magpie fit-keepset", __doc__)
    parser.add_argument("results", nargs="+", help="folders (or files) of generations")
    parser.add_argument("--model", required=True, help="model folder: config.json (vocab_size) and tokenizer")
    parser.add_argument("--tokenizer", help="tokenizer folder or name (unset: the --model folder)")
    parser.add_argument("-o", "--output", required=True, help="keep-set to write (.npy, .pt or .json)")
    parser.add_argument("--coverage", type=float, default=0.99, help="share of generated tokens to cover")
    parser.add_argument("--holdout-every", type=int, default=10, help="self-check: set aside every N-th text (0: off)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    cli.add_force(parser, "the keep-set, its .counts.npy and its .json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cli.require_modules("fit-keepset", "numpy", "transformers")
    import numpy as np

    if (status := check_arguments(args, [("--output", path) for path in output_paths(Path(args.output))])) is not None:
        return status
    try:
        inputs = input_files(args.results)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not inputs:
        print(f"error: no .json, .jsonl or .txt files under {', '.join(args.results)}", file=sys.stderr)
        return 1
    vocab_size = read_vocab_size(Path(args.model))
    tokenizer_name = args.tokenizer or args.model
    tokenizer = load_tokenizer(tokenizer_name)

    items = [item for path in inputs for item in items_from_file(path) if item.token_ids or item.text]
    every = args.holdout_every if args.holdout_every and len(items) >= 2 * args.holdout_every else 0
    held_out = [item for i, item in enumerate(items) if every and i % every == every - 1]
    fitted = [item for i, item in enumerate(items) if not (every and i % every == every - 1)]

    progress = Progress(args.quiet)
    fit_counts = np.zeros(vocab_size, dtype=np.int64)
    held_counts = np.zeros(vocab_size, dtype=np.int64)
    fit_texts, fit_tokens = count_items(fitted, tokenizer, fit_counts, "results", progress=progress)
    held_texts, held_tokens = count_items(held_out, tokenizer, held_counts, "results", progress=progress)
    progress.close()
    counts = fit_counts + held_counts
    if counts.sum() == 0:
        print(f"error: no generated tokens found in {len(inputs)} file(s)", file=sys.stderr)
        return 1

    specials = special_ids(tokenizer_name)
    try:
        keep, figures = build_keep_set(counts, args.coverage, specials=specials)
    except ValueError as e:  # e.g. every id of the vocabulary counted: nothing to prune
        print(f"error: {e}", file=sys.stderr)
        return 1
    check = None
    if every and held_tokens and fit_tokens:
        check_keep, check_figures = build_keep_set(fit_counts, args.coverage, specials=specials)
        check = {
            "holdout_every": every,
            "fitted_texts": fit_texts,
            "fitted_tokens": fit_tokens,
            "held_out_texts": held_texts,
            "held_out_tokens": held_tokens,
            "keep_ids": check_figures["keep_ids"],
            "fitted_coverage": check_figures["coverage"],
            "held_out_coverage": coverage_of(check_keep, held_counts),
        }

    output = Path(args.output)
    _, counts_path, summary_path = output_paths(output)
    save_keep_set(keep, str(output))
    save_counts(counts, counts_path)
    summary = {
        "schema": SCHEMA,
        "output": str(output),
        "counts": str(counts_path),
        "inputs": [str(p) for p in inputs],
        "texts": fit_texts + held_texts,
        "tokens": int(counts.sum()),
        "keepset": figures,
        "self_check": check,
    }
    files.atomic_write_json(summary_path, summary, indent=2)

    print(f"counted {summary['texts']} texts, {summary['tokens']} generated tokens from {len(inputs)} file(s)")
    print(
        f"keep-set {output}: K = {figures['keep_ids']} of {vocab_size} ids ({100 * figures['vocab_share']:.2f}%), "
        f"coverage {100 * figures['coverage']:.2f}% (target {100 * args.coverage:.2f}%)"
    )
    if check:
        print(
            f"self-check: fitted on {check['fitted_tokens']} tokens, covers {100 * check['held_out_coverage']:.2f}% "
            f"of {check['held_out_tokens']} held-out tokens"
        )
        if check["held_out_coverage"] < check["fitted_coverage"] - DRIFT_WARNING:
            print(
                "warning: the held-out coverage is clearly under the fitted one: too few tokens counted for this "
                "workload; count more generations (hundreds of thousands of tokens) before relying on it",
                file=sys.stderr,
            )
    print(f'serve with: --speculative-config \'{{"method": "mtp", "draft_vocab_path": "{output.resolve()}"}}\'')
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_tool("fit-keepset", main, sys.argv[1:]))
