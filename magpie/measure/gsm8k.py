#!/usr/bin/env python3
"""GSM8K accuracy of a running vLLM server: zero-shot, greedy, thinking off.

Reads a local GSM8K-format data set (JSONL, or parquet when pyarrow is installed): one record per
problem with `question` and `answer`, the answer ending in `#### <number>`. Asks each question
through `/v1/chat/completions` and scores the reply's final number against the reference.

    python3 magpie gsm8k --url http://127.0.0.1:8100 --dataset gsm8k/test.jsonl --output gsm8k.json

Answer extraction, in order: the last `#### <number>` in the reply (the data set's own
convention, which the prompt asks for), else the last `\\boxed{<number>}`, else the last number in
the reply. Numbers compare numerically after dropping thousands separators, `$` and `%`.

The data set is identified in the output by its SHA-256 and record count; the full GSM8K test
split has 1319 problems, and `--expect-records` makes any other count an error, so a wrong split
or a truncated file is noticed. Output (`--output`, schema "magpie/gsm8k/1", documented in
docs/serving.md): the summary (accuracy, truncations, tokens, throughput) first, the
per-problem records after; a short table on stdout. Exit 3 if the server dies (partial results
written).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import sys
import time

from magpie import cli, files
from magpie.serving import client

SCHEMA = files.schema("gsm8k", 1)
GSM8K_TEST_RECORDS = 1319

PROMPT_TEMPLATE = (
    "{question}\n\nSolve the problem step by step. On the last line, write the final answer as "
    "'#### <number>' with the number only."
)

_NUMBER = r"-?\$?\s*[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+"
_HASH_RE = re.compile(r"####\s*(" + _NUMBER + ")")
_BOXED_RE = re.compile(r"\\boxed\{\s*(" + _NUMBER + r")\s*%?\s*\}")
_ANY_RE = re.compile(_NUMBER)


def normalize_number(text: str) -> float | None:
    cleaned = text.replace(",", "").replace("$", "").replace("%", "").replace(" ", "").rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        return None


def extract_answer(reply: str) -> tuple[float | None, str]:
    """The reply's final answer and how it was found: 'hash', 'boxed', 'last-number' or 'none'."""
    for method, regex in (("hash", _HASH_RE), ("boxed", _BOXED_RE), ("last-number", _ANY_RE)):
        found = regex.findall(reply)
        for candidate in reversed(found):
            value = normalize_number(candidate)
            if value is not None:
                return value, method
    return None, "none"


def reference_answer(answer: str) -> float:
    match = _HASH_RE.search(answer)
    if not match or normalize_number(match.group(1)) is None:
        raise ValueError("the answer has no '#### <number>' line")
    return normalize_number(match.group(1))


def load_dataset(path: str) -> tuple[list[dict], str]:
    """[{question, answer, reference}], and the file's SHA-256."""
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SystemExit(
                f"error: {path} is parquet, and reading parquet needs pyarrow, which this Python lacks; "
                "install pyarrow or convert the file to JSONL (one {'question', 'answer'} object per line)"
            ) from None
        rows = pq.read_table(path, columns=["question", "answer"]).to_pylist()
    else:
        rows = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise SystemExit(f"error: {path}:{number}: not JSON ({e.msg})") from None
    problems = []
    for number, row in enumerate(rows, 1):
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("question"), str)
            or not isinstance(row.get("answer"), str)
        ):
            raise SystemExit(f"error: {path} record {number}: needs string fields 'question' and 'answer'")
        try:
            reference = reference_answer(row["answer"])
        except ValueError as e:
            raise SystemExit(f"error: {path} record {number}: {e}") from None
        problems.append({"question": row["question"], "answer": row["answer"], "reference": reference})
    if not problems:
        raise SystemExit(f"error: {path} holds no problem")
    return problems, digest


def request_body(model: str, question: str, args) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT_TEMPLATE.format(question=question)}],
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "chat_template_kwargs": {"enable_thinking": args.thinking},
    }


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("magpie gsm8k", __doc__)
    cli.add_server(parser)
    parser.add_argument("--dataset", required=True, help="GSM8K-format JSONL or parquet file")
    parser.add_argument("--limit", type=int, help="only the first N problems (default: all)")
    parser.add_argument(
        "--expect-records",
        type=int,
        help=f"refuse unless the file has exactly N problems (the GSM8K test split: {GSM8K_TEST_RECORDS})",
    )
    parser.add_argument("-c", "--concurrency", type=int, default=4, help="requests in flight (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=1024, help="max_tokens per reply (default: %(default)s)")
    parser.add_argument("--thinking", action="store_true", help="let the model think (default: thinking off)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per request (default: %(default)s)")
    parser.add_argument("--label", default="", help="configuration name shown in tables and the report")
    parser.add_argument("--output", metavar="JSON", help="write the results here (default: table only)")
    cli.add_force(parser, "the --output file")
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.max_tokens < 1 or (args.limit is not None and args.limit < 1):
        parser.error("--concurrency, --max-tokens and --limit must be >= 1")
    if not args.url.startswith(("http://", "https://")):
        parser.error(f"--url {args.url}: give a URL with its scheme, e.g. http://{args.url}")
    files.check_input(args.dataset, "--dataset")
    files.check_distinct([("--output", args.output)], [("--dataset", args.dataset)])
    files.check_output(args.output, args.force)
    problems, digest = load_dataset(args.dataset)
    if args.expect_records is not None and len(problems) != args.expect_records:
        print(
            f"error: {args.dataset} has {len(problems)} problems, not the expected {args.expect_records}: "
            "wrong split or a truncated file",
            file=sys.stderr,
        )
        return 2
    total_in_file = len(problems)
    if args.limit:
        problems = problems[: args.limit]
    base = args.url.rstrip("/")
    if not client.server_alive(base):
        print(f"error: no healthy vLLM server at {base} (GET /health failed)", file=sys.stderr)
        return 2
    try:
        model = args.model or client.served_model(base)
    except (ValueError, LookupError, TypeError) as e:  # not JSON, no "data", an empty list, ...
        print(
            f"error: {base}/v1/models lists no model ({type(e).__name__}: {e}); is --url a vLLM server? "
            "Or name the model with --model",
            file=sys.stderr,
        )
        return 2

    def body(index: int) -> dict:
        return request_body(model, problems[index]["question"], args)

    def make_record(index: int, raw: dict) -> dict:
        problem = problems[index]
        predicted, method = extract_answer(raw["text"]) if raw["ok"] else (None, "none")
        return {
            "index": index,
            "ok": raw["ok"],
            "error": raw["error"],
            "reference": problem["reference"],
            "predicted": predicted,
            "extraction": method,
            "correct": bool(raw["ok"] and predicted is not None and abs(predicted - problem["reference"]) < 1e-6),
            "truncated": raw["finish_reason"] == "length",
            "finish_reason": raw["finish_reason"],
            "prompt_tokens": raw["prompt_tokens"],
            "output_tokens": raw["completion_tokens"],
            "latency_s": (raw["t_last"] - raw["t_sent"]) if raw["t_last"] else None,
            "question": problem["question"],
            "reply": raw["text"],
        }

    def progress(done: list[dict]) -> str:
        return f"{len(done)}/{len(problems)} answered, {sum(r['correct'] for r in done)} correct"

    t0 = time.perf_counter()
    records, status = client.run_requests(
        base, len(problems), args.concurrency, body, make_record, args.timeout, progress
    )
    wall = time.perf_counter() - t0
    answered = [r for r in records if r["ok"]]
    output_tokens = sum(r["output_tokens"] for r in records)
    summary = {
        "problems": len(problems),
        "answered": len(answered),
        "failed": len(records) - len(answered),
        "correct": sum(r["correct"] for r in records),
        "accuracy": sum(r["correct"] for r in records) / len(problems),
        "truncated": sum(r["truncated"] for r in records),
        "extraction": {
            m: sum(r["extraction"] == m for r in answered) for m in ("hash", "boxed", "last-number", "none")
        },
        "output_tokens": output_tokens,
        "mean_output_tokens": output_tokens / len(records) if records else None,
        "duration_s": wall,
        "output_tok_per_s": output_tokens / wall if wall > 0 else None,
    }
    result = {
        "schema": SCHEMA,
        "tool": "gsm8k.py",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "label": args.label,
        "status": status,
        "server": {"url": base, "model": model, "vllm_version": client.server_version(base)},
        "dataset": {
            "path": os.path.abspath(args.dataset),
            "sha256": digest,
            "records_in_file": total_in_file,
            "is_full_test_split_size": total_in_file == GSM8K_TEST_RECORDS,
        },
        "config": {
            "limit": args.limit,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "thinking": args.thinking,
            "temperature": 0.0,
            "prompt_template": PROMPT_TEMPLATE,
        },
        "summary": summary,
        "records": records,
    }
    if args.output:
        files.atomic_write_json(args.output, result)
    print(
        f"gsm8k  {args.label}  status={status}  dataset {os.path.basename(args.dataset)} "
        f"({total_in_file} problems, sha256 {digest[:12]})"
    )
    print(
        f"  accuracy {summary['accuracy'] * 100:.1f} % ({summary['correct']}/{len(problems)}), "
        f"truncated {summary['truncated']}, failed {summary['failed']}"
    )
    print(f"  {output_tokens} output tokens in {wall:.1f} s = {summary['output_tok_per_s'] or 0:.1f} tok/s")
    if status == "server-died":
        print(f"error: the server at {base} stopped answering; partial results written", file=sys.stderr)
        return 3
    return 130 if status == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(cli.run_tool("gsm8k", main, sys.argv[1:]))
