"""What the Flash-Next tools share to talk to a vLLM OpenAI-compatible server (standard library only).

- `stream_chat()`: one streaming `/v1/chat/completions` (or `/v1/completions`) request, timed
  chunk by chunk, with the token counts vLLM reports in every chunk (`continuous_usage_stats`):
  under MTP one chunk carries several tokens, so counting chunks would under-count.
- `run_requests()`: N such requests at concurrency C, one record each, stopping when the server
  is gone (the loop of bench_decode and gsm8k).
- `request_timing()` and the statistics: per-request figures as `vllm bench serve` defines them.
- `server_alive()`: tells a failed request from a dead server.
- The `/metrics` page is read by `magpie.serving.metrics.MetricsSnapshot`.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

# --------------------------------------------------------------------------------------------
# HTTP


def http_get(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def http_post(url: str, body: dict, timeout: float = 60) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw.strip() else {}


def server_alive(base_url: str, timeout: float = 10) -> bool:
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return False


def first_model(base_url: str, timeout: float = 30) -> dict:
    """The first entry the server lists on /v1/models (`id`, `max_model_len`, ...)."""
    models = json.loads(http_get(base_url.rstrip("/") + "/v1/models", timeout=timeout))
    return models["data"][0]


def served_model(base_url: str, timeout: float = 30) -> str:
    """The first model id the server lists on /v1/models."""
    return first_model(base_url, timeout)["id"]


def server_version(base_url: str, timeout: float = 30) -> str | None:
    try:
        return json.loads(http_get(base_url.rstrip("/") + "/version", timeout=timeout)).get("version")
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return None


CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def stream_chat(
    base_url: str, body: dict, timeout: float = 600, on_tokens=None, endpoint: str = CHAT_COMPLETIONS
) -> dict:
    """Send one streaming chat completion (a text completion with `endpoint=COMPLETIONS`, whose
    body has a `prompt` instead of `messages`); return a record of what came back and when.

    The record always has `ok`; on failure `error` says what happened and `server_gone` is True
    when the connection itself failed (the caller checks /health to tell a dead server).
    Times are `time.perf_counter()` seconds: `t_sent`, `t_first` (first chunk carrying a
    token), `t_last` (last chunk carrying a token), `t_end` (the last data chunk before [DONE],
    the usage-only one included). `choice_chunks` holds the arrival of every chunk with a
    non-empty `choices` (seconds since sent), which is what `vllm bench serve` times: see
    `request_timing()`. `on_tokens(total)` is called after every chunk that brought tokens.
    """
    body = dict(body, stream=True)
    body.setdefault("stream_options", {"include_usage": True, "continuous_usage_stats": True})
    parsed = urllib.parse.urlsplit(base_url)
    record: dict = {
        "ok": False,
        "error": None,
        "server_gone": False,
        "http_status": None,
        "t_sent": None,
        "t_first": None,
        "t_last": None,
        "t_end": None,
        "prompt_tokens": None,
        "completion_tokens": 0,
        "first_chunk_tokens": None,
        "chunks": [],  # [seconds since sent, tokens in this chunk]
        "choice_chunks": [],  # seconds since sent of every chunk with non-empty choices
        "text": "",
        "token_ids": [],
        "finish_reason": None,
    }
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port or 80, timeout=timeout)
    text_parts: list[str] = []
    try:
        record["t_sent"] = time.perf_counter()
        conn.request(
            "POST",
            (parsed.path.rstrip("/") or "") + endpoint,
            body=json.dumps(body),
            headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
        )
        resp = conn.getresponse()
        record["http_status"] = resp.status
        if resp.status != 200:
            detail = resp.read().decode(errors="replace")[:500]
            record["error"] = f"HTTP {resp.status}: {detail}"
            return record
        seen_tokens = 0
        done = False
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            now = time.perf_counter()
            chunk = json.loads(payload)
            if "error" in chunk and not chunk.get("choices"):
                record["error"] = f"server error in stream: {json.dumps(chunk['error'])[:500]}"
                return record
            record["t_end"] = now
            if chunk.get("choices"):
                record["choice_chunks"].append(now - record["t_sent"])
            usage = chunk.get("usage") or {}
            if usage.get("prompt_tokens") is not None:
                record["prompt_tokens"] = usage["prompt_tokens"]
            for choice in chunk.get("choices") or []:
                if "delta" in choice:  # chat: {"delta": {"content": ...}}
                    text_parts.append((choice["delta"] or {}).get("content") or "")
                else:  # text completion: {"text": ...}
                    text_parts.append(choice.get("text") or "")
                record["token_ids"].extend(choice.get("token_ids") or [])
                if choice.get("finish_reason"):
                    record["finish_reason"] = choice["finish_reason"]
            total = usage.get("completion_tokens")
            if total is None:  # a server without continuous usage stats: count token ids if any
                total = len(record["token_ids"]) if record["token_ids"] else seen_tokens
            if total > seen_tokens:
                new_tokens = total - seen_tokens
                seen_tokens = total
                if record["t_first"] is None:
                    record["t_first"] = now
                    record["first_chunk_tokens"] = new_tokens
                record["t_last"] = now
                record["chunks"].append([round(now - record["t_sent"], 6), new_tokens])
                if on_tokens is not None:
                    on_tokens(total)
        record["completion_tokens"] = seen_tokens
        record["text"] = "".join(text_parts)
        if not done:
            record["error"] = "stream ended without [DONE]"
            record["server_gone"] = True
            return record
        record["ok"] = True
        return record
    except (ConnectionError, http.client.HTTPException, OSError) as e:
        record["error"] = f"{type(e).__name__}: {e}"
        record["server_gone"] = True
        record["text"] = "".join(text_parts)
        return record
    except ValueError as e:  # a chunk that is not JSON
        record["error"] = f"unreadable stream chunk: {e}"
        return record
    finally:
        conn.close()


# --------------------------------------------------------------------------------------------
# Statistics


def stats(values: list[float]) -> dict | None:
    """mean / median / p90 / min / max of a list (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)

    def pct(q):
        pos = q * (len(ordered) - 1)
        low = int(pos)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)

    return {
        "mean": sum(ordered) / len(ordered),
        "median": pct(0.5),
        "p90": pct(0.9),
        "min": ordered[0],
        "max": ordered[-1],
        "n": len(ordered),
    }


def percentile(ordered: list[float], q: float) -> float:
    """The q-th percentile (0-100) of sorted values, interpolated linearly (numpy's default)."""
    pos = q / 100 * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


LATENCY_PERCENTILES = (50, 90, 99)


def latency_stats(seconds: list[float]) -> dict | None:
    """TTFT / TPOT / ITL / E2EL statistics in milliseconds as `vllm bench serve` prints them:
    mean, std (population), median and percentiles (linear interpolation, like numpy), plus n,
    min and max. None when there is no value (vLLM prints 0 then; a 0 would read as a figure)."""
    if not seconds:
        return None
    ordered = sorted(s * 1000 for s in seconds)
    mean = sum(ordered) / len(ordered)
    out = {
        "n": len(ordered),
        "mean": mean,
        "std": (sum((x - mean) ** 2 for x in ordered) / len(ordered)) ** 0.5,
        "median": percentile(ordered, 50),
        "min": ordered[0],
        "max": ordered[-1],
    }
    out.update({f"p{q}": percentile(ordered, q) for q in LATENCY_PERCENTILES})
    return out


def request_timing(raw: dict) -> dict:
    """Per-request figures of one `stream_chat()` record, defined as vLLM 0.29's `vllm bench serve`
    defines them (vllm/benchmarks/lib/endpoint_request_func.py, `calculate_metrics` in
    vllm/benchmarks/serve.py), for the chat endpoint:

    - ttft_s: from sending to the first chunk with a non-empty `choices` (vLLM's chat server sends
      the role chunk in the same engine step as the first token);
    - e2el_s: from sending to the last data chunk (the usage-only chunk included);
    - itl_s: the gaps between consecutive `choices` chunks. Under MTP one chunk carries several
      tokens, so an ITL is the time of one engine step, not of one token;
    - tpot_s: (e2el - ttft) / (output tokens - 1), for requests of more than one output token.

    No per-request decode rate: on a saturated host a whole reply can arrive in one burst, and
    1 / tpot is then a division by about zero (decode tok/s comes from the engine's own request
    times: bench_decode)."""
    out = {"ttft_s": None, "e2el_s": None, "itl_s": [], "tpot_s": None}
    if not raw.get("ok"):
        return out
    choices = raw.get("choice_chunks") or []
    t_sent, tokens = raw["t_sent"], raw["completion_tokens"]
    if choices:
        out["ttft_s"] = choices[0]
        out["itl_s"] = [b - a for a, b in zip(choices, choices[1:], strict=False)]
    if raw.get("t_end") is not None:
        out["e2el_s"] = raw["t_end"] - t_sent
    if out["ttft_s"] is not None and out["e2el_s"] is not None and tokens > 1:
        out["tpot_s"] = (out["e2el_s"] - out["ttft_s"]) / (tokens - 1)
    return out


def run_workers(concurrency: int, worker: Callable[[], None], stop: threading.Event) -> str:
    """Run `concurrency` copies of `worker` until all return. Workers set `stop` when the server
    is gone. Returns the run's status: "complete", "interrupted" (Ctrl-C) or "server-died"."""
    status = "complete"
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            for _ in range(concurrency):
                pool.submit(worker)
    except KeyboardInterrupt:
        stop.set()
        status = "interrupted"
    if stop.is_set() and status == "complete":
        status = "server-died"
    return status


def run_requests(
    base_url: str,
    count: int,
    concurrency: int,
    body: Callable[[int], dict],
    make_record: Callable[[int, dict], dict],
    timeout: float = 600,
    progress: Callable[[list[dict]], str] | None = None,
) -> tuple[list[dict], str]:
    """Stream requests 0 .. count-1 (`body(index)`, to the chat endpoint) with `concurrency` in
    flight; turn each `stream_chat()` record into the caller's record with `make_record(index,
    raw)`, which must carry `index`. A failed request is recorded and the run goes on; when a
    request's connection failed and /health does not answer either, no new request starts.

    `progress(records)` (called under the lock after every record) gives the line shown on a
    terminal's stderr. Returns the records sorted by index and the run's status: "complete",
    "interrupted" (Ctrl-C) or "server-died"."""
    records: list[dict] = []
    lock = threading.Lock()
    indices = iter(range(count))
    stop = threading.Event()
    show_progress = progress is not None and sys.stderr.isatty()

    def worker() -> None:
        while not stop.is_set():
            with lock:
                index = next(indices, None)
            if index is None:
                return
            raw = stream_chat(base_url, body(index), timeout)
            record = make_record(index, raw)
            with lock:
                records.append(record)
                if show_progress:
                    print(f"\r  {progress(records)}", end="", file=sys.stderr, flush=True)
            if not raw["ok"] and raw["server_gone"] and not server_alive(base_url):
                stop.set()

    status = run_workers(concurrency, worker, stop)
    if show_progress:
        print(file=sys.stderr)
    records.sort(key=lambda r: r["index"])
    return records, status
