"""What the Flash-Next tools share to talk to a vLLM OpenAI-compatible server (standard library only).

- `stream_chat()`: one streaming `/v1/chat/completions` request, timed chunk by chunk, with the
  token counts vLLM reports in every chunk (`continuous_usage_stats`): under MTP one chunk
  carries several tokens, so counting chunks would under-count.
- `parse_metrics()` / `spec_decode_figures()`: the Prometheus page and the speculative-decoding
  figures computed from two snapshots of its counters.
- `server_alive()`: tells a failed request from a dead server.
- `write_json()`: results are written whole or not at all (temporary file, then rename).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

# --------------------------------------------------------------------------------------------
# HTTP


class ServerGone(Exception):
    """The server does not answer at all any more (connection refused / reset, /health fails)."""


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


def served_model(base_url: str, timeout: float = 30) -> str:
    """The first model id the server lists on /v1/models."""
    models = json.loads(http_get(base_url.rstrip("/") + "/v1/models", timeout=timeout))
    return models["data"][0]["id"]


def server_version(base_url: str, timeout: float = 30) -> str | None:
    try:
        return json.loads(http_get(base_url.rstrip("/") + "/version", timeout=timeout)).get("version")
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return None


def stream_chat(base_url: str, body: dict, timeout: float = 600, on_tokens=None) -> dict:
    """Send one streaming chat completion; return a record of what came back and when.

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
            (parsed.path.rstrip("/") or "") + "/v1/chat/completions",
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
                delta = choice.get("delta") or {}
                text_parts.append(delta.get("content") or "")
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
# Prometheus metrics

_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\d+)?$")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus text page: (name, labels, value)."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE_RE.match(line.strip())
        if not match:
            continue
        labels = dict(_LABEL_RE.findall(match.group(2) or ""))
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        samples.append((match.group(1), labels, value))
    return samples


def metric_sum(samples, name: str, **labels: str) -> float | None:
    """Sum of the samples named `name` whose labels include `labels` (all engines); None if absent."""
    values = [v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items())]
    return sum(values) if values else None


SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"


def metric_delta(before: str, after: str, name: str, **labels: str) -> float | None:
    """after - before of one counter summed over engines; None when the server does not export it."""
    last = metric_sum(parse_metrics(after), name, **labels)
    if last is None:
        return None
    return last - (metric_sum(parse_metrics(before), name, **labels) or 0.0)


DECODE_TIME_SUM = "vllm:request_decode_time_seconds_sum"
DECODE_TIME_COUNT = "vllm:request_decode_time_seconds_count"


def engine_decode_rate(before: str, after: str) -> float | None:
    """Decode tok/s per request from the engine's own timestamps, between two /metrics snapshots.

    vLLM times each finished request's decode from its first to its last token with the engine
    core's timestamps, so a busy front-end (chunks arriving in bursts) does not distort it:
    (generated tokens - one first token per request) / summed decode seconds.
    """
    seconds = metric_delta(before, after, DECODE_TIME_SUM)
    requests = metric_delta(before, after, DECODE_TIME_COUNT)
    tokens = metric_delta(before, after, GENERATION_TOKENS)
    if not seconds or requests is None or tokens is None:
        return None
    return (tokens - requests) / seconds


def counter_deltas(before: str, after: str) -> dict[str, float]:
    """after - before for every `*_total` counter sample (labels folded into the key)."""

    def keyed(text):
        out = {}
        for name, labels, value in parse_metrics(text):
            if name.endswith("_total"):
                key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
                out[key] = value
        return out

    first, second = keyed(before), keyed(after)
    return {key: second[key] - first.get(key, 0.0) for key in sorted(second)}


def spec_decode_figures(before: str, after: str) -> dict | None:
    """MTP acceptance between two /metrics snapshots, or None when speculative decoding is off.

    acceptance_length = 1 + accepted / drafts (tokens emitted per verification step),
    acceptance_rate = accepted / draft_tokens, per_position[i] = accepted at position i / drafts.
    """
    b, a = parse_metrics(before), parse_metrics(after)
    if metric_sum(a, SPEC_DRAFTS) is None:
        return None

    def delta(name, **labels):
        return (metric_sum(a, name, **labels) or 0.0) - (metric_sum(b, name, **labels) or 0.0)

    drafts, draft_tokens, accepted = delta(SPEC_DRAFTS), delta(SPEC_DRAFT_TOKENS), delta(SPEC_ACCEPTED)
    positions = sorted({int(lab["position"]) for n, lab, _ in a if n == SPEC_PER_POS and "position" in lab})
    per_pos_accepted = [delta(SPEC_PER_POS, position=str(p)) for p in positions]
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "accepted_per_position": per_pos_accepted,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "per_position_acceptance": [x / drafts for x in per_pos_accepted] if drafts else None,
        "num_speculative_tokens": len(positions),
    }


# --------------------------------------------------------------------------------------------
# Output files


def refuse_overwrite(path: str | None, force: bool) -> None:
    if path and os.path.exists(path) and not force:
        raise SystemExit(f"error: {path} exists; pass --force to replace it, or choose another --output")


def write_json(path: str, data: dict) -> None:
    """Write JSON atomically: a reader never sees half a file, a crash leaves the old one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        # mkstemp creates the file 0600; a result file is as readable as any other the user writes.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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


MIN_DECODE_INTERVAL_S = 0.002


def request_timing(raw: dict, min_decode_interval_s: float = MIN_DECODE_INTERVAL_S) -> dict:
    """Per-request figures of one `stream_chat()` record, defined as vLLM 0.29's `vllm bench serve`
    defines them (vllm/benchmarks/lib/endpoint_request_func.py, `calculate_metrics` in
    vllm/benchmarks/serve.py), for the chat endpoint:

    - ttft_s: from sending to the first chunk with a non-empty `choices` (vLLM's chat server sends
      the role chunk in the same engine step as the first token);
    - e2el_s: from sending to the last data chunk (the usage-only chunk included);
    - itl_s: the gaps between consecutive `choices` chunks. Under MTP one chunk carries several
      tokens, so an ITL is the time of one engine step, not of one token;
    - tpot_s: (e2el - ttft) / (output tokens - 1), for requests of more than one output token.

    And one figure of our own: decode_tok_per_s = 1 / tpot_s, but only where the stream shows a
    decode interval: at least two output tokens, a chunk with tokens after the first one, and at
    least `min_decode_interval_s` between the first and the last token. On a saturated host a
    whole reply can arrive in one burst (first and last token within microseconds); 1 / tpot is
    then a division by about zero, so such a request is marked unmeasured
    (decode_unmeasured_reason) instead of being given a meaningless figure.
    """
    out = {
        "ttft_s": None,
        "e2el_s": None,
        "itl_s": [],
        "tpot_s": None,
        "decode_tok_per_s": None,
        "decode_interval_s": None,
        "decode_unmeasured_reason": None,
    }
    if not raw.get("ok"):
        out["decode_unmeasured_reason"] = "request failed"
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
    if raw.get("t_first") is not None and raw.get("t_last") is not None:
        out["decode_interval_s"] = raw["t_last"] - raw["t_first"]
    token_chunks = len(raw.get("chunks") or [])
    if tokens < 2:
        out["decode_unmeasured_reason"] = f"{tokens} output token(s): no decode"
    elif token_chunks < 2:
        out["decode_unmeasured_reason"] = "every token came in the first chunk: no decode interval"
    elif out["decode_interval_s"] < min_decode_interval_s:
        out["decode_unmeasured_reason"] = (
            f"{tokens - raw['first_chunk_tokens']} tokens arrived within {out['decode_interval_s'] * 1e3:.3f} ms of "
            f"the first (one burst, under the {min_decode_interval_s * 1e3:g} ms minimum decode interval)"
        )
    elif out["tpot_s"] and out["tpot_s"] > 0:
        out["decode_tok_per_s"] = 1 / out["tpot_s"]
    else:
        out["decode_unmeasured_reason"] = "no time between the first token and the end of the stream"
    return out


def rate_stats(rates: list[float], unmeasured: int) -> dict | None:
    """Per-request decode tok/s of the measured requests: median, p10, p90, min, max and the
    harmonic mean (= 1 / mean time per token). No arithmetic mean: one burst-inflated rate would
    dominate it, which is exactly what a harmonic mean is immune to."""
    if not rates:
        return None
    ordered = sorted(rates)
    return {
        "n": len(ordered),
        "unmeasured": unmeasured,
        "median": percentile(ordered, 50),
        "p10": percentile(ordered, 10),
        "p90": percentile(ordered, 90),
        "min": ordered[0],
        "max": ordered[-1],
        "harmonic_mean": len(ordered) / sum(1 / r for r in ordered),
    }


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
