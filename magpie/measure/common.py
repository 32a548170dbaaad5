"""What the measurement tools share: one-line refusals of ordinary mistakes, the server reads that
can go wrong in ordinary ways, the percentiles and goodput of `vllm bench serve`, and the
comparison of two repeated figures ("within noise" when their ranges overlap), and rows as CSV
text.

Standard library only.
"""

from __future__ import annotations

import csv
import http.client
import io
import json
import os
import urllib.error

from magpie.serving import client
from magpie.serving.metrics import MetricsSnapshot

# The metrics vLLM's `--percentile-metrics` names, and what a result calls them.
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
DEFAULT_METRIC_PERCENTILES = "50,90,99"
# --goodput KEY:MS: vLLM accepts ttft, tpot and e2el (an ITL is per chunk, not per request).
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
HTTP_ERRORS = (urllib.error.URLError, OSError, http.client.HTTPException)


class Refusal(SystemExit):
    """An ordinary mistake: Python prints the one line on stderr and exits with status 1, so a
    tool's `main` needs no handler."""

    def __init__(self, message: str) -> None:
        self.message = message if message.startswith("error:") else f"error: {message}"
        super().__init__(self.message)


def check_writable(path: str | None, flag: str) -> None:
    """Refuse, before any work, an output that could not be written: one whose folder (or a
    folder above it) is a regular file, or whose nearest existing folder is not writable."""
    if not path or path == "-":
        return
    if os.path.isdir(path):
        raise Refusal(f"{flag} {path} is a folder; give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise Refusal(f"{flag} {path}: {parent} is a file, not a folder; choose a path under a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise Refusal(f"{flag} {path}: the folder {parent} is not writable; choose another path")


def model_entry(base: str, timeout: float = 30) -> dict:
    """The first model /v1/models lists, or a Refusal naming what the page held instead (an HTML
    page from a proxy, an empty list, a server error)."""
    url = base.rstrip("/") + "/v1/models"
    try:
        page = client.http_get(url, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise Refusal(f"GET {url} answered HTTP {e.code}; is --url a vLLM server?") from None
    except HTTP_ERRORS as e:
        raise Refusal(f"GET {url} failed ({e}); is the server running at --url?") from None
    try:
        listed = json.loads(page)
    except ValueError:
        raise Refusal(f"GET {url} is not JSON (starts {page[:40]!r}); is --url a vLLM server?") from None
    data = listed.get("data") if isinstance(listed, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict) or not data[0].get("id"):
        raise Refusal(f"GET {url} lists no model; start the server with a model, or pass --model")
    return data[0]


def fetch_metrics(base: str, when: str) -> MetricsSnapshot:
    """The /metrics page, or a Refusal saying what went wrong (an HTTP 500, not Prometheus text)."""
    url = base.rstrip("/") + "/metrics"
    try:
        return MetricsSnapshot.fetch(base)
    except urllib.error.HTTPError as e:
        raise Refusal(f"GET {url} {when} answered HTTP {e.code}; the server's metrics are unreadable") from None
    except HTTP_ERRORS as e:
        raise Refusal(f"GET {url} {when} failed ({e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise Refusal(f"GET {url} {when} is not a Prometheus page ({e})") from None


# --------------------------------------------------------------------------------------------
# Percentiles and goodput, spelled as `vllm bench serve` spells them


def parse_percentile_metrics(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in LATENCY_METRICS]
    if not names or unknown:
        raise ValueError(f"--percentile-metrics: {unknown or text!r}; choose from {','.join(LATENCY_METRICS)}")
    return names


def parse_metric_percentiles(text: str) -> list[float]:
    out = []
    for item in text.split(","):
        try:
            q = float(item)
        except ValueError:
            raise ValueError(f"--metric-percentiles: {item!r} is not a number (e.g. 50,90,99)") from None
        if not 0 < q < 100 and q != 100:
            raise ValueError(f"--metric-percentiles: {item!r} is outside 0 < q <= 100")
        out.append(q)
    return out


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`--goodput ttft:500 tpot:50` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {item!r}: expected KEY:MS with KEY one of {', '.join(GOODPUT_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
        slos[name] = ms
    return slos


def percentile_key(q: float) -> str:
    """vLLM's field suffix: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{q:g}"


def percentiles(ms_values: list[float], qs: list[float]) -> dict[str, float] | None:
    if not ms_values:
        return None
    ordered = sorted(ms_values)
    return {percentile_key(q): client.percentile(ordered, q) for q in qs}


def _meets(seconds: float | None, slo_ms: float, name: str) -> bool:
    if seconds is None:
        return name == "tpot"
    return slo_ms / 1000 >= seconds  # vLLM's comparison, in seconds


def goodput(records: list[dict], slos: dict[str, float], duration: float | None) -> dict | None:
    """vLLM's goodput: requests that met every SLO (TTFT, TPOT, E2EL in ms, each request's own
    figure), per second of the run. A request without a TPOT (one output token) meets a TPOT SLO."""
    if not slos:
        return None
    good = 0
    for r in records:
        if not r["ok"]:
            continue
        figures = {"ttft": r["ttft_s"], "tpot": r["tpot_s"], "e2el": r["latency_s"]}
        if all(_meets(figures[k], slo, k) for k, slo in slos.items()):
            good += 1
    return {
        "slo_ms": slos,
        "good_requests": good,
        "requests": len(records),
        "good_fraction": good / len(records) if records else None,
        "request_per_s": good / duration if duration else None,
    }


# --------------------------------------------------------------------------------------------
# Repeats and noise


def spread(values: list[float | None]) -> dict | None:
    """median / min / max / n of a figure over repeats (None values dropped)."""
    present = sorted(v for v in values if v is not None)
    if not present:
        return None
    return {"median": client.percentile(present, 50), "min": present[0], "max": present[-1], "n": len(present)}


def compare(base: dict | None, other: dict | None) -> str:
    """How `other` stands against `base` (two spreads): "within noise" when their min..max ranges
    overlap (or a side has one run only, so no range), else "+x.x %" / "-x.x %" of the medians."""
    if not base or not other:
        return "not measured"
    change = (other["median"] - base["median"]) / base["median"] * 100 if base["median"] else None
    overlap = base["min"] <= other["max"] and other["min"] <= base["max"]
    if base["n"] < 2 or other["n"] < 2:
        return f"{change:+.1f} % (one run: noise unknown)" if change is not None else "one run: noise unknown"
    if overlap:
        return "within noise"
    return f"{change:+.1f} %" if change is not None else "differs"


def csv_text(rows: list[dict], fields: list[str]) -> str:
    """`rows` as CSV text with a header of `fields` (a missing or None value is an empty cell)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in fields})
    return out.getvalue()
