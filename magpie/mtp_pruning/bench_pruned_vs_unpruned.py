#!/usr/bin/env python3
"""Serve one model twice, unpruned MTP then pruned MTP, and compare decode speed, acceptance and outputs.

Starts `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 (a free port) with MTP, runs
the same greedy prompts one at a time (streaming, after a warm-up request), stops it, and does the
same with `draft_vocab_path` set to the keep-set. The vLLM it runs must have the mtp_pruning patch
applied (`magpie/patches.py status --python PY`); put an overlay first on PYTHONPATH or pass
`--python` of a patched environment.

    python3 magpie bench-pruned --model ~/models/tiny-248k --keepset keep.npy \\
        --server-arg=--no-enable-prefix-caching --output cpu-e2e.json

Per server: decode tok/s of each request (tokens after the first over the time from the first to
the last token), their median and the aggregate, and from the /metrics delta the acceptance rate
(accepted / draft tokens) and length (1 + accepted / drafts). Then whether the two servers
generated the same token ids for every prompt (they must: the target verifies every token).
Output: JSON (schema "mtp_pruning/bench-pruned-vs-unpruned/1": settings, summary per server,
speed-up, identical_outputs, then the per-request records), and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

SCHEMA = "mtp_pruning/bench-pruned-vs-unpruned/1"
PROMPTS = [
    "The engineer explains the final number",
    "Write a function that sorts a list",
    "Our team builds a bright idea",
    "def return import class self",
    "A student reads an old book before dinner",
    "The server returns the value again",
]
COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One vLLM server process (its own process group), addressed by the PID started here."""

    def __init__(self, python: str, model: str, spec: dict, extra: list[str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.cmd = [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "bench",
            "--host", "127.0.0.1", "--port", str(self.port), "--speculative-config", json.dumps(spec), *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> float:
        t0 = time.monotonic()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up; see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout} s; see {self.log}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def counters(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            page = resp.read().decode()
        values = dict.fromkeys(COUNTERS, 0.0)
        for line in page.splitlines():
            for key, name in COUNTERS.items():
                if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
                    values[key] += float(line.rpartition(" ")[2])
        return values

    def complete(self, prompt: str, max_tokens: int) -> dict:
        body = {
            "model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True, "ignore_eos": True,
        }  # fmt: skip
        request = urllib.request.Request(
            self.url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        token_ids: list[int] = []
        first_chunk = 0
        t_sent, t_first, t_last = time.monotonic(), None, None
        with urllib.request.urlopen(request, timeout=600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                ids = choice.get("token_ids") or []
                if ids:
                    t_last = time.monotonic()
                    if t_first is None:
                        t_first, first_chunk = t_last, len(ids)
                    token_ids.extend(ids)
        decode = None
        if t_first is not None and t_last > t_first:
            decode = (len(token_ids) - first_chunk) / (t_last - t_first)
        return {
            "prompt": prompt,
            "tokens": len(token_ids),
            "ttft_s": None if t_first is None else t_first - t_sent,
            "latency_s": None if t_last is None else t_last - t_sent,
            "decode_tok_per_s": decode,
            "token_ids": token_ids,
        }


def measure(args, name: str, spec: dict, prompts: list[str]) -> dict:
    server = Server(args.python, args.model, spec, args.server_arg, Path(args.log_dir) / f"{name}.log")
    print(f"[{name}] starting vLLM ({' '.join(server.cmd[1:4])} ...), log {server.log}", file=sys.stderr)
    try:
        startup = server.start(args.startup_timeout)
        server.complete(prompts[0], min(16, args.max_tokens))  # warm-up, outside the counters
        before = server.counters()
        t0 = time.monotonic()
        records = []
        for i, prompt in enumerate(prompts):
            records.append(server.complete(prompt, args.max_tokens))
            print(f"[{name}] {i + 1}/{len(prompts)} requests", file=sys.stderr)
        wall = time.monotonic() - t0
        after = server.counters()
    finally:
        server.stop()
    delta = {key: after[key] - before[key] for key in COUNTERS}
    rates = [r["decode_tok_per_s"] for r in records if r["decode_tok_per_s"]]
    log = server.log.read_text(errors="replace")
    return {
        "startup_s": startup,
        "requests": len(records),
        "output_tokens": sum(r["tokens"] for r in records),
        "wall_s": wall,
        "aggregate_tok_per_s": sum(r["tokens"] for r in records) / wall,
        "median_decode_tok_per_s": statistics.median(rates) if rates else None,
        "acceptance_rate": delta["accepted"] / delta["draft_tokens"] if delta["draft_tokens"] else None,
        "acceptance_length": 1 + delta["accepted"] / delta["drafts"] if delta["drafts"] else None,
        "spec_counters": delta,
        "log_lines": [line.split("] ", 1)[-1] for line in log.splitlines() if "MTP draft vocab pruned" in line],
        "log": str(server.log),
        "records": records,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
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
    args = parser.parse_args(argv)

    source = PROMPTS
    if args.prompts:
        lines = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        source = [item if isinstance(item, str) else item["prompt"] for item in lines]
    prompts = [source[i % len(source)] for i in range(args.num_prompts)]
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    keepset = str(Path(args.keepset).resolve())
    spec = {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
    runs = {
        "unpruned": measure(args, "unpruned", spec, prompts),
        "pruned": measure(args, "pruned", {**spec, "draft_vocab_path": keepset}, prompts),
    }
    identical = all(
        a["token_ids"] == b["token_ids"]
        for a, b in zip(runs["unpruned"]["records"], runs["pruned"]["records"], strict=True)
    )
    summary = {name: {k: v for k, v in run.items() if k != "records"} for name, run in runs.items()}
    speedup = None
    if summary["unpruned"]["median_decode_tok_per_s"] and summary["pruned"]["median_decode_tok_per_s"]:
        speedup = summary["pruned"]["median_decode_tok_per_s"] / summary["unpruned"]["median_decode_tok_per_s"]
    result = {
        "schema": SCHEMA,
        "model": args.model,
        "keepset": keepset,
        "settings": {k: v for k, v in vars(args).items() if k not in ("output",)},
        "summary": summary,
        "decode_speedup": speedup,
        "identical_outputs": identical,
        "records": {name: run["records"] for name, run in runs.items()},
    }
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'server':10} {'decode tok/s':>13} {'aggregate tok/s':>16} {'acceptance':>11} {'L':>6}")
    for name, run in summary.items():
        rate, length = run["acceptance_rate"], run["acceptance_length"]
        print(
            f"{name:10} {run['median_decode_tok_per_s'] or 0:>13.2f} {run['aggregate_tok_per_s']:>16.2f} "
            f"{(rate or 0) * 100:>10.1f}% {length or 0:>6.2f}"
        )
    print(f"decode speed-up {speedup:.2f}x; identical outputs: {'yes' if identical else 'NO'}")
    for line in summary["pruned"]["log_lines"]:
        print(f"  pruned log: {line}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
