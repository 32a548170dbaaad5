#!/usr/bin/env python3
"""Capture torch-profiler traces of a running vLLM server in three windows, one folder each.

The server must have been started with a torch profiler, e.g.
`--profiler-config '{"profiler": "torch", "torch_profiler_dir": "/abs/traces"}'`
(vLLM 0.29 also takes `--profiler-config.profiler=torch --profiler-config.torch_profiler_dir=...`);
give the same folder as --trace-dir. Windows:

- `decode-c1`: one client streams requests back to back; the window lasts --decode-steps
  streamed steps and at least --min-window-s seconds.
- `prefill`: one request with a long prompt (--prefill-tokens, capped by the server's
  max_model_len) and a single output token.
- `decode-c4`: the same with four clients.

    python3 magpie profile-capture --url http://127.0.0.1:8100 --trace-dir /abs/traces --out profiles/

After each window's /stop_profile the files that appeared in --trace-dir (the worker's and the
front-end's traces, and the profiler's table) are moved into OUT/<window>/, and
trace_split.py's summary is written beside them as split.json. Every HTTP call and every wait
has a timeout; a window that fails is reported and the others still run (exit 1 if any failed).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time

from magpie import cli, files
from magpie.measure import common, trace_split
from magpie.serving import client

WINDOWS = ("decode-c1", "prefill", "decode-c4")
PREFILL_TEXT = (
    "The following is a long engineering log that the assistant must summarise at the end. "
    "Service build started; compiling modules, linking the binary, running unit tests, measuring latency, "
    "uploading artefacts, restarting workers, checking health endpoints, rotating logs, and verifying that "
    "every replica reports the same version before traffic is shifted to the new release. "
)


def snapshot(folder: str) -> dict[str, float]:
    found = {}
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            found[name] = os.path.getmtime(path)
    return found


def wait_quiet(folder: str, before: dict[str, float], timeout: float, settle: float = 1.0) -> list[str]:
    """Names new or changed since `before`, once no file has changed for `settle` seconds."""
    deadline = time.monotonic() + timeout
    last_state = None
    last_change = time.monotonic()
    while time.monotonic() < deadline:
        state = {
            n: (m, os.path.getsize(os.path.join(folder, n))) for n, m in snapshot(folder).items() if before.get(n) != m
        }
        if state != last_state:
            last_state, last_change = state, time.monotonic()
        elif state and time.monotonic() - last_change >= settle:
            return sorted(state)
        time.sleep(0.2)
    return sorted(last_state or [])


def long_prompt(base: str, model: str, tokens: int) -> str:
    """A prompt of about `tokens` tokens, measured with the server's own /tokenize."""
    text = PREFILL_TEXT
    count = 0
    for _ in range(40):
        count = len(client.http_post(base + "/tokenize", {"model": model, "prompt": text})["tokens"])
        if count >= tokens:
            break
        text = text * max(2, min(8, tokens // max(count, 1)))
    if count > tokens:
        text = text[: max(1, int(len(text) * tokens / count))]
    return text


class Streams:
    """`count` clients in background threads, each streaming one decode after another until stopped.

    Back-to-back requests keep the server decoding for the whole window however fast it is;
    `chunks` counts the streamed chunks of the first client (one chunk per engine step).
    """

    def __init__(self, base: str, model: str, count: int, max_tokens: int, timeout: float):
        self.chunks = 0
        self.decoding = [False] * count
        self.records: list[list[dict]] = [[] for _ in range(count)]
        self.stop = threading.Event()
        self.threads = []
        for i in range(count):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"Request {i}: write a long story about a lighthouse."}],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "chat_template_kwargs": {"enable_thinking": False},
            }
            thread = threading.Thread(target=self._run, args=(i, base, body, timeout), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _run(self, i, base, body, timeout):
        def seen(total, i=i):
            if total >= 2:
                self.decoding[i] = True
            if i == 0:
                self.chunks += 1

        while not self.stop.is_set():
            record = client.stream_chat(base, body, timeout, on_tokens=seen)
            self.records[i].append(record)
            if not record["ok"]:
                return

    def failed(self) -> bool:
        return any(records and not records[-1]["ok"] for records in self.records)

    def wait_decoding(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.failed():
            if all(self.decoding):
                return True
            time.sleep(0.02)
        return False

    def wait_chunks(self, more: int, min_seconds: float, timeout: float) -> int:
        """Wait for `more` chunks and at least `min_seconds`: a busy front-end delivers chunks in
        bursts, so chunk counts alone can end a window before the engine ran its steps."""
        start, began = self.chunks, time.monotonic()
        deadline = began + timeout
        while time.monotonic() < deadline and not self.failed():
            if self.chunks - start >= more and time.monotonic() - began >= min_seconds:
                break
            time.sleep(0.01)
        return self.chunks - start

    def finish(self, timeout: float) -> bool:
        """Let each client end its current request; True if every request succeeded."""
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout)
        return not self.failed() and all(self.records)


def capture_window(name: str, args, base: str, model: str, out_dir: str) -> dict:
    folder = os.path.join(out_dir, name)
    os.makedirs(folder)
    before = snapshot(args.trace_dir)
    info: dict = {"window": name, "ok": False}
    streams = None
    if name.startswith("decode"):
        count = 1 if name == "decode-c1" else 4
        streams = Streams(base, model, count, args.decode_max_tokens, args.timeout)
        if not streams.wait_decoding(args.timeout):
            streams.finish(args.timeout)
            info["error"] = "the requests did not start decoding"
            return info
        client.http_post(base + "/start_profile", {}, timeout=args.timeout)
        info["steps_streamed"] = streams.wait_chunks(args.decode_steps, args.min_window_s, args.timeout)
        client.http_post(base + "/stop_profile", {}, timeout=args.timeout)
    else:
        prompt = long_prompt(base, model, args.prefill_tokens)
        client.http_post(base + "/start_profile", {}, timeout=args.timeout)
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 1,
            "temperature": 0.0,
        }
        record = client.stream_chat(base, body, args.timeout)
        client.http_post(base + "/stop_profile", {}, timeout=args.timeout)
        info["prompt_tokens"] = record["prompt_tokens"]
        if not record["ok"]:
            info["error"] = f"prefill request failed: {record['error']}"
    new_files = wait_quiet(args.trace_dir, before, args.timeout)
    for file_name in new_files:
        shutil.move(os.path.join(args.trace_dir, file_name), os.path.join(folder, file_name))
    info["files"] = new_files
    if streams is not None:
        info["decode_ok"] = streams.finish(args.timeout)
        if not info["decode_ok"]:
            info["error"] = "a decode request failed during the window"
    traces = [f for f in new_files if f.endswith((".json", ".json.gz"))]
    if not traces:
        info["error"] = (
            info.get("error") or f"no trace file appeared in {args.trace_dir} (is it the server's torch_profiler_dir?)"
        )
        return info
    splits = [trace_split.split(os.path.join(folder, f)) for f in traces]
    for trace in splits:
        trace["step_count"] = len(trace.pop("steps"))
    split = {"schema": trace_split.SCHEMA, "tool": "trace_split.py", "traces": splits}
    files.atomic_write_json(os.path.join(folder, files.PROFILE_SPLIT), split)
    info["ok"] = "error" not in info
    return info


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("magpie profile-capture", __doc__)
    cli.add_server(parser)
    parser.add_argument("--trace-dir", required=True, help="the server's torch_profiler_dir")
    parser.add_argument("--out", required=True, help="folder for the windows (created; must not exist)")
    parser.add_argument("--windows", default=",".join(WINDOWS), help="comma-separated subset (default: %(default)s)")
    parser.add_argument("--decode-steps", type=int, default=20, help="steps per decode window (default: %(default)s)")
    parser.add_argument(
        "--decode-max-tokens", type=int, default=512, help="max_tokens of each decode request (default: %(default)s)"
    )
    parser.add_argument(
        "--min-window-s", type=float, default=1.0, help="shortest decode window in seconds (default: %(default)s)"
    )
    parser.add_argument("--prefill-tokens", type=int, default=8192, help="prompt tokens (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per call or wait (default: %(default)s)")
    args = parser.parse_args(argv)
    windows = [w.strip() for w in args.windows.split(",") if w.strip()]
    unknown = [w for w in windows if w not in WINDOWS]
    if unknown:
        parser.error(f"unknown window(s) {unknown}; choose from {', '.join(WINDOWS)}")
    if not os.path.isdir(args.trace_dir):
        parser.error(f"--trace-dir {args.trace_dir}: no such folder")
    if os.path.exists(args.out) and os.listdir(args.out):
        parser.error(f"--out {args.out} exists and is not empty; choose a new folder")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out} is a file; choose a new folder")
    common.check_writable(os.path.join(args.out, files.PROFILE_CAPTURE), "--out")
    if not args.url.startswith(("http://", "https://")):
        parser.error(f"--url {args.url}: give the scheme, e.g. http://{args.url}")
    base = args.url.rstrip("/")
    # The server first: a dead one leaves no folder behind.
    if not client.server_alive(base):
        print(f"error: no healthy vLLM server at {base}", file=sys.stderr)
        return 2
    listed = common.model_entry(base)
    os.makedirs(args.out, exist_ok=True)
    model = args.model or listed["id"]
    max_len = listed.get("max_model_len")
    if max_len:
        args.prefill_tokens = min(args.prefill_tokens, max_len - 64)
        args.decode_max_tokens = min(args.decode_max_tokens, max_len - 128)
    results = []
    for name in windows:
        try:
            info = capture_window(name, args, base, model, args.out)
        except OSError as e:  # a timeout or a refused connection: the next window may still work
            info = {"window": name, "ok": False, "error": f"{type(e).__name__}: {e}"}
        results.append(info)
        state = "ok" if info["ok"] else f"FAILED: {info.get('error')}"
        print(f"{name:10s} {state}; files: {', '.join(info.get('files', [])) or 'none'}")
    files.atomic_write_json(
        os.path.join(args.out, files.PROFILE_CAPTURE), {"url": base, "model": model, "windows": results}
    )
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
