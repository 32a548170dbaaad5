"""The keep-set sweep of `magpie sweep` (--keepset-sizes, --corpus, --keepsets, --keepset-mtp;
sweep.py's docstring, its --help, says what a user gets): the keep-sets checked before any server
starts, one launched configuration per keep-set (sizes fitted from the corpus, or the given
files) with its corpus coverage, and, from the sweep's summary rows, the keep-set table
(results.json's `keepset_sweep`, keepsets.csv, the printed table) with the best keep-set per
point. sweep.py runs the configurations and writes the files; this module imports nothing of it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from magpie import files
from magpie.measure import bench_decode, common

KEEPSETS_CSV = "keepsets.csv"  # a keep-set sweep: one row per keep-set and point
KEEPSET_FIELDS = [
    "config",
    "keep_ids",
    "source",
    "corpus_coverage",
    "depth",
    "input_len",
    "concurrency",
    "repeats",
    "acceptance_length",
    "per_position_acceptance",
    "decode_tok_s_median",
    "decode_tok_s_min",
    "decode_tok_s_max",
    "best",
]

# --------------------------------------------------------------------------------------------
# Arguments and the keep-sets, before any server starts


def path_list(text: str) -> list[str]:
    paths = [x.strip() for x in text.split(",") if x.strip()]
    if not paths:
        raise argparse.ArgumentTypeError(f"{text!r}: give keep-set files, e.g. a.npy,b.json")
    return paths


def check_keepsets(args) -> int | None:
    """Before anything starts: the vocabulary of --model, sizes below it, given keep-set files
    as the mtp_pruning patch reads them. Returns the vocabulary size; raises Refusal (one line)."""
    from magpie.mtp_pruning.count_tokens import read_vocab_size
    from magpie.serving import preflight

    if not (args.keepset_sizes or args.keepsets):
        if args.corpus:
            raise common.Refusal("--corpus is for a keep-set sweep: add --keepset-sizes or --keepsets")
        return None
    if not args.model:
        raise common.Refusal("a keep-set sweep launches its servers: give --model, the checkpoint folder")
    if args.keepset_sizes and not args.corpus:
        raise common.Refusal("--keepset-sizes needs --corpus FILE_OR_FOLDER, the generations to fit the sizes on")
    try:
        vocab = read_vocab_size(Path(args.model))
    except files.InputError as e:
        raise common.Refusal(str(e)) from None
    too_big = [k for k in args.keepset_sizes or [] if k >= vocab]
    if too_big:
        raise common.Refusal(
            f"--keepset-sizes {','.join(map(str, too_big))}: not below the vocabulary of {args.model} "
            f"({vocab} ids); a keep-set holds fewer ids than the vocabulary (the full head is --config NAME:mtp=K)"
        )
    for path in args.keepsets or []:
        try:
            preflight.read_keep_ids(os.path.abspath(path), vocab)
        except preflight.Refused as e:
            raise common.Refusal(f"--keepsets: {e}") from None
    return vocab


def _say(message: str) -> None:
    """A progress line on stderr, as sweep.say writes it (a dead reader cannot raise)."""
    bench_decode.write_lines(message, sys.stderr)


def keepset_configs(args, run_dir: str) -> list[dict]:
    """One launched configuration per keep-set: the --keepset-sizes fitted from --corpus (written
    to RUN_DIR/keepsets/keep<K>.npy) and the --keepsets files, with their corpus coverage."""
    if not (args.keepset_sizes or args.keepsets):
        return []
    import numpy as np

    from magpie.mtp_pruning import build_keepset, fit_keepset
    from magpie.serving import preflight

    counts = inputs = None
    if args.corpus:
        _say(f"sweep: counting the corpus ({', '.join(args.corpus)}) with {args.model}'s tokenizer")
        try:
            counts, inputs, _ = fit_keepset.count_corpus(args.corpus, args.model)
        except (ValueError, FileNotFoundError, files.InputError) as e:
            raise common.Refusal(str(e).removeprefix("error: ")) from None
    total = int(counts.sum()) if counts is not None else None

    def entry(name: str, path: str, ids, source: str) -> dict:
        coverage = float(counts[ids].sum() / total) if counts is not None else None
        keepset = {"keep_ids": int(len(ids)), "source": source, "path": path, "corpus_coverage": coverage}
        if counts is not None:
            keepset.update(corpus_tokens=total, corpus_files=[str(p) for p in inputs])
        env = {"MTP": str(args.keepset_mtp), "DRAFT_VOCAB_PATH": path}
        return {"name": name, "kind": "launched", "env": env, "keepset": keepset}

    configs = []
    if args.keepset_sizes:
        specials = build_keepset.special_ids(args.model)
        folder = os.path.join(run_dir, "keepsets")
        os.makedirs(folder, exist_ok=True)
        for size in sorted(set(args.keepset_sizes)):
            ids = fit_keepset.keep_set_of_size(counts, size, specials)
            path = os.path.join(folder, f"keep{size}.npy")
            if os.path.exists(path) and not np.array_equal(np.load(path), ids):
                raise common.Refusal(
                    f"{path} was fitted from another corpus; its finished runs would not be comparable: "
                    "use a new RUN_DIR, or the same --corpus"
                )
            build_keepset.save_keep_set(ids, path)
            configs.append(entry(f"keep{size}", path, ids, "fitted"))
    for given in args.keepsets or []:
        path = os.path.abspath(given)
        ids = preflight.read_keep_ids(path).numpy()
        stem = re.sub(r"[^A-Za-z0-9_.-]", "-", os.path.splitext(os.path.basename(path))[0])
        configs.append(entry(f"keep-{stem}", path, ids, "file"))
    names = [c["name"] for c in configs]
    if len(set(names)) != len(names):
        raise common.Refusal(f"--keepsets: two keep-sets give one configuration name ({names}); rename a file")
    return configs


def with_keepsets(args, run_dir: str, configs: list[dict]) -> tuple[list[dict], list[dict]]:
    """The sweep's configurations followed by the keep-set sweep's (keepset_configs), and the
    latter alone; refuses a --config / --server name that a keep-set takes."""
    keepsets = keepset_configs(args, run_dir)
    taken = {c["name"] for c in configs} & {c["name"] for c in keepsets}
    if taken:
        raise common.Refusal(f"--config / --server names {sorted(taken)} are the keep-set sweep's; rename them")
    if keepsets:
        _say(
            f"sweep: keep-set sweep: {len(keepsets)} keep-sets ("
            + ", ".join(f"{c['name']} {c['keepset']['keep_ids']} ids" for c in keepsets)
            + f"), one server start each (vLLM loads the keep-set at start), MTP={args.keepset_mtp}"
        )
    return configs + keepsets, keepsets


# --------------------------------------------------------------------------------------------
# The figures of a keep-set sweep


def keepset_of(plan: dict, config: str) -> dict:
    """The keep-set figures of a configuration of a keep-set sweep ({} for any other)."""
    for c in plan.get("configs") or []:
        if c["name"] == config:
            return c.get("keepset") or {}
    return {}


def keepset_sweep(summaries: list[dict], configs: list[dict], compared: str) -> dict | None:
    """The keep-set sweep's table (one row per keep-set and point) and, per point, the best
    keep-set: the highest median of the figure `compared` (the sweep's engine decode tok/s) over
    the repeats, and how it stands against the runner-up (common.compare: "within noise" when
    their ranges overlap). None when no configuration is a keep-set of the sweep."""
    keepsets = {c["name"]: c["keepset"] for c in configs if c.get("keepset")}
    if not keepsets:
        return None
    rows, points = [], {}
    for row in summaries:
        if row["config"] not in keepsets:
            continue
        figure = (row.get("spread") or {}).get(compared) or {}
        keepset = keepsets[row["config"]]
        rows.append(
            {
                "config": row["config"],
                "keep_ids": keepset["keep_ids"],
                "source": keepset["source"],
                "corpus_coverage": keepset.get("corpus_coverage"),
                **{k: row.get(k, 0) for k in ("depth", "input_len", "concurrency")},
                "repeats": row["repeats"],
                "acceptance_length": row["acceptance_length"],
                "per_position_acceptance": row.get("per_position_acceptance"),
                "decode_tok_s_median": figure.get("median"),
                "decode_tok_s_min": figure.get("min"),
                "decode_tok_s_max": figure.get("max"),
                "decode_tok_s": figure or None,
                "best": False,
            }
        )
        points.setdefault((row.get("depth", 0), row["input_len"], row["concurrency"]), []).append(rows[-1])
    best = []
    for (depth, input_len, concurrency), candidates in points.items():
        ranked = sorted(
            (r for r in candidates if r["decode_tok_s_median"] is not None),
            key=lambda r: (-r["decode_tok_s_median"], r["keep_ids"]),
        )
        if not ranked:
            continue
        ranked[0]["best"] = True
        runner = ranked[1] if len(ranked) > 1 else None
        best.append(
            {
                "depth": depth,
                "input_len": input_len,
                "concurrency": concurrency,
                "config": ranked[0]["config"],
                "keep_ids": ranked[0]["keep_ids"],
                "decode_tok_s_median": ranked[0]["decode_tok_s_median"],
                "runner_up": runner["config"] if runner else None,
                "versus_runner_up": common.compare(runner["decode_tok_s"], ranked[0]["decode_tok_s"])
                if runner
                else "no other keep-set measured",
            }
        )
    return {"keepsets": keepsets, "rows": rows, "best": best}


def keepset_csv_rows(section: dict | None) -> list[dict]:
    out = []
    for row in (section or {}).get("rows", []):
        positions = row["per_position_acceptance"]
        out.append({**row, "per_position_acceptance": " ".join(f"{x:.4f}" for x in positions) if positions else None})
    return out


def write_csv(run_dir: str, section: dict) -> None:
    """RUN_DIR/keepsets.csv: the table of a keep-set sweep (keepset_sweep's section)."""
    text = common.csv_text(keepset_csv_rows(section), KEEPSET_FIELDS)
    files.atomic_write_text(os.path.join(run_dir, KEEPSETS_CSV), text)


def print_keepsets(section: dict, out=sys.stdout) -> None:
    def f(value, spec=".1f"):
        return "-" if value is None else format(value, spec)

    print("\nkeep-set sweep (one server start per keep-set):", file=out)
    print(
        f"{'keep-set':<16}{'ids':>8}{'coverage':>10}{'depth':>7}{'input':>8}{'c':>4}{'rep':>4}"
        f"  {'L':>5}  {'per position':<22}  decode tok/s median [min - max]",
        file=out,
    )
    for row in section["rows"]:
        coverage = "-" if row["corpus_coverage"] is None else f"{100 * row['corpus_coverage']:.2f} %"
        positions = " ".join(f"{x:.2f}" for x in row["per_position_acceptance"] or []) or "-"
        print(
            f"{row['config']:<16}{row['keep_ids']:>8}{coverage:>10}{row['depth']:>7}{row['input_len']:>8}"
            f"{row['concurrency']:>4}{row['repeats']:>4}  {f(row['acceptance_length'], '.2f'):>5}  {positions:<22}  "
            f"{f(row['decode_tok_s_median'])} [{f(row['decode_tok_s_min'])} - {f(row['decode_tok_s_max'])}]"
            f"{'  <- best' if row['best'] else ''}",
            file=out,
        )
    for best in section["best"]:
        at = f"d={best['depth']} " if best["depth"] else ""
        versus = best["versus_runner_up"]
        if best["runner_up"]:
            versus = f"vs {best['runner_up']}: {versus}"
        print(
            f"best keep-set at {at}in={best['input_len']} c={best['concurrency']}: {best['config']} "
            f"({best['keep_ids']} ids), {f(best['decode_tok_s_median'])} tok/s median; {versus}",
            file=out,
        )
