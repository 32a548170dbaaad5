#!/usr/bin/env python3
"""Count how often each token id appears in *generated* text: the input of build_keepset.py.

The MTP draft only ever proposes what the model generates, so count the model's outputs (the
assistant side of conversations), not prompts. The counts go to a .npy int64 array with one
slot per row of the model's lm_head (`vocab_size` from the model's config.json, which is
usually larger than the tokenizer's vocabulary).

    python3 magpie count-tokens --model ~/models/Qwen3.8-Flash-Next -o counts.npy \\
        traffic.jsonl results/bench-c1.json results/gsm8k.json

Inputs (files or folders, read recursively for *.jsonl, *.json, *.txt):
- JSON Lines, one item per line; a line that is not JSON is raw text (its line break excluded);
- an item is an OpenAI chat `{"messages": [...]}` (assistant messages: string content, list
  content parts of type "text", tool-call names and arguments), a ShareGPT
  `{"conversations": [{"from": "gpt", "value": ...}]}` (from gpt/assistant/model/chatgpt),
  an object with one of "text", "content", "response", "completion", "output", a JSON
  string, or a list of these;
- a .json file holding one document: this project's result files (bench_decode.py records'
  `token_ids`, counted as they are, else their `text`; gsm8k.py records' `reply`), a list
  of items, or one item.

`--add-to COUNTS.npy` adds to earlier counts (for example several days of traffic): counts need
hundreds of thousands of tokens before a keep-set stops growing. It prints how many texts,
tokens and distinct ids it counted; `--summary FILE` (or `-` for stdout) writes them as JSON
(schema "magpie/count-tokens/1": texts, tokens, distinct_ids, vocab_size, inputs[] with
per-file texts and tokens, added_to, output). Exit status 1 when no token was counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from magpie import cli, files

SCHEMA = files.schema("count-tokens", 1)
ASSISTANT_ROLES = {"assistant"}
SHAREGPT_GENERATED = {"gpt", "assistant", "model", "chatgpt", "bard", "bing"}
TEXT_KEYS = ("text", "content", "response", "completion", "output")
RESULT_SUFFIXES = (".jsonl", ".json", ".txt")


class Generated:
    """One generated item: either text to tokenize or token ids already known."""

    __slots__ = ("text", "token_ids")

    def __init__(self, text: str | None = None, token_ids: list[int] | None = None):
        self.text = text
        self.token_ids = token_ids


def _content_text(content) -> Iterator[str]:
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, str):
                yield part
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                yield part["text"]


def items_from_json(item) -> Iterator[Generated]:
    """The generated texts inside one JSON item (see the module docstring for the shapes)."""
    if isinstance(item, str):
        yield Generated(text=item)
    elif isinstance(item, list):
        for element in item:
            yield from items_from_json(element)
    elif isinstance(item, dict):
        if isinstance(item.get("messages"), list):
            for message in item["messages"]:
                if not isinstance(message, dict) or message.get("role") not in ASSISTANT_ROLES:
                    continue
                for text in _content_text(message.get("content")):
                    yield Generated(text=text)
                for call in message.get("tool_calls") or []:
                    function = call.get("function", {}) if isinstance(call, dict) else {}
                    for key in ("name", "arguments"):
                        value = function.get(key)
                        if isinstance(value, dict):
                            value = json.dumps(value)
                        if isinstance(value, str):
                            yield Generated(text=value)
        elif isinstance(item.get("conversations"), list):
            for turn in item["conversations"]:
                if isinstance(turn, dict) and turn.get("from") in SHAREGPT_GENERATED:
                    yield from (Generated(text=t) for t in _content_text(turn.get("value")))
        else:
            for key in TEXT_KEYS:
                if key in item:
                    yield from (Generated(text=t) for t in _content_text(item[key]))
                    break


def items_from_result_file(document: dict) -> Iterator[Generated]:
    """Records of this project's result files (magpie/measure/: bench-decode, gsm8k)."""
    for record in document.get("records") or []:
        if not isinstance(record, dict) or record.get("ok") is False:
            continue
        token_ids = record.get("token_ids")
        if isinstance(token_ids, list) and token_ids and all(isinstance(t, int) for t in token_ids):
            yield Generated(token_ids=token_ids)
            continue
        for key in ("text", "reply", "output", "completion", "response"):
            if isinstance(record.get(key), str):
                yield Generated(text=record[key])
                break


def items_from_file(path: Path) -> Iterator[Generated]:
    if path.suffix == ".json":
        document = files.read_json(path, (dict, list), "a bench or gsm8k result, or a JSON list of texts")
        if isinstance(document, dict) and isinstance(document.get("records"), list):
            yield from items_from_result_file(document)
        else:
            yield from items_from_json(document)
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                yield Generated(text=line)
                continue
            if isinstance(item, (int, float, bool)) or item is None:
                yield Generated(text=line)  # a bare number on a line is text
            else:
                yield from items_from_json(item)


def input_files(inputs: Iterable[str]) -> list[Path]:
    files: list[Path] = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in RESULT_SUFFIXES)
            # A results folder's .txt files are summaries and dumps, not generations: in a folder
            # that holds .json/.jsonl records, raw text is read only when named explicitly.
            if any(p.suffix in (".json", ".jsonl") for p in found):
                found = [p for p in found if p.suffix != ".txt"]
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input {name}: no such file or folder")
    return files


def read_vocab_size(model_dir: Path) -> int:
    """Rows of the model's lm_head: vocab_size of config.json (text_config's for multimodal configs)."""
    files.check_input(model_dir, "--model", kind="dir")
    config = files.read_json(model_dir / "config.json", dict, "the model's config.json (a Hugging Face model folder)")
    for section in (config.get("text_config"), config.get("language_config"), config):
        if isinstance(section, dict) and isinstance(section.get("vocab_size"), int):
            return section["vocab_size"]
    raise files.InputError(f"{model_dir / 'config.json'} has no vocab_size; give the model's folder, or --vocab-size")


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


class Progress:
    """Progress on stderr: tqdm when stderr is a terminal and tqdm is installed, else a line every few seconds."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.bar = None
        self.last = time.monotonic()
        self.texts = self.tokens = 0
        if not quiet and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(unit=" texts", file=sys.stderr)
            except ImportError:
                pass

    def advance(self, texts: int, tokens: int) -> None:
        self.texts += texts
        self.tokens += tokens
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.n = self.texts
            self.bar.set_postfix(tokens=self.tokens, refresh=False)
            self.bar.refresh()
        elif time.monotonic() - self.last > 5:
            self.last = time.monotonic()
            print(f"  counted {self.texts} texts, {self.tokens} tokens", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def count_items(
    items: Iterable[Generated],
    tokenizer,
    counts,
    source: str,
    batch_size: int = 256,
    progress: Progress | None = None,
) -> tuple[int, int]:
    """Add the token ids of ITEMS to COUNTS (numpy int64, one slot per lm_head row); return (texts, tokens)."""
    import numpy as np

    vocab_size = counts.shape[0]
    texts = tokens = 0

    def add(ids: list[int]) -> int:
        if not ids:
            return 0
        arr = np.asarray(ids, dtype=np.int64)
        if arr.min() < 0 or arr.max() >= vocab_size:
            bad = int(arr[(arr < 0) | (arr >= vocab_size)][0])
            raise ValueError(f"{source}: token id {bad} is outside the model's vocab_size {vocab_size}")
        np.add.at(counts, arr, 1)
        return len(ids)

    def tokenize(batch: list[str]) -> int:
        return sum(add(ids) for ids in tokenizer(batch, add_special_tokens=False)["input_ids"])

    batch: list[str] = []
    for item in items:
        if item.token_ids:
            texts += 1
            tokens += add(item.token_ids)
            if progress:
                progress.advance(1, len(item.token_ids))
        elif item.text:
            texts += 1
            batch.append(item.text)
            if len(batch) >= batch_size:
                batch_tokens = tokenize(batch)
                tokens += batch_tokens
                if progress:
                    progress.advance(len(batch), batch_tokens)
                batch = []
    if batch:
        batch_tokens = tokenize(batch)
        tokens += batch_tokens
        if progress:
            progress.advance(len(batch), batch_tokens)
    return texts, tokens


def count(
    files: list[Path], tokenizer, vocab_size: int, batch_size: int = 256, quiet: bool = False
) -> tuple[object, dict]:
    """Token-id counts (numpy int64, length vocab_size) of every generated item in FILES, and a summary."""
    import numpy as np

    counts = np.zeros(vocab_size, dtype=np.int64)
    texts = tokens = 0
    per_file = []
    progress = Progress(quiet)
    for path in files:
        file_texts, file_tokens = count_items(items_from_file(path), tokenizer, counts, str(path), batch_size, progress)
        texts += file_texts
        tokens += file_tokens
        per_file.append({"path": str(path), "texts": file_texts, "tokens": file_tokens})
    progress.close()
    summary = {
        "texts": texts,
        "tokens": tokens,
        "distinct_ids": int((counts > 0).sum()),
        "vocab_size": vocab_size,
        "inputs": per_file,
    }
    return counts, summary


def save_counts(counts, path: Path) -> None:
    """Write counts.npy atomically (so --add-to may name the output itself)."""
    import numpy as np

    with files.atomic_open(path, "wb") as f:
        np.save(f, counts)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return os.path.abspath(a) == os.path.abspath(b)


def load_counts(path: Path, vocab_size: int | None = None, what: str = "counts"):
    """A counts array of count-tokens (1-D, integer, one slot per vocabulary id), refused with
    files.InputError naming the file when it is missing, not a .npy, of another shape or size."""
    import numpy as np

    files.check_input(path, what)
    try:
        with open(path, "rb") as f:
            if f.read(6) != b"\x93NUMPY":
                raise ValueError("no NumPy .npy header")
            f.seek(0)
            counts = np.load(f, allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise
        raise files.InputError(
            f"{what} {path}: not a counts .npy ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
            "give a file count-tokens wrote"
        ) from None
    if not isinstance(counts, np.ndarray) or counts.ndim != 1 or counts.dtype.kind not in "iu":
        raise files.InputError(
            f"{what} {path}: not a 1-D integer counts array (shape {getattr(counts, 'shape', None)}, "
            f"dtype {getattr(counts, 'dtype', None)}); give a file count-tokens wrote"
        )
    if vocab_size is not None and counts.shape[0] != vocab_size:
        raise files.InputError(
            f"{what} {path}: has {counts.shape[0]} slots, the vocabulary has {vocab_size}; count with the same "
            "model's tokenizer (count-tokens --model)"
        )
    return counts.astype(np.int64)


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("magpie count-tokens", __doc__)
    parser.add_argument("inputs", nargs="+", help="files or folders of generated text (see the module docstring)")
    parser.add_argument("--model", help="model folder: config.json gives vocab_size; also the default tokenizer")
    parser.add_argument("--tokenizer", help="tokenizer folder or name (unset: the --model folder)")
    parser.add_argument("--vocab-size", type=int, help="lm_head rows, instead of reading --model's config.json")
    parser.add_argument("-o", "--output", required=True, help="counts .npy to write")
    parser.add_argument("--add-to", help="existing counts .npy to add to (may be the same path as --output)")
    parser.add_argument("--batch-size", type=int, default=256, help="texts per tokenizer call")
    parser.add_argument("--summary", help="write the JSON summary to this file ('-': stdout)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    cli.add_force(parser, "the --output and --summary files (--output may always be the --add-to file)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cli.require_modules("count-tokens", "numpy", "transformers")
    if args.vocab_size is None and args.model is None:
        print("error: give --model (its config.json has vocab_size) or --vocab-size", file=sys.stderr)
        return 2
    tokenizer_name = args.tokenizer or args.model
    if tokenizer_name is None:
        print("error: give --tokenizer or --model", file=sys.stderr)
        return 2
    if not (args.add_to and _same_file(args.add_to, args.output)):
        files.check_output(args.output, args.force)
    files.check_output(args.summary, args.force, what="--summary")
    files.check_distinct([("--output", args.output), ("--summary", args.summary)], [("input", i) for i in args.inputs])
    files.check_distinct([("--summary", args.summary)], [("--add-to", args.add_to)])
    vocab_size = args.vocab_size if args.vocab_size is not None else read_vocab_size(Path(args.model))
    try:
        inputs = input_files(args.inputs)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # The counts to add to, checked before the corpus is counted.
    earlier = load_counts(Path(args.add_to), vocab_size, "--add-to") if args.add_to else None
    counts, summary = count(inputs, load_tokenizer(tokenizer_name), vocab_size, args.batch_size, args.quiet)
    if summary["tokens"] == 0:
        print(
            f"error: no tokens counted in {len(inputs)} file(s) ({summary['texts']} texts): nothing generated to "
            "count; check the input format (see --help)",
            file=sys.stderr,
        )
        return 1
    summary["added_to"] = None
    if earlier is not None:
        summary["added_to"] = {"path": args.add_to, "tokens": int(earlier.sum())}
        counts = counts + earlier
        summary["total_tokens"] = int(counts.sum())
        summary["total_distinct_ids"] = int((counts > 0).sum())
    save_counts(counts, Path(args.output))
    summary["output"] = args.output
    summary = {"schema": SCHEMA, **summary}
    line = (
        f"counted {summary['texts']} texts, {summary['tokens']} tokens, {summary['distinct_ids']} distinct ids "
        f"(vocab_size {vocab_size}) -> {args.output}"
    )
    if summary["added_to"]:
        line += f" (with {args.add_to}: {summary['total_tokens']} tokens, {summary['total_distinct_ids']} ids)"
    if args.summary == "-":
        print(json.dumps(summary, indent=2))
        print(line, file=sys.stderr)
    else:
        if args.summary:
            files.atomic_write_json(args.summary, summary, indent=2)
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_tool("count-tokens", main, sys.argv[1:]))
