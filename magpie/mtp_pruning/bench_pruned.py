#!/usr/bin/env python3
"""Serve one model twice, unpruned MTP then pruned MTP, and compare decode speed, acceptance and outputs.

Starts `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 (a free port) with MTP, runs
the same greedy prompts one at a time (streaming, after a warm-up request), stops it, and does the
same with `draft_vocab_path` set to the keep-set. The vLLM it runs must have the mtp_pruning patch
applied (`magpie/patches.py status --python PY`); put an overlay first on PYTHONPATH or pass
`--python` of a patched environment.

    python3 magpie bench-pruned --model ~/models/tiny-248k --keepset keep.npy \\
        --server-arg=--no-enable-prefix-caching --output cpu-e2e.json

Per server, from the /metrics delta around the measured requests: decode tok/s from the
engine's own request times (vllm:request_decode_time_seconds: generated tokens less one first
token per request over the summed decode seconds; chunks that reach the client in a burst
cannot shorten it), the acceptance rate (accepted / draft tokens) and length (1 + accepted /
drafts); beside them the aggregate tok/s over the wall time. Then whether the two servers
generated the same token ids for every prompt (they must: the target verifies every token).
Output: JSON (schema "magpie/bench-pruned-vs-unpruned/2": settings, summary per server,
speed-up, identical_outputs, then the per-request records: TTFT, latency, token ids), and a
table on stdout. Version 1 took a median of per-request rates over the first-to-last chunk
window, which a burst collapses.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from magpie import cli, files
from magpie.serving.client import COMPLETIONS, stream_chat
from magpie.serving.metrics import SPEC_ACCEPTED, SPEC_DRAFT_TOKENS, SPEC_DRAFTS, MetricsSnapshot
from magpie.serving.process import VllmServer

SCHEMA = files.schema("bench-pruned-vs-unpruned", 2)
PROMPTS = [
    "The engineer explains the final number",
    "Write a function that sorts a list",
    "Our team builds a bright idea",
    "def return import class self",
    "A student reads an old book before dinner",
    "The server returns the value again",
]
COUNTERS = {"drafts": SPEC_DRAFTS, "draft_tokens": SPEC_DRAFT_TOKENS, "accepted": SPEC_ACCEPTED}


def start_server(args, name: str, spec: dict) -> VllmServer:
    """vLLM with MTP `spec` on 127.0.0.1 and a free port, served as "bench", its log in --log-dir."""
    return VllmServer(
        args.model,
        ["--speculative-config", json.dumps(spec), *args.server_arg],
        log_path=Path(args.log_dir) / f"{name}.log",
        python=args.python,
        served_name="bench",
        max_model_len=None,  # the model's own
    )


def counters(page: MetricsSnapshot) -> dict[str, float]:
    return {key: page.sum(name) or 0.0 for key, name in COUNTERS.items()}


def complete(server: VllmServer, prompt: str, max_tokens: int) -> dict:
    """One greedy streamed text completion of `max_tokens` tokens: its TTFT, latency and ids."""
    body = {
        "model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, "ignore_eos": True,
    }  # fmt: skip
    raw = stream_chat(server.url, body, timeout=600, endpoint=COMPLETIONS)
    if not raw["ok"]:
        raise RuntimeError(f"request to {server.url}{COMPLETIONS} failed: {raw['error']}; see {server.log_path}")
    return {
        "prompt": prompt,
        "tokens": raw["completion_tokens"],
        "ttft_s": None if raw["t_first"] is None else raw["t_first"] - raw["t_sent"],
        "latency_s": None if raw["t_last"] is None else raw["t_last"] - raw["t_sent"],
        "token_ids": raw["token_ids"],
    }


def measure(args, name: str, spec: dict, prompts: list[str]) -> dict:
    server = start_server(args, name, spec)
    print(f"[{name}] starting vLLM ({' '.join(server.cmd[1:4])} ...), log {server.log_path}", file=sys.stderr)
    try:
        server.start(args.startup_timeout)
        complete(server, prompts[0], min(16, args.max_tokens))  # warm-up, outside the counters
        before = MetricsSnapshot.fetch(server.url)
        t0 = time.monotonic()
        records = []
        for i, prompt in enumerate(prompts):
            records.append(complete(server, prompt, args.max_tokens))
            print(f"[{name}] {i + 1}/{len(prompts)} requests", file=sys.stderr)
        wall = time.monotonic() - t0
        after = MetricsSnapshot.fetch(server.url)
    finally:
        server.stop()
    delta = {key: counters(after)[key] - counters(before)[key] for key in COUNTERS}
    log = server.log_path.read_text(errors="replace")
    return {
        "startup_s": server.startup_s,
        "requests": len(records),
        "output_tokens": sum(r["tokens"] for r in records),
        "wall_s": wall,
        "aggregate_tok_per_s": sum(r["tokens"] for r in records) / wall,
        "engine_decode_tok_per_s": after.engine_decode_rate(before),
        "acceptance_rate": delta["accepted"] / delta["draft_tokens"] if delta["draft_tokens"] else None,
        "acceptance_length": 1 + delta["accepted"] / delta["drafts"] if delta["drafts"] else None,
        "spec_counters": delta,
        "log_lines": [line.split("] ", 1)[-1] for line in log.splitlines() if "MTP draft vocab pruned" in line],
        "log": str(server.log_path),
        "records": records,
    }


def read_prompts(path: str | None, count: int) -> list[str]:
    """`count` prompts (cycled) from the JSONL at `path` (strings or {"prompt": ...}), or the
    built-in ones; files.InputError names the line that is neither."""
    source = PROMPTS
    if path:
        source = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as e:
                    raise files.InputError(f"--prompts {path} line {number}: not JSON ({e.msg})") from None
                if isinstance(item, dict) and isinstance(item.get("prompt"), str):
                    item = item["prompt"]
                if not isinstance(item, str):
                    raise files.InputError(
                        f'--prompts {path} line {number}: neither a string nor {{"prompt": "..."}}; one prompt a line'
                    )
                source.append(item)
        if not source:
            raise files.InputError(f'--prompts {path}: no prompts; one JSON string or {{"prompt": ...}} a line')
    return [source[i % len(source)] for i in range(count)]


def check_keep_set(path: str, model: str) -> None:
    """Refuse (files.InputError) a keep-set the pruned server would refuse, by the patch's own
    rules and the model's vocabulary, before any server starts."""
    from magpie.mtp_pruning.count_tokens import read_vocab_size
    from magpie.serving import preflight

    try:
        preflight.read_keep_ids(path, read_vocab_size(Path(model)))
    except preflight.Refused as e:
        raise files.InputError(f"--keepset: {e}") from None


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("magpie bench-pruned", __doc__)
    parser.add_argument("--model", required=True, help="model folder (target with MTP weights)")
    parser.add_argument("--keepset", required=True, help="keep-set for the pruned run (.npy/.pt/.safetensors)")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the patched vLLM environment")
    parser.add_argument("--num-speculative-tokens", type=int, default=2, help="MTP draft tokens per step")
    parser.add_argument("--prompts", help="JSONL of prompts (strings or {'prompt': ...}); default: built-in")
    parser.add_argument("-n", "--num-prompts", type=int, default=6, help="prompts to run (cycled)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt (ignore_eos)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra vLLM argument (repeatable)")
    parser.add_argument("--startup-timeout", type=float, default=1200, help="seconds to wait for /health")
    parser.add_argument("--log-dir", default=".", help="folder for the two server logs")
    parser.add_argument("--output", help="JSON results file")
    cli.add_force(parser, "the --output file")
    args = parser.parse_args(argv)
    # Every input checked, and every output allowed, before the first server starts.
    if args.num_prompts < 1 or args.max_tokens < 1 or args.num_speculative_tokens < 1:
        parser.error("--num-prompts, --max-tokens and --num-speculative-tokens must be at least 1")
    files.check_input(args.model, "--model", kind="dir")
    files.check_input(args.keepset, "--keepset")
    files.check_input(args.prompts, "--prompts")
    if not (os.path.isfile(args.python) and os.access(args.python, os.X_OK)):
        raise files.InputError(f"--python {args.python}: not an executable file; give the patched environment's Python")
    files.check_distinct([("--output", args.output)], [("--keepset", args.keepset), ("--prompts", args.prompts)])
    files.check_output(args.output, args.force)
    check_keep_set(args.keepset, args.model)
    prompts = read_prompts(args.prompts, args.num_prompts)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    keep_set = str(Path(args.keepset).resolve())
    spec = {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
    runs = {
        "unpruned": measure(args, "unpruned", spec, prompts),
        "pruned": measure(args, "pruned", {**spec, "draft_vocab_path": keep_set}, prompts),
    }
    identical = all(
        a["token_ids"] == b["token_ids"]
        for a, b in zip(runs["unpruned"]["records"], runs["pruned"]["records"], strict=True)
    )
    summary = {name: {k: v for k, v in run.items() if k != "records"} for name, run in runs.items()}
    speedup = None
    if summary["unpruned"]["engine_decode_tok_per_s"] and summary["pruned"]["engine_decode_tok_per_s"]:
        speedup = summary["pruned"]["engine_decode_tok_per_s"] / summary["unpruned"]["engine_decode_tok_per_s"]
    result = {
        "schema": SCHEMA,
        "model": args.model,
        "keepset": keep_set,
        "settings": {k: v for k, v in vars(args).items() if k not in ("output", "force")},
        "summary": summary,
        "decode_speedup": speedup,
        "identical_outputs": identical,
        "records": {name: run["records"] for name, run in runs.items()},
    }
    if args.output:
        files.atomic_write_json(args.output, result, indent=2)
    print(f"{'server':10} {'decode tok/s':>13} {'aggregate tok/s':>16} {'acceptance':>11} {'L':>6}")
    for name, run in summary.items():
        rate, length = run["acceptance_rate"], run["acceptance_length"]
        print(
            f"{name:10} {run['engine_decode_tok_per_s'] or 0:>13.2f} {run['aggregate_tok_per_s']:>16.2f} "
            f"{(rate or 0) * 100:>10.1f}% {length or 0:>6.2f}"
        )
    shown = f"{speedup:.2f}x" if speedup is not None else "not measured (no vllm:request_decode_time_seconds)"
    print(f"decode speed-up {shown}; identical outputs: {'yes' if identical else 'NO'}")
    for line in summary["pruned"]["log_lines"]:
        print(f"  pruned log: {line}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(cli.run_tool("bench-pruned", main, sys.argv[1:]))
