#!/usr/bin/env python3
"""The sweep: decode and prefill latency over server configurations x input lengths x concurrency.

(Over 800 lines, one file: the plan, its resume, the runs and the outputs all read one plan
document; the keep-set sweep's arguments, keep-sets and table are in sweep_keepsets.py.)

For every configuration (MTP off, MTP k, MTP k with the pruned draft head, ...), every input
length and every concurrency, `--repeats` runs of `bench_decode.py` (streamed chat requests,
greedy, `--ignore-eos` so every request runs to `--output-len`): TTFT, TPOT and ITL p50/p99 as
`vllm bench serve` defines them, decode tok/s per request, aggregate tok/s and MTP acceptance.
Before every run the prefix cache is reset (POST /reset_prefix_cache) so no run reuses a
previous run's prompt, and a free-memory gate waits for MemAvailable to be above `--min-free`.

    python3 magpie sweep results/sweep-gb10 --model /models/Qwen3.8-Flash-Next-NVFP4 \\
        --config off:mtp=0 --config mtp3:mtp=3 --config pruned:mtp=3,draft_vocab=/models/keep.npy \\
        --input-lens 4096,16384,65536,131072 --concurrency 1,4 --repeats 3 --output-len 256

Configurations:
- `--config NAME:KEY=VALUE,...` is launched by the sweep through serve.sh (one server at a time,
  stopped before the next starts) with MODEL=--model, HOST=127.0.0.1, a free port and
  VLLM_SERVER_DEV_MODE=1 (vLLM 0.29 serves /reset_prefix_cache only in its dev mode). Keys:
  `mtp=K` (serve.sh's MTP; 0 = off), `draft_vocab=PATH` (DRAFT_VOCAB_PATH), or any serve.sh
  variable in capitals (GPU_MEM=0.7, MAX_MODEL_LEN=262144, ...). `--serve-arg` adds `vllm serve`
  arguments for every launched server. The rest of serve.sh's environment comes from yours.
- `--server NAME=URL` measures a server that is already running (its settings are its own; it
  needs VLLM_SERVER_DEV_MODE=1 for the prefix-cache reset, or pass --no-reset-prefix-cache).

Keep-set sizes (`--keepset-sizes 4096,8192,16384,32768,65536 --corpus FILE_OR_FOLDER`, or
`--keepsets a.npy,b.json,...`): one launched configuration per keep-set, named keep<K> (K ids)
or keep-<file name>, served through serve.sh with MTP=--keepset-mtp and DRAFT_VOCAB_PATH set to
it. Sizes are fitted from the one corpus by fit-keepset's counting (the tokenizer's special ids,
then the most generated ids) and written to RUN_DIR/keepsets/. vLLM loads a keep-set when it
starts, so a keep-set sweep starts one server per keep-set: five sizes are five server starts.
A size not below the model's vocabulary, or a keep-set file the mtp_pruning patch would refuse
(formats .npy, .pt, .safetensors, .json), is refused before any server starts. Per keep-set and
point: acceptance (mean length and per draft position), engine decode tok/s (median / min / max
over the repeats), the keep-set's coverage of the corpus (the share of the corpus's generated
tokens whose ids it keeps; given files need --corpus for it), and the best keep-set named: the
highest median decode tok/s, "within noise" when its range overlaps the runner-up's. Any
--config / --server runs too (e.g. `--config full:mtp=3`, the full draft head, for reference).

Prompts (`--prompt-style`): `chat` (default) is realistic text (the bench's coding and agent
requests, concatenated) cut to the input length with the server's own /tokenize and
/detokenize, followed by a question; `random` is random tokens drawn from that text's token ids
(random-token prompts give misleading MTP acceptance: use them for prefill/TPOT scaling only).
Every request gets its own prompt, written to RUN_DIR/prompts/ for reuse by other tools.

The run folder is resumable: every finished run is RUN_DIR/points/<config>/in<L>-c<C>-r<R>.json
(a bench-decode result) and is skipped when the sweep is run again; a configuration whose runs
are all done is not launched at all. A rerun may name fewer or more configurations, lengths,
concurrencies or repeats: RUN_DIR/sweep.json keeps the union, and the results cover every run
the folder holds. A rerun with another output length, prompt style, seed or prompts per point
is refused (its runs would not be comparable). RUN_DIR/results.json (schema
"magpie/sweep/4": a summary row per configuration x input length x concurrency, pooled over
repeats, each figure's median / min / max over the repeats, then every run), results.csv (the
summary rows), metrics.csv (one row per point and per figure: median, min, max over the
repeats), points.csv (one row per run) and, for a keep-set sweep, keepsets.csv (one row per
keep-set and point) are rewritten after every run; version 4 added the keep-set figures
(`keepset` of a configuration, `keep_ids`, `corpus_coverage` and `per_position_acceptance` of a
summary row, and `keepset_sweep`: its rows and the best keep-set per point). The table compares
each configuration's decode tok/s with the first configuration's and says "within noise" when
the repeats' ranges overlap. `--percentile-metrics`, `--metric-percentiles` and `--goodput` are
bench-decode's (`vllm bench serve`'s spelling). `report.py --sweep RUN_DIR` draws it. Decode tok/s is the engine's
(vllm:request_decode_time_seconds, pooled over a point's runs), never a client-side rate: see
bench_decode.py.

Exit status: 0 all runs done; 1 a run failed (the others go on); 2 bad arguments; 3 a server
died or did not start (the sweep stops; rerun to resume); 4 the memory gate stopped the sweep;
130 / 143 stopped by SIGINT (Ctrl-C) / SIGTERM (or 129, SIGHUP): the server the sweep launched
is stopped first, before anything is printed (a `| tee` that died with the Ctrl-C cannot stop
it), and finished runs are kept.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import random
import re
import signal
import sys
import time
import urllib.error
import urllib.request

from magpie import cli, files
from magpie.measure import bench_decode, common, sweep_keepsets
from magpie.serving import client
from magpie.serving.process import ServerDied, ServeShServer

SCHEMA = files.schema("sweep", 4)
PLAN_SCHEMA = files.schema("sweep-plan", 1)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
KEY_ALIASES = {"mtp": "MTP", "draft_vocab": "DRAFT_VOCAB_PATH"}
# Settings that define what a point measures: a rerun with other values would mix two sweeps.
FIXED_SETTINGS = ("output_len", "prompt_style", "seed", "prompts_per_point")
# The latency figures of a run (points.csv) and of a point pooled over its repeats (results.csv).
LATENCY_FIELDS = [
    "prompt_tokens_mean",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
]
SUMMARY_FIELDS = [
    "config",
    "depth",
    "input_len",
    "concurrency",
    "repeats",
    "requests",
    "failed",
    *LATENCY_FIELDS,
    "e2el_p50_ms",
    "engine_decode_tok_s",
    "aggregate_tok_s_median",
    "aggregate_tok_s_min",
    "aggregate_tok_s_max",
    "acceptance_length",
    "keep_ids",
    "corpus_coverage",
]
POINT_FIELDS = [
    "config",
    "depth",
    "input_len",
    "concurrency",
    "repeat",
    "status",
    "requests",
    "failed",
    *LATENCY_FIELDS,
    "engine_decode_tok_s",
    "aggregate_tok_s",
    "acceptance_length",
    "file",
]

# --------------------------------------------------------------------------------------------
# Arguments


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 4096,16384")
    return values


def depth_list(text: str) -> list[int]:
    """`--depths 0,16k,32k` -> [0, 16384, 32768] (k = 1024 tokens, as llama-benchy's d16k)."""
    values = []
    for item in (x.strip().lower() for x in text.split(",") if x.strip()):
        try:
            values.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {item!r} is not a token count (e.g. 0,16k,32768)") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give token counts >= 0, e.g. 0,16k,32k")
    return sorted(set(values))


def parse_config(text: str) -> dict:
    name, _, spec = text.partition(":")
    if not NAME_RE.match(name):
        raise argparse.ArgumentTypeError(f"--config {text!r}: the name must match {NAME_RE.pattern}")
    env = {}
    for item in filter(None, spec.split(",")):
        key, sep, value = item.partition("=")
        key = KEY_ALIASES.get(key, key)
        if not sep or not re.fullmatch(r"[A-Z][A-Z0-9_]*", key):
            raise argparse.ArgumentTypeError(
                f"--config {text!r}: {item!r} is not mtp=K, draft_vocab=PATH or a serve.sh VARIABLE=VALUE"
            )
        if key == "DRAFT_VOCAB_PATH" and not os.path.isabs(value):
            raise argparse.ArgumentTypeError(f"--config {text!r}: draft_vocab must be an absolute path")
        env[key] = value
    return {"name": name, "kind": "launched", "env": env}


def parse_server(text: str) -> dict:
    name, sep, url = text.partition("=")
    if not sep or not NAME_RE.match(name) or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"--server {text!r}: expected NAME=http://HOST:PORT")
    return {"name": name, "kind": "running", "url": url.rstrip("/")}


# --------------------------------------------------------------------------------------------
# Prompts of a given length

CHAT_QUESTION = "\n\nSummarise the material above in three sentences."


def _tokenize(base: str, model: str, text: str) -> list[int]:
    body = {"model": model, "prompt": text, "add_special_tokens": False}
    return client.http_post(base + "/tokenize", body)["tokens"]


def _chat_overhead(base: str, model: str) -> int:
    """Tokens the chat template adds around one user message."""
    probe = "probe"
    body = {"model": model, "messages": [{"role": "user", "content": probe}], "add_generation_prompt": True}
    return len(client.http_post(base + "/tokenize", body)["tokens"]) - len(_tokenize(base, model, probe))


def _detokenize(base: str, model: str, tokens: list[int]) -> str:
    return client.http_post(base + "/detokenize", {"model": model, "tokens": tokens})["prompt"]


def make_prompts(base: str, model: str, style: str, input_len: int, count: int, seed: int) -> list[str]:
    """`count` distinct prompts of about `input_len` tokens once the chat template is applied
    (text cut at a token boundary can re-tokenize a few tokens differently: the bench records the
    real prompt_tokens of every request)."""
    rng = random.Random(f"{seed}-{style}-{input_len}")
    corpus = _tokenize(base, model, "\n\n".join(bench_decode.BUILTIN_PROMPTS))
    vocabulary = sorted(set(corpus))
    overhead = _chat_overhead(base, model)
    prompts = []
    for number in range(count):
        head = f"[request {number}, sweep seed {seed}] "  # every prompt distinct from its first tokens
        budget = max(1, input_len - overhead - len(_tokenize(base, model, head + CHAT_QUESTION)))
        if style == "random":
            ids = [rng.choice(vocabulary) for _ in range(budget)]
        else:
            start = rng.randrange(len(corpus))
            ids = [corpus[(start + i) % len(corpus)] for i in range(budget)]
        prompts.append(head + _detokenize(base, model, ids) + CHAT_QUESTION)
    return prompts


# --------------------------------------------------------------------------------------------
# Servers


def launched_server(config: dict, args, log_path: str) -> ServeShServer:
    """serve.sh for one launched configuration, with MODEL=--model and VLLM_SERVER_DEV_MODE=1
    (for /reset_prefix_cache) over the caller's environment, then the configuration's settings."""
    env = {**os.environ, "MODEL": args.model, "VLLM_SERVER_DEV_MODE": "1", **config["env"]}
    return ServeShServer(log_path, env, args.serve_arg)


def reset_prefix_cache(base: str, attempts: int = 10) -> None:
    """POST /reset_prefix_cache until it reports success (it fails while requests hold blocks)."""
    for _ in range(attempts):
        try:
            if client.http_post(base + "/reset_prefix_cache", {}, timeout=60).get("success"):
                return
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise SystemExit(
                    f"error: {base} has no /reset_prefix_cache: vLLM 0.29 serves it only with "
                    "VLLM_SERVER_DEV_MODE=1 in the server's environment (servers the sweep launches get it); "
                    "restart the server with it, or pass --no-reset-prefix-cache"
                ) from None
            raise
        time.sleep(1)
    raise RuntimeError(f"{base}/reset_prefix_cache kept answering success=false (requests still running?)")


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def memory_gate(min_free: int, wait_s: float) -> tuple[bool, int]:
    """Wait up to `wait_s` for MemAvailable >= min_free; (passed, last MemAvailable)."""
    deadline = time.monotonic() + wait_s
    while True:
        free = mem_available()
        if free >= min_free or time.monotonic() >= deadline:
            return free >= min_free, free
        time.sleep(min(5.0, max(0.1, deadline - time.monotonic())))


# --------------------------------------------------------------------------------------------
# Results


def point_path(run_dir: str, config: str, input_len: int, concurrency: int, repeat: int, depth: int = 0) -> str:
    """A run's file; at a context depth (--depths) its name starts d<DEPTH>-."""
    prefix = f"d{depth}-" if depth else ""
    return os.path.join(run_dir, "points", config, f"{prefix}in{input_len}-c{concurrency}-r{repeat}.json")


def point_done(path: str) -> bool:
    try:
        with open(path) as f:
            return json.load(f).get("status") == "complete"
    except (OSError, ValueError):
        return False


def _pct(figures: dict | None, key: str):
    return (figures or {}).get(key)


def latency_figures(summary: dict, records: list[dict]) -> dict:
    """LATENCY_FIELDS from a bench summary and the records it was made of."""
    prompt_tokens = [r["prompt_tokens"] for r in records if r["ok"] and r["prompt_tokens"]]
    figures = {"prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None}
    for name in ("ttft", "tpot", "itl"):
        for q in ("p50", "p99"):
            figures[f"{name}_{q}_ms"] = _pct(summary[f"{name}_ms"], q)
    return figures


def point_row(
    config: str, input_len: int, concurrency: int, repeat: int, result: dict, path: str, depth: int = 0
) -> dict:
    s = result["summary"]
    return {
        "config": config,
        "depth": depth,
        "input_len": input_len,
        "concurrency": concurrency,
        "repeat": repeat,
        "status": result["status"],
        "requests": s["requests"],
        "failed": s["failed"],
        **latency_figures(s, result["records"]),
        "engine_decode_tok_s": s["engine_decode_tok_per_s"],
        "aggregate_tok_s": s["aggregate_output_tok_per_s"],
        "acceptance_length": (s["spec_decode"] or {}).get("acceptance_length"),
        "file": path,
    }


def pooled_engine_decode(results: list[dict]) -> float | None:
    """The engine's decode tok/s over several runs: (generated tokens - one first token per
    request) / decode seconds, summed over the runs (not a mean of the runs' rates). None when a
    run lacks the sums (a server without them, or a run an older bench wrote into this folder)."""
    tokens = seconds = 0.0
    for result in results:
        s = result["summary"]
        if not s.get("engine_decode_seconds") or s.get("generation_tokens_counted_by_server") is None:
            return None
        tokens += s["generation_tokens_counted_by_server"] - s["engine_decode_requests"]
        seconds += s["engine_decode_seconds"]
    return tokens / seconds if seconds else None


# The figures of a point whose spread over the repeats is kept (median / min / max / n), and the
# one the comparison between configurations reads.
SPREAD_FIGURES = (
    "engine_decode_tok_s",
    "aggregate_tok_s",
    "ttft_p50_ms",
    "tpot_p50_ms",
    "itl_p50_ms",
    "e2el_p50_ms",
    "acceptance_length",
    "goodput_req_s",
)
COMPARED_FIGURE = "engine_decode_tok_s"
METRICS_CSV = "metrics.csv"  # one row per point and per figure
METRICS_FIELDS = ["config", "depth", "input_len", "concurrency", "figure", "median", "min", "max", "n"]


def run_figures(result: dict, slos: dict[str, float]) -> dict:
    """SPREAD_FIGURES of one run."""
    s = result["summary"]
    good = common.goodput(result["records"], slos, s["duration_s"]) if slos else None
    return {
        "engine_decode_tok_s": s.get("engine_decode_tok_per_s"),
        "aggregate_tok_s": s.get("aggregate_output_tok_per_s"),
        **{f"{m}_p50_ms": _pct(s.get(f"{m}_ms"), "p50") for m in ("ttft", "tpot", "itl", "e2el")},
        "acceptance_length": (s.get("spec_decode") or {}).get("acceptance_length"),
        "goodput_req_s": (good or {}).get("request_per_s"),
    }


def summary_row(
    config: str, input_len: int, concurrency: int, results: list[dict], plan: dict | None = None, depth: int = 0
) -> dict:
    """One configuration x length x concurrency: percentiles over the requests of all repeats,
    and each figure's spread over the repeats."""
    plan = plan or {}
    metrics = plan.get("percentile_metrics")
    qs = plan.get("metric_percentiles")
    slos = plan.get("goodput_slo_ms") or {}
    records = [r for res in results for r in res["records"] if r["ok"]]
    pooled = [r for res in results for r in res["records"]]
    summary = bench_decode.summarize(pooled, None, None, None, metrics, qs)  # pooled over the repeats
    per_run = [run_figures(res, slos) for res in results]
    spreads = {name: common.spread([f[name] for f in per_run]) for name in SPREAD_FIGURES}
    aggregates = sorted(x["summary"]["aggregate_output_tok_per_s"] for x in results)
    accepted = drafts = 0.0
    by_position: list[float] = []
    for res in results:
        spec = res["summary"]["spec_decode"]
        if spec:
            accepted += spec["accepted_tokens"]
            drafts += spec["drafts"]
            for i, share in enumerate(spec.get("per_position_acceptance") or []):
                by_position += [0.0] * (i + 1 - len(by_position))
                by_position[i] += share * spec["drafts"]
    keepset = sweep_keepsets.keepset_of(plan, config)
    return {
        "config": config,
        "depth": depth,
        "input_len": input_len,
        "concurrency": concurrency,
        "repeats": len(results),
        "requests": summary["requests"],
        "failed": summary["failed"],
        **latency_figures(summary, records),
        "e2el_p50_ms": _pct(summary["e2el_ms"], "p50"),
        "engine_decode_tok_s": pooled_engine_decode(results),
        "aggregate_tok_s_median": client.percentile(aggregates, 50) if aggregates else None,
        "aggregate_tok_s_min": aggregates[0] if aggregates else None,
        "aggregate_tok_s_max": aggregates[-1] if aggregates else None,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance": [x / drafts for x in by_position] if drafts and by_position else None,
        "keep_ids": keepset.get("keep_ids"),
        "corpus_coverage": keepset.get("corpus_coverage"),
        "percentiles_ms": summary["percentiles_ms"],
        "goodput": {
            "slo_ms": slos,
            "good_requests": sum(common.goodput(res["records"], slos, None)["good_requests"] for res in results),
            "requests": len(pooled),
            "request_per_s": spreads["goodput_req_s"],
        }
        if slos
        else None,
        "spread": spreads,
    }


def metric_rows(summaries: list[dict]) -> list[dict]:
    """metrics.csv: one row per point (configuration x length x concurrency) and per figure, the
    figure's median / min / max over the repeats, and the pooled percentiles of the latencies."""
    rows = []
    for row in summaries:
        where = {k: row.get(k, 0) for k in ("config", "depth", "input_len", "concurrency")}
        for name, figures in row["spread"].items():
            if figures:
                rows.append(dict(where, figure=name, **figures))
        for metric, figures in (row.get("percentiles_ms") or {}).items():
            for key, value in (figures or {}).items():
                rows.append(dict(where, figure=f"{metric}_{key}_ms_pooled", median=value, n=row["requests"]))
    return rows


def _where(row: dict) -> tuple:
    return (row["config"], row.get("depth", 0), row["input_len"], row["concurrency"])


def compare_to_first(document: dict) -> dict[tuple, str]:
    """(config, input_len, concurrency) -> how its COMPARED_FIGURE stands against the first
    configuration's at the same length and concurrency ("within noise" when the repeats' ranges
    overlap)."""
    rows = document["summary"]
    if not rows:
        return {}
    first = document["configs"][0]["name"] if document.get("configs") else rows[0]["config"]
    base = {_where(r)[1:]: r for r in rows if r["config"] == first}
    out = {}
    for r in rows:
        ref = base.get(_where(r)[1:])
        if r["config"] == first or ref is None:
            out[_where(r)] = "(reference)" if r["config"] == first else "-"
            continue
        out[_where(r)] = common.compare(
            (ref.get("spread") or {}).get(COMPARED_FIGURE), (r.get("spread") or {}).get(COMPARED_FIGURE)
        )
    return out


def write_results(run_dir: str, plan: dict) -> dict:
    """Rebuild results.json / results.csv / points.csv from the point files on disk."""
    points, summaries = [], []
    depths = plan.get("depths") or [0]
    for config in plan["configs"]:
        for depth, input_len in ((d, n) for d in depths for n in plan["input_lens"]):
            for concurrency in plan["concurrency"]:
                done = []
                for repeat in range(1, plan["repeats"] + 1):
                    path = point_path(run_dir, config["name"], input_len, concurrency, repeat, depth)
                    if not os.path.exists(path):
                        continue
                    try:
                        with open(path) as f:
                            result = json.load(f)
                        result["summary"]["requests"]
                    except (OSError, ValueError, KeyError, TypeError):
                        continue  # unreadable (cut short by a full disk, say): not done, so run again
                    relative = os.path.relpath(path, run_dir)
                    points.append(point_row(config["name"], input_len, concurrency, repeat, result, relative, depth))
                    if result["status"] == "complete":
                        done.append(result)
                if done:
                    summaries.append(summary_row(config["name"], input_len, concurrency, done, plan, depth))
    expected = len(plan["configs"]) * len(depths) * len(plan["input_lens"]) * len(plan["concurrency"])
    expected *= plan["repeats"]
    finished = sum(p["status"] == "complete" for p in points)
    document = {
        "schema": SCHEMA,
        "tool": "sweep.py",
        "updated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "status": "complete" if finished == expected else "partial",
        "points_expected": expected,
        "points_complete": finished,
        "settings": {k: plan[k] for k in ("output_len", "prompt_style", "seed", "prompts_per_point")},
        "grid": {"depths": depths, **{k: plan[k] for k in ("input_lens", "concurrency", "repeats")}},
        "configs": plan["configs"],
        "host": plan["host"],
        "summary": summaries,
        "keepset_sweep": sweep_keepsets.keepset_sweep(summaries, plan["configs"], COMPARED_FIGURE),
        "points": points,
    }
    files.atomic_write_json(os.path.join(run_dir, files.SWEEP_RESULTS), document)
    if document["keepset_sweep"]:
        sweep_keepsets.write_csv(run_dir, document["keepset_sweep"])
    files.atomic_write_text(os.path.join(run_dir, files.SWEEP_RESULTS_CSV), common.csv_text(summaries, SUMMARY_FIELDS))
    files.atomic_write_text(os.path.join(run_dir, files.SWEEP_POINTS_CSV), common.csv_text(points, POINT_FIELDS))
    files.atomic_write_text(os.path.join(run_dir, METRICS_CSV), common.csv_text(metric_rows(summaries), METRICS_FIELDS))
    return document


def print_summary(document: dict, out=sys.stdout) -> None:
    def f(value, spec=".1f"):
        return "-" if value is None else format(value, spec)

    print(
        f"sweep: {document['points_complete']}/{document['points_expected']} runs complete ({document['status']})",
        file=out,
    )
    header = f"{'config':<14}{'depth':>7}{'input':>8}{'c':>4}{'rep':>4}"
    header += f"  {'TTFT p50/p99 ms':>18}  {'TPOT p50/p99 ms':>16}"
    header += f"  {'ITL p50/p99 ms':>16}  {'decode tok/s':>12}  {'agg tok/s':>9}  {'L':>5}  decode vs first"
    print(header, file=out)
    versus = compare_to_first(document)
    for row in document["summary"]:
        print(
            f"{row['config']:<14}{row.get('depth', 0):>7}{row['input_len']:>8}{row['concurrency']:>4}"
            f"{row['repeats']:>4}  "
            f"{f(row['ttft_p50_ms']):>8} / {f(row['ttft_p99_ms']):<7}  {f(row['tpot_p50_ms'], '.2f'):>7} / "
            f"{f(row['tpot_p99_ms'], '.2f'):<6}  {f(row['itl_p50_ms'], '.2f'):>7} / {f(row['itl_p99_ms'], '.2f'):<6}  "
            f"{f(row['engine_decode_tok_s']):>12}  {f(row['aggregate_tok_s_median']):>9}  "
            f"{f(row['acceptance_length'], '.2f'):>5}  "
            f"{versus.get(_where(row), '-')}",
            file=out,
        )
    print(
        "decode tok/s: per request, from the engine's timestamps; agg tok/s: all requests' output tokens over "
        "the run's wall time (median of the repeats); L: MTP acceptance length; decode vs first: the "
        "median's change against the first configuration, 'within noise' when the repeats' ranges overlap",
        file=out,
    )
    section = document.get("keepset_sweep")
    if section:
        sweep_keepsets.print_keepsets(section, out)


# --------------------------------------------------------------------------------------------
# The sweep


class Stopped(BaseException):
    """SIGTERM or SIGHUP: unwinds the sweep like Ctrl-C does, so that the `finally` that stops
    the launched server runs (Python's default for these signals exits without it, and the
    server, in a session of its own, would be left running)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, _frame):
    raise Stopped(signum)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def say(message: str) -> None:
    """A progress line on stderr that a dead reader (`2>&1 | tee`, killed by the same Ctrl-C)
    cannot turn into an exception."""
    bench_decode.write_lines(message, sys.stderr)


def stop_server(server: ServeShServer, name: str) -> None:
    """Stop the launched server, with SIGINT and the stop signals held off until it is down
    (a second Ctrl-C must not leave it half stopped); then say so."""
    held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, *STOP_SIGNALS)}
    try:
        server.stop()
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)
    say(f"sweep: {name}: its server stopped")


def load_plan(run_dir: str, args, configs: list[dict]) -> dict:
    path = os.path.join(run_dir, files.SWEEP_PLAN)
    settings = {
        "output_len": args.output_len,
        "prompt_style": args.prompt_style,
        "seed": args.seed,
        "prompts_per_point": args.prompts_per_point,
    }
    plan = {
        "schema": PLAN_SCHEMA,
        **settings,
        "input_lens": args.input_lens,
        "depths": args.depths,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "percentile_metrics": args.percentile_metrics,
        "metric_percentiles": args.metric_percentiles,
        "goodput_slo_ms": args.goodput_slo_ms,
        "configs": configs,
        "host": {"name": os.uname().nodename, "machine": os.uname().machine, "cpus": os.cpu_count()},
    }
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f)
        except (OSError, ValueError) as e:
            raise common.Refusal(f"{path} cannot be read ({e}); use a new RUN_DIR or restore the file") from None
        if not isinstance(old, dict):
            raise common.Refusal(f"{path} is not a sweep plan (a JSON object); use a new RUN_DIR")
        changed = [k for k in FIXED_SETTINGS if old.get(k) != settings[k]]
        if changed:
            raise SystemExit(
                f"error: {path} was made with other settings ({', '.join(f'{k}={old.get(k)!r}' for k in changed)}); "
                "its finished runs would not be comparable: use a new RUN_DIR, or the same settings"
            )
        plan["created"] = old.get("created")
        # A rerun may measure part of the grid or more of it: the plan (and results.json) covers both.
        ours = {c["name"] for c in configs}
        plan["configs"] = [c for c in old.get("configs", []) if c["name"] not in ours] + configs
        plan["input_lens"] = sorted(set(old.get("input_lens", [])) | set(args.input_lens))
        plan["depths"] = sorted(set(old.get("depths", [0])) | set(args.depths))
        plan["concurrency"] = sorted(set(old.get("concurrency", [])) | set(args.concurrency))
        plan["repeats"] = max(old.get("repeats", 0), args.repeats)
    else:
        plan["created"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    files.atomic_write_json(path, plan)
    return plan


def make_context(base: str, model: str, depth: int, seed: int) -> str:
    """About `depth` tokens of the bench's text: the context every request of a run at that depth
    starts with (llama-benchy's d16k), the same for all of them so the prefix cache can hold it."""
    corpus = _tokenize(base, model, "\n\n".join(bench_decode.BUILTIN_PROMPTS))
    start = random.Random(f"{seed}-context-{depth}").randrange(len(corpus))
    return _detokenize(base, model, [corpus[(start + i) % len(corpus)] for i in range(depth)]) + "\n\n"


def run_point(
    base: str, model: str, args, run_dir: str, config: str, input_len: int, concurrency: int, repeat: int, depth=0
):
    """One bench run; returns bench_decode's exit status. At a depth, every prompt is the run's
    context of `depth` tokens, then its own `input_len` tokens; after the prefix-cache reset one
    unmeasured request of the context alone fills the cache, so with prefix caching on TTFT is the
    prefill of `input_len` tokens at that depth, and TPOT / ITL / decode tok/s are decode at
    depth + input length."""
    count = max(args.prompts_per_point, concurrency)
    at = f"d{depth}-" if depth else ""
    prompt_file = os.path.join(run_dir, "prompts", f"{args.prompt_style}-{at}in{input_len}-r{repeat}-n{count}.jsonl")
    context = ""
    if depth:
        context = make_context(base, model, depth, args.seed * 1000 + repeat)
    if not os.path.exists(prompt_file):
        prompts = make_prompts(base, model, args.prompt_style, input_len, count, args.seed * 1000 + repeat)
        os.makedirs(os.path.dirname(prompt_file), exist_ok=True)
        files.atomic_write_text(prompt_file, "".join(json.dumps({"prompt": context + p}) + "\n" for p in prompts))
    if args.reset_prefix_cache:
        reset_prefix_cache(base)
    if depth:  # the context into the prefix cache (unmeasured)
        fill = bench_decode.request_body(
            argparse.Namespace(max_tokens=1, temperature=0.0, thinking=False, ignore_eos=True),
            model,
            [{"role": "user", "content": context}],
        )
        client.stream_chat(base, fill, args.timeout)
    path = point_path(run_dir, config, input_len, concurrency, repeat, depth)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    bench_args = [
        "--url", base,
        "--model", model,
        "-n", str(count),
        "-c", str(concurrency),
        "--max-tokens", str(args.output_len),
        "--warmup", "0",
        "--repeats", "1",  # one run per file: the sweep's own --repeats makes the repeats
        "--ignore-eos",
        "--prompts", prompt_file,
        "--timeout", str(args.timeout),
        "--label", f"{config} {at}in={input_len} c={concurrency} r={repeat}",
        "--output", path,
        "--force",
        "--percentile-metrics", ",".join(args.percentile_metrics),
        "--metric-percentiles", ",".join(f"{q:g}" for q in args.metric_percentiles),
    ]  # fmt: skip
    if args.goodput:
        bench_args += ["--goodput", *args.goodput]
    return bench_decode.main(bench_args)


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("magpie sweep", __doc__)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (created; reused to resume)")
    parser.add_argument("--config", type=parse_config, action="append", default=[], metavar="NAME:KEY=VALUE,...",
                        help="a configuration the sweep launches through serve.sh (repeatable)")  # fmt: skip
    parser.add_argument("--server", type=parse_server, action="append", default=[], metavar="NAME=URL",
                        help="a configuration already running at URL (repeatable)")  # fmt: skip
    parser.add_argument("--model", help="the checkpoint folder for launched configurations (serve.sh's MODEL)")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="a `vllm serve` argument for every launched server (repeatable)")  # fmt: skip
    parser.add_argument("--keepset-sizes", type=int_list, metavar="K,K,...",
                        help="a keep-set sweep: keep-sets of these sizes fitted from --corpus, one server start "
                        "each (vLLM loads the keep-set at start) (default: none)")  # fmt: skip
    parser.add_argument("--corpus", action="append", default=[], metavar="FILE_OR_FOLDER",
                        help="generations to fit --keepset-sizes on and to measure coverage against, as "
                        "fit-keepset reads them (repeatable; default: none)")  # fmt: skip
    parser.add_argument("--keepsets", type=sweep_keepsets.path_list, metavar="FILE,FILE,...",
                        help="a keep-set sweep over these files (.npy, .pt, .safetensors, .json), one server "
                        "start each (default: none)")  # fmt: skip
    parser.add_argument("--keepset-mtp", type=int, default=3,
                        help="MTP draft tokens of the keep-set sweep's servers (default: %(default)s)")  # fmt: skip
    parser.add_argument("--input-lens", type=int_list, default="4096,16384,65536,131072",
                        help="prompt lengths in tokens")  # fmt: skip
    parser.add_argument("--depths", type=depth_list, default="0",
                        help="context tokens before each prompt, e.g. 0,16k,32k (default: %(default)s)")  # fmt: skip
    parser.add_argument("--concurrency", type=int_list, default="1,4", help="requests in flight")
    parser.add_argument("--repeats", type=int, default=3, help="runs per point (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=256, help="tokens per request (default: %(default)s)")
    parser.add_argument("--prompts-per-point", type=int, default=8,
                        help="requests per run, at least the concurrency (default: %(default)s)")  # fmt: skip
    parser.add_argument("--prompt-style", choices=["chat", "random"], default="chat", help="default: %(default)s")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default: %(default)s)")
    parser.add_argument("--min-free", type=cli.parse_size, default="6GiB",
                        help="memory gate: MemAvailable needed before each run")  # fmt: skip
    parser.add_argument("--gate-wait", type=float, default=120,
                        help="seconds to wait for the gate, then stop (default: %(default)s)")  # fmt: skip
    parser.add_argument("--reset-prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="POST /reset_prefix_cache before each run")  # fmt: skip
    parser.add_argument("--start-timeout", type=float, default=1800,
                        help="seconds for a launched server to become healthy (default: %(default)s)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=900, help="seconds per request (default: %(default)s)")
    parser.add_argument("--percentile-metrics", default=common.DEFAULT_PERCENTILE_METRICS,
                        help="metrics whose percentiles are reported (default: %(default)s)")  # fmt: skip
    parser.add_argument("--metric-percentiles", default=common.DEFAULT_METRIC_PERCENTILES,
                        help="percentiles reported (default: %(default)s)")  # fmt: skip
    parser.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                        help="SLOs for goodput, KEY one of ttft, tpot, e2el (default: none)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        args.percentile_metrics = common.parse_percentile_metrics(args.percentile_metrics)
        args.metric_percentiles = common.parse_metric_percentiles(args.metric_percentiles)
        args.goodput_slo_ms = common.parse_goodput(args.goodput)
    except ValueError as e:
        parser.error(str(e))
    if args.keepset_mtp < 1:
        parser.error("--keepset-mtp must be >= 1 (a pruned draft head needs MTP on)")
    try:
        sweep_keepsets.check_keepsets(args)
    except common.Refusal as e:
        say(e.message)
        return 2
    configs = args.config + args.server
    if not configs and not (args.keepset_sizes or args.keepsets):
        parser.error("give at least one --config or --server (or --keepset-sizes / --keepsets)")
    names = [c["name"] for c in configs]
    if len(set(names)) != len(names):
        parser.error(f"configuration names must be unique: {names}")
    if args.config and not args.model:
        parser.error("--config (a launched configuration) needs --model, the checkpoint folder serve.sh serves")
    if args.repeats < 1 or args.output_len < 1 or args.prompts_per_point < 1:
        parser.error("--repeats, --output-len and --prompts-per-point must be >= 1")
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
    try:
        return run_sweep(args, configs)
    except KeyboardInterrupt:
        say("sweep: interrupted (Ctrl-C); finished runs are kept: rerun to resume")
        return 130
    except Stopped as e:
        say(f"sweep: stopped by {e}; finished runs are kept: rerun to resume")
        return 128 + e.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_sweep(args, configs: list[dict]) -> int:
    if os.path.exists(args.run_dir) and not os.path.isdir(args.run_dir):
        raise common.Refusal(f"RUN_DIR {args.run_dir} is a file; give a folder (created, or an earlier run's)")
    common.check_writable(os.path.join(args.run_dir, files.SWEEP_PLAN), "RUN_DIR")
    os.makedirs(args.run_dir, exist_ok=True)
    run_dir = os.path.abspath(args.run_dir)
    configs, keepsets = sweep_keepsets.with_keepsets(args, run_dir, configs)
    plan = load_plan(run_dir, args, configs)
    grid = [
        (n, c, r, d)
        for d in args.depths
        for n in args.input_lens
        for c in args.concurrency
        for r in range(1, args.repeats + 1)
    ]
    status = 0
    for config in configs:
        todo = [p for p in grid if not point_done(point_path(run_dir, config["name"], *p))]
        skipped = len(grid) - len(todo)
        say(f"sweep: {config['name']}: {len(todo)} runs to do, {skipped} done before (skipped)")
        if not todo:
            continue
        server = None
        try:
            if config["kind"] == "launched":
                stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
                log = os.path.join(run_dir, "servers", f"{config['name']}-{stamp}.log")
                server = launched_server(config, args, log)
                if config.get("keepset"):
                    number = [c["name"] for c in keepsets].index(config["name"]) + 1
                    say(
                        f"sweep: {config['name']}: server start {number} of {len(keepsets)} of the keep-set sweep "
                        f"({config['keepset']['keep_ids']} ids, {config['env']['DRAFT_VOCAB_PATH']})"
                    )
                say(f"sweep: {config['name']}: starting serve.sh (log {server.log_path})")
                try:
                    server.start(args.start_timeout)
                except (ServerDied, TimeoutError) as e:
                    say(f"error: {config['name']}: {e}")
                    return 3
                base = server.url
            else:
                base = config["url"]
                if not client.server_alive(base):
                    say(f"error: {config['name']}: no healthy server at {base}")
                    return 3
            listed = common.model_entry(base)
            model, max_len = listed["id"], listed.get("max_model_len")
            # One unmeasured request first: the first request after a start pays one-time costs.
            warm = bench_decode.request_body(
                argparse.Namespace(max_tokens=8, temperature=0.0, thinking=False, ignore_eos=True),
                model,
                [{"role": "user", "content": "warm-up"}],
            )
            client.stream_chat(base, warm, args.timeout)
            for number, (input_len, concurrency, repeat, depth) in enumerate(todo, 1):
                at = f"d={depth} " if depth else ""
                where = f"{config['name']} {at}in={input_len} c={concurrency} r={repeat}"
                if max_len and depth + input_len + args.output_len > max_len:
                    depth_plus = f"{depth} + " if depth else ""
                    say(
                        f"sweep: {where}: skipped, {depth_plus}{input_len} + {args.output_len} "
                        f"> max_model_len {max_len}"
                    )
                    status = max(status, 1)
                    continue
                passed, free = memory_gate(args.min_free, args.gate_wait)
                if not passed:
                    say(
                        f"error: memory gate: MemAvailable {free / 2**30:.1f} GiB < --min-free "
                        f"{args.min_free / 2**30:.1f} GiB after {args.gate_wait:.0f} s; stopping before {where} "
                        "(finished runs are kept: rerun to resume)"
                    )
                    write_results(run_dir, plan)
                    return 4
                say(f"sweep: [{number}/{len(todo)}] {where}")
                code = run_point(base, model, args, run_dir, config["name"], input_len, concurrency, repeat, depth)
                write_results(run_dir, plan)
                if code == 3:
                    say(f"error: {where}: the server died; rerun to resume")
                    return 3
                if code == 130:
                    raise KeyboardInterrupt  # the bench caught the Ctrl-C: the sweep stops the same way
                if code != 0:
                    status = max(status, 1)
        finally:
            # The stop comes before any print: a print to a dead pipe would raise first.
            if server is not None:
                stop_server(server, config["name"])
    document = write_results(run_dir, plan)
    table = io.StringIO()
    print_summary(document, table)
    bench_decode.write_lines(table.getvalue().rstrip("\n"))
    return status


if __name__ == "__main__":
    sys.exit(main())
