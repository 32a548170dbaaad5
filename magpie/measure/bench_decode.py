#!/usr/bin/env python3
"""Decode speed and MTP acceptance of a running vLLM server, measured the way a user feels it.

Streams N chat requests at concurrency C (temperature 0, thinking off) after a warm-up, and
reports per request the figures `vllm bench serve` reports, defined as it defines them: TTFT
(to the first chunk with `choices`), TPOT ((E2E latency - TTFT) / (output tokens - 1)), ITL
(the gap before every further chunk: under MTP one chunk is one engine step of several tokens)
and E2E latency; overall: aggregate output tok/s (all output tokens over the run's wall time);
and from the `/metrics` counters before and after the run (the warm-up excluded): decode tok/s
from the engine's own timestamps, the MTP acceptance length (1 + accepted / drafts), the
acceptance rate (accepted / draft tokens) and the acceptance per draft position.

Decode tok/s is the engine's figure only. Client-side times measure when chunks reached the
client: a front-end short of CPU can deliver a whole reply in a few milliseconds, and any rate
taken over such a window (first to last chunk, or 1 / TPOT) then reads tens of thousands of
tok/s. TPOT and ITL are still reported as vLLM defines them: they say what the client saw.

    python3 magpie bench-decode --url http://127.0.0.1:8100 -n 8 -c 1 --output c1.json

Prompts: a built-in set of realistic coding and agent requests (random tokens give misleading
acceptance), or `--prompts FILE`: JSONL or a JSON list, each item a string, {"prompt": str} or
{"messages": [...]}.

Percentiles and goodput as `vllm bench serve` spells them: `--percentile-metrics ttft,tpot,itl,e2el`
and `--metric-percentiles 50,90,99` choose the figures (summary.percentiles_ms); `--goodput
ttft:MS tpot:MS e2el:MS` counts the requests that met every SLO (summary.goodput, requests/s).

Outputs: `--output` (JSON, schema "magpie/bench-decode/4", documented in docs/benchmarks.md): a
summary first, the per-request records after, and `machine` (vLLM version and patch states from
`--server-log`'s launch manifest, GPU clocks, MemAvailable's low-water mark, ...: see
magpie/measure/machine.py); `--csv` (one row per metric); `--jsonl` (one line per request). A
table on stdout. Every output path is checked before the first request.

Status and exit code: a failed request is recorded and the run goes on; when no request at all
succeeded the status is "requests-failed" and the exit code 1. If the server dies, the results so
far are written with "status": "server-died" and the exit code is 3 (interrupted: "interrupted",
130).
"""

from __future__ import annotations

import csv
import datetime
import hashlib
import io
import json
import os
import sys
import time

from magpie import cli, files
from magpie.measure import common, machine
from magpie.serving import client
from magpie.serving.metrics import DECODE_TIME_COUNT, DECODE_TIME_SUM, GENERATION_TOKENS, MetricsSnapshot

SCHEMA = files.schema("bench-decode", 4)
CSV_FIELDS = ["label", "status", "metric", "unit", "n", "mean", "std", "median", "min", "max"]

BUILTIN_PROMPTS = [
    "Write a Python function `merge_intervals(intervals)` that merges overlapping closed intervals given as "
    "a list of (start, end) tuples. Explain the sorting step, state the complexity, and add three pytest tests.",
    "I have a FastAPI service whose /upload endpoint reads the whole file into memory. Rewrite it to stream "
    "the upload to disk in 1 MiB chunks, enforce a 2 GiB limit, and return the SHA-256 of the stored file.",
    "Review this shell snippet and list every bug: `for f in $(ls *.log); do cat $f | grep ERROR > errors.txt; "
    "done`. Then give a corrected version that handles spaces in file names.",
    "You are a coding agent. The test `test_parse_date` fails with `ValueError: unconverted data remains: Z`. "
    "The code calls `datetime.strptime(s, '%Y-%m-%dT%H:%M:%S')`. Propose a fix that accepts both '...Z' and "
    "'+00:00' suffixes, and show the patch as a unified diff.",
    "Explain the difference between a process and a thread in Linux, then write a C program that creates two "
    "threads incrementing a shared counter one million times each, first with a data race and then with a mutex.",
    "Write a SQL query that returns, for each customer, the total amount of their three most recent orders. "
    "Tables: customers(id, name), orders(id, customer_id, created_at, amount). Use a window function.",
    "Plan the steps an agent should take to add pagination to a REST endpoint `GET /items` in an existing "
    "Django project: which files to open, what to change, which tests to write, and how to verify it.",
    "Implement an LRU cache class in TypeScript with `get`, `put` and a capacity, O(1) per operation, "
    "using a Map. Include a short usage example and explain why Map preserves insertion order.",
    "Summarise what this Git history means and what to do next: `git status` says 'You have divergent "
    "branches and need to specify how to reconcile them'. Compare merge, rebase and fast-forward-only.",
    "Write a Rust function that reads a CSV file of (name, score) rows from stdin and prints the top five "
    "names by score, handling malformed lines by skipping them with a warning on stderr.",
    "A Kubernetes pod is stuck in CrashLoopBackOff. Write the sequence of kubectl commands you would run to "
    "find the cause, and explain what each output tells you.",
    "Convert this callback-style Node.js code to async/await with proper error handling: "
    "`fs.readFile(p, (err, data) => { if (err) throw err; db.save(JSON.parse(data), (e) => { if (e) "
    "console.log(e); }); });`",
    "Design a JSON schema for a tool call made by an AI agent: the tool name, arguments, a call id, and the "
    "result or error. Give one valid example and one invalid example with the validation error it triggers.",
    "Write a bash script that backs up a PostgreSQL database with pg_dump every night, keeps the last seven "
    "dumps, and exits non-zero with a clear message when the disk has less than 10 GB free.",
    "Given a Python list of dictionaries with keys 'user', 'event' and 'ts', write code that computes each "
    "user's session count, where a new session starts after 30 minutes of inactivity.",
    "Explain what a race condition in a web application's 'reserve seat' endpoint looks like, and show two "
    "fixes: a database row lock and an atomic conditional update. Discuss which scales better.",
]


def load_prompts(path: str | None) -> tuple[list[list[dict]], str]:
    """Chat message lists, and where they came from."""
    if path is None:
        return [[{"role": "user", "content": p}] for p in BUILTIN_PROMPTS], "builtin"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except IsADirectoryError:
        raise common.Refusal(f"--prompts {path} is a folder; give a JSONL or JSON file") from None
    except OSError as e:
        raise common.Refusal(f"--prompts {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise common.Refusal(f"--prompts {path} is not UTF-8 text; give a JSONL or JSON file") from None
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            items = json.loads(text)
        except ValueError as e:
            raise common.Refusal(f"--prompts {path}: not a JSON list ({e})") from None
    else:
        items = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except ValueError as e:
                    raise common.Refusal(f"--prompts {path} line {number}: not JSON ({e})") from None
    prompts = []
    for number, item in enumerate(items, 1):
        if isinstance(item, str):
            prompts.append([{"role": "user", "content": item}])
        elif isinstance(item, dict) and isinstance(item.get("messages"), list):
            prompts.append(item["messages"])
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompts.append([{"role": "user", "content": item["prompt"]}])
        else:
            raise SystemExit(
                f"error: {path} item {number}: expected a string, {{'prompt': str}} or {{'messages': [...]}}"
            )
    if not prompts:
        raise SystemExit(f"error: {path} holds no prompt")
    return prompts, os.path.abspath(path)


def request_body(args, model: str, messages: list[dict]) -> dict:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "chat_template_kwargs": {"enable_thinking": args.thinking},
        "return_token_ids": True,
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


def finish_record(index: int, prompt_id: int, raw: dict, t0: float) -> dict:
    """The published per-request record (times relative to the start of the measured run).

    TTFT, TPOT, ITL and E2E latency as `vllm bench serve` defines them (client.request_timing)."""
    timing = client.request_timing(raw)
    end = raw["t_end"] or raw["t_last"] or raw["t_sent"]
    return {
        "index": index,
        "prompt_id": prompt_id,
        "ok": raw["ok"],
        "error": raw["error"],
        "http_status": raw["http_status"],
        "start_s": raw["t_sent"] - t0 if raw["t_sent"] else None,
        "end_s": end - t0 if raw["t_sent"] else None,
        "ttft_s": timing["ttft_s"],
        "tpot_s": timing["tpot_s"],
        "itl_s": timing["itl_s"],
        "latency_s": timing["e2el_s"],
        "prompt_tokens": raw["prompt_tokens"],
        "output_tokens": raw["completion_tokens"],
        "first_chunk_tokens": raw["first_chunk_tokens"],
        "finish_reason": raw["finish_reason"],
        "chunks": raw["chunks"],
        "choice_chunks": [round(t, 6) for t in raw["choice_chunks"]],
        "output_sha256": hashlib.sha256(json.dumps(raw["token_ids"]).encode()).hexdigest() if raw["ok"] else None,
        "token_ids": raw["token_ids"],
        "text": raw["text"],
    }


def engine_decode(after: MetricsSnapshot, before: MetricsSnapshot) -> dict:
    """The engine's decode figures between two /metrics pages: vLLM times each finished
    request's decode from its first to its last token with the engine core's timestamps
    (vllm:request_decode_time_seconds), which no delivery of chunks can shorten. The raw sums
    are kept so that runs can be pooled (the sweep): tok/s = (tokens - requests) / seconds."""
    return {
        "tok_per_s": after.engine_decode_rate(before),
        "seconds": after.delta(before, DECODE_TIME_SUM),
        "requests": after.delta(before, DECODE_TIME_COUNT),
        "generation_tokens": after.delta(before, GENERATION_TOKENS),
    }


def mtp_state(page: MetricsSnapshot | None) -> dict:
    """Whether the server runs speculative decoding, read from /metrics before the run (its
    counters exist from the start), so that a run whose /metrics cannot be read afterwards (the
    server died) still says what it measured."""
    if page is None:
        return {"on": None, "num_speculative_tokens": None}
    spec = page.spec_decode()
    return {"on": spec is not None, "num_speculative_tokens": (spec or {}).get("num_speculative_tokens") or None}


def summarize(
    records: list[dict],
    duration: float | None,
    spec: dict | None,
    engine: dict | None,
    metrics: list[str] | None = None,
    qs: list[float] | None = None,
    slos: dict[str, float] | None = None,
) -> dict:
    """The run's figures. ttft_ms / tpot_ms / itl_ms / e2el_ms follow `vllm bench serve`'s
    calculate_metrics: TTFT and E2EL of every completed request, TPOT of those with more than one
    output token, ITL pooled over all requests' chunk gaps. Decode tok/s: the engine's only."""
    ok = [r for r in records if r["ok"]]
    output_tokens = sum(r["output_tokens"] for r in records)
    engine = engine or {}
    per_metric = {
        "ttft": [r["ttft_s"] * 1000 for r in ok if r["ttft_s"] is not None],
        "tpot": [r["tpot_s"] * 1000 for r in ok if r["tpot_s"] is not None],
        "itl": [gap * 1000 for r in ok for gap in r["itl_s"]],
        "e2el": [r["latency_s"] * 1000 for r in ok if r["latency_s"] is not None],
    }
    metrics = metrics if metrics is not None else list(common.LATENCY_METRICS)
    qs = qs if qs is not None else [50.0, 90.0, 99.0]
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "output_tokens": output_tokens,
        "duration_s": duration,
        "aggregate_output_tok_per_s": output_tokens / duration if duration else None,
        "ttft_s": client.stats([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        "ttft_ms": client.latency_stats([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        "tpot_ms": client.latency_stats([r["tpot_s"] for r in ok if r["tpot_s"] is not None]),
        "itl_ms": client.latency_stats([gap for r in ok for gap in r["itl_s"]]),
        "e2el_ms": client.latency_stats([r["latency_s"] for r in ok if r["latency_s"] is not None]),
        "engine_decode_tok_per_s": engine.get("tok_per_s"),
        "engine_decode_seconds": engine.get("seconds"),
        "engine_decode_requests": engine.get("requests"),
        "spec_decode": spec,
        "generation_tokens_counted_by_server": engine.get("generation_tokens"),
        "percentiles_ms": {name: common.percentiles(per_metric[name], qs) for name in metrics},
        "goodput": common.goodput(records, slos or {}, duration),
    }


def write_lines(text: str, stream=None) -> bool:
    """Print `text` to `stream` (default: stdout); when the reader has gone (a `| tee` or `| head`
    that exited, e.g. with the Ctrl-C that stopped the run) the text is dropped and the stream
    pointed at /dev/null, so neither this nor the interpreter's exit raises. False if dropped."""
    stream = stream or sys.stdout
    try:
        print(text, file=stream, flush=True)
        return True
    except BrokenPipeError:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        except (OSError, ValueError):  # not a real file descriptor (a test's StringIO)
            pass
        return False


def _fmt(value, spec=".1f"):
    return "-" if value is None else format(value, spec)


def latency_line(name: str, figures: dict | None) -> str:
    f = figures or {}
    return (
        f"  {name:<27}mean {_fmt(f.get('mean'), '.2f')}  p50 {_fmt(f.get('p50'), '.2f')}  "
        f"p90 {_fmt(f.get('p90'), '.2f')}  p99 {_fmt(f.get('p99'), '.2f')}  (n {f.get('n', 0)})"
    )


def print_table(result: dict, out=sys.stdout) -> None:
    s = result["summary"]
    cfg = result["config"]
    print(f"bench_decode  {result['label'] or ''}  status={result['status']}", file=out)
    print(
        f"  requests {s['completed']}/{s['requests']} ok at concurrency {cfg['concurrency']}, "
        f"max_tokens {cfg['max_tokens']}, {s['output_tokens']} output tokens in {_fmt(s['duration_s'], '.2f')} s",
        file=out,
    )
    print(latency_line("TTFT ms", s["ttft_ms"]), file=out)
    print(latency_line("TPOT ms", s["tpot_ms"]), file=out)
    print(latency_line("ITL ms (per chunk)", s["itl_ms"]), file=out)
    engine_note = "" if s["engine_decode_tok_per_s"] is not None else f" ({_engine_missing(result)})"
    print(f"  decode tok/s, engine times {_fmt(s['engine_decode_tok_per_s'])}{engine_note}", file=out)
    print(f"  aggregate output tok/s     {_fmt(s['aggregate_output_tok_per_s'])} (all requests, wall time)", file=out)
    print(f"  MTP                        {mtp_line(result)}", file=out)
    for name, figures in (s.get("percentiles_ms") or {}).items():
        chosen = "  ".join(f"{k} {_fmt(v, '.2f')}" for k, v in (figures or {}).items()) or "-"
        print(f"  {name.upper() + ' ms percentiles':<27}{chosen}", file=out)
    spread = s.get("spread") or {}
    if cfg.get("repeats", 1) > 1:
        for name in ("engine_decode_tok_per_s", "aggregate_output_tok_per_s", "tpot_p50_ms"):
            f = spread.get(name)
            if f:
                print(
                    f"  {name + ' over repeats':<27}median {_fmt(f['median'], '.2f')}  min {_fmt(f['min'], '.2f')}  "
                    f"max {_fmt(f['max'], '.2f')}  (n {f['n']})",
                    file=out,
                )
    good = s.get("goodput")
    if good:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in good["slo_ms"].items())
        print(
            f"  goodput                    {_fmt(good['request_per_s'], '.3f')} req/s: {good['good_requests']}/"
            f"{good['requests']} requests met {slos}",
            file=out,
        )


def csv_rows(result: dict) -> list[dict]:
    """One row per metric of one run: the latency figures (ms) with their percentiles, then the
    rates (tok/s), acceptance and goodput as single values (in `mean`)."""
    s = result["summary"]
    base = {"label": result["label"], "status": result["status"]}
    rows = []
    for name in common.LATENCY_METRICS:
        figures = s.get(f"{name}_ms") or {}
        row = dict(base, metric=name, unit="ms", **{k: figures.get(k) for k in CSV_FIELDS[4:]})
        row.update((s.get("percentiles_ms") or {}).get(name) or {})
        rows.append(row)
    spec = s.get("spec_decode") or {}
    good = s.get("goodput") or {}
    for metric, unit, value in (
        ("engine_decode", "tok/s", s.get("engine_decode_tok_per_s")),
        ("aggregate_output", "tok/s", s.get("aggregate_output_tok_per_s")),
        ("acceptance_length", "tokens/step", spec.get("acceptance_length")),
        ("goodput", "req/s", good.get("request_per_s")),
    ):
        rows.append(dict(base, metric=metric, unit=unit, n=1 if value is not None else 0, mean=value))
    return rows


def csv_text(rows: list[dict]) -> str:
    fields = list(CSV_FIELDS)
    for row in rows:
        fields += [k for k in row if k not in fields]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in fields})
    return out.getvalue()


def jsonl_text(result: dict) -> str:
    """One line per request: the record with the run's label and status (token ids and text kept)."""
    return "".join(
        json.dumps({"label": result["label"], "status": result["status"], **r}) + "\n" for r in result["records"]
    )


def write_outputs(args, result: dict) -> None:
    if args.output:
        files.atomic_write_json(args.output, result)
    if args.csv:
        files.atomic_write_text(args.csv, csv_text(csv_rows(result)))
    if args.jsonl:
        files.atomic_write_text(args.jsonl, jsonl_text(result))


def _engine_missing(result: dict) -> str:
    if result["status"] != "complete":
        return f"/metrics not read after the run: {result['status']}"
    return "the server's /metrics has no vllm:request_decode_time_seconds"


def mtp_line(result: dict) -> str:
    """What the table says about MTP: the acceptance when measured, else what /metrics said
    before the run (a server that died afterwards was still running MTP)."""
    spec = result["summary"]["spec_decode"]
    if spec:
        per_pos = " ".join(f"{x:.3f}" for x in spec["per_position_acceptance"] or [])
        return (
            f"acceptance length {_fmt(spec['acceptance_length'], '.3f')}  "
            f"rate {_fmt(spec['acceptance_rate'], '.3f')}  per position [{per_pos}]"
        )
    mtp = result["server"].get("mtp") or {}
    if mtp.get("on"):
        k = mtp.get("num_speculative_tokens")
        where = f" (k={k})" if k else ""
        return f"on{where}; acceptance not measured: /metrics not read after the run ({result['status']})"
    if mtp.get("on") is False:
        return "off (no speculative-decoding counters on /metrics)"
    return "unknown (/metrics not read)"


# The figures of each repeat, whose median / min / max over the repeats the summary keeps.
REPEAT_FIGURES = (
    "engine_decode_tok_per_s",
    "aggregate_output_tok_per_s",
    "ttft_p50_ms",
    "tpot_p50_ms",
    "itl_p50_ms",
    "e2el_p50_ms",
    "acceptance_length",
)


def run_once(args, base: str, model: str, prompts: list, repeat: int, before: MetricsSnapshot) -> dict:
    """One repeat: `-n` requests at `-c`; its records (indices continue over the repeats), status,
    wall time, the /metrics page after it (None when unread) and its own figures."""
    t0 = time.perf_counter()
    offset = (repeat - 1) * args.num_prompts

    def body(index: int) -> dict:
        return request_body(args, model, prompts[index % len(prompts)])

    def make_record(index: int, raw: dict) -> dict:
        return dict(finish_record(offset + index, index % len(prompts), raw, t0), repeat=repeat)

    records, status = client.run_requests(
        base,
        args.num_prompts,
        args.concurrency,
        body,
        make_record,
        args.timeout,
        progress=lambda done: f"repeat {repeat}/{args.repeats}: {len(done)}/{args.num_prompts} requests",
    )
    ends = [r["end_s"] for r in records if r["end_s"] is not None]
    duration = max(ends) if ends else None
    after, spec, engine = None, None, None
    if status == "complete":
        try:
            after = common.fetch_metrics(base, f"after repeat {repeat}")
            spec = after.spec_decode(before)
            engine = engine_decode(after, before)
        except common.Refusal as e:
            print(f"warning: {e.message.removeprefix('error: ')}", file=sys.stderr)
    s = summarize(records, duration, spec, engine)
    figures = {
        "repeat": repeat,
        "status": status,
        "duration_s": duration,
        "engine_decode_tok_per_s": s["engine_decode_tok_per_s"],
        "aggregate_output_tok_per_s": s["aggregate_output_tok_per_s"],
        **{f"{m}_p50_ms": (s[f"{m}_ms"] or {}).get("p50") for m in ("ttft", "tpot", "itl", "e2el")},
        "acceptance_length": (spec or {}).get("acceptance_length"),
    }
    return {"records": records, "status": status, "duration_s": duration, "metrics_after": after, "figures": figures}


def _metrics_or_none(base: str) -> MetricsSnapshot | None:
    try:
        return common.fetch_metrics(base, "before the run")
    except common.Refusal as e:
        print(f"warning: {e.message.removeprefix('error: ')}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("magpie bench-decode", __doc__)
    cli.add_server(parser)
    parser.add_argument("-n", "--num-prompts", type=int, default=8, help="measured requests (default: %(default)s)")
    parser.add_argument("-c", "--concurrency", type=int, default=1, help="requests in flight (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=256, help="max_tokens per request (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured requests first (default: %(default)s)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of -n requests, pooled; each figure's median/min/max is kept (default: %(default)s)",
    )
    parser.add_argument("--prompts", metavar="FILE", help="JSONL/JSON prompts (default: the built-in set)")
    parser.add_argument("--thinking", action="store_true", help="let the model think (default: thinking off)")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens (default: off)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per request (default: %(default)s)")
    parser.add_argument("--label", default="", help="configuration name shown in tables and the report")
    parser.add_argument(
        "--percentile-metrics",
        default=common.DEFAULT_PERCENTILE_METRICS,
        help="metrics whose percentiles are reported, of ttft,tpot,itl,e2el (default: %(default)s)",
    )
    parser.add_argument(
        "--metric-percentiles",
        default=common.DEFAULT_METRIC_PERCENTILES,
        help="percentiles reported, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:MS",
        help="SLOs for goodput, KEY one of ttft, tpot, e2el, in ms (e.g. ttft:500 tpot:50; default: none)",
    )
    parser.add_argument("--output", metavar="JSON", help="write the results here (default: table only)")
    parser.add_argument("--csv", metavar="CSV", help="one row per metric (default: none)")
    parser.add_argument("--jsonl", metavar="JSONL", help="one line per request (default: none)")
    parser.add_argument(
        "--server-log",
        metavar="LOG",
        help="serve.sh's LOG of the server: its launch manifest gives vLLM and patch states (default: none)",
    )
    cli.add_force(parser, "the --output/--csv/--jsonl files")
    args = parser.parse_args(argv)
    if args.num_prompts < 1 or args.concurrency < 1 or args.max_tokens < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--num-prompts, --concurrency, --max-tokens and --repeats must be >= 1, --warmup >= 0")
    try:
        metric_names = common.parse_percentile_metrics(args.percentile_metrics)
        qs = common.parse_metric_percentiles(args.metric_percentiles)
        slos = common.parse_goodput(args.goodput)
    except ValueError as e:
        parser.error(str(e))
    outputs = [(flag, path) for flag, path in (("--output", args.output), ("--csv", args.csv), ("--jsonl", args.jsonl))]
    chosen = [os.path.abspath(path) for _, path in outputs if path]
    if len(set(chosen)) != len(chosen):
        parser.error("--output, --csv and --jsonl must be different files")
    for flag, path in outputs:
        files.check_output(path, args.force, what=flag)
        common.check_writable(path, flag)
    if not args.url.startswith(("http://", "https://")):
        parser.error(f"--url {args.url}: give the scheme, e.g. http://{args.url}")
    base = args.url.rstrip("/")
    prompts, source = load_prompts(args.prompts)

    if not client.server_alive(base):
        print(f"error: no healthy vLLM server at {base} (GET /health failed)", file=sys.stderr)
        return 2
    model = args.model or common.model_entry(base)["id"]
    vllm_version = client.server_version(base)
    state = machine.Machine(args.server_log, vllm_version)
    result = {
        "schema": SCHEMA,
        "tool": "bench_decode.py",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "label": args.label,
        "status": "running",
        "server": {
            "url": base,
            "model": model,
            "vllm_version": vllm_version,
            "mtp": mtp_state(_metrics_or_none(base)),
        },
        "config": {
            "num_prompts": args.num_prompts,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "thinking": args.thinking,
            "ignore_eos": args.ignore_eos,
            "temperature": args.temperature,
            "prompts": source,
            "prompt_count": len(prompts),
            "percentile_metrics": metric_names,
            "metric_percentiles": qs,
            "goodput_slo_ms": slos or None,
        },
        "machine": None,
        "summary": None,
        "metrics_delta": None,
        "repeats": [],
        "records": [],
    }

    for i in range(args.warmup):
        raw = client.stream_chat(base, request_body(args, model, prompts[i % len(prompts)]), args.timeout)
        if not raw["ok"] and raw["server_gone"] and not client.server_alive(base):
            print(f"error: the server died during the warm-up ({raw['error']})", file=sys.stderr)
            result["status"] = "server-died"
            result["summary"] = summarize([], None, None, None, metric_names, qs, slos)
            result["summary"]["spread"] = dict.fromkeys(REPEAT_FIGURES)
            result["machine"] = state.record()
            write_outputs(args, result)
            return 3

    metrics_before = common.fetch_metrics(base, "before the run")
    result["server"]["mtp"] = mtp_state(metrics_before)  # after the warm-up: every counter is there
    records: list[dict] = []
    repeats: list[dict] = []
    status, duration, metrics_last = "complete", 0.0, metrics_before
    with state.watch():
        for repeat in range(1, args.repeats + 1):
            run = run_once(args, base, model, prompts, repeat, metrics_last)
            records += run["records"]
            status = run["status"]
            duration += run["duration_s"] or 0.0
            metrics_last = run["metrics_after"]
            repeats.append(run["figures"])
            if status != "complete" or metrics_last is None:
                break
    if status == "complete" and not any(r["ok"] for r in records):
        status = "requests-failed"
    spec, deltas, engine = None, {}, None
    if status == "complete" and metrics_last is not None:  # pooled over the repeats
        spec = metrics_last.spec_decode(metrics_before)
        deltas = metrics_last.counter_deltas(metrics_before)
        engine = engine_decode(metrics_last, metrics_before)
    duration = duration or None
    result["status"] = status
    result["summary"] = summarize(records, duration, spec, engine, metric_names, qs, slos)
    result["summary"]["spread"] = {name: common.spread([r[name] for r in repeats]) for name in REPEAT_FIGURES}
    result["repeats"] = repeats
    result["metrics_delta"] = deltas or None
    result["machine"] = state.record()
    result["records"] = records
    write_outputs(args, result)
    table = io.StringIO()
    print_table(result, table)
    write_lines(table.getvalue().rstrip("\n"))
    if status == "requests-failed":
        first = next((r["error"] for r in records if r["error"]), "no reply")
        write_lines(f"error: none of the {len(records)} requests got a readable reply (first: {first})", sys.stderr)
        return 1
    if status == "server-died":
        write_lines(f"error: the server at {base} stopped answering; partial results written", sys.stderr)
        return 3
    if status == "interrupted":
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
