"""A vLLM server's Prometheus `/metrics` page, parsed once into a `MetricsSnapshot` (standard library only).

    before = MetricsSnapshot.fetch("http://127.0.0.1:8100")
    ... requests ...
    after = MetricsSnapshot.fetch("http://127.0.0.1:8100")
    after.sum("vllm:generation_tokens_total")        # summed over engines / models
    after.delta(before, "vllm:generation_tokens_total")
    after.spec_decode(before)                        # MTP acceptance between the two pages

A snapshot holds the samples of one page (name, labels, value); every figure is read from those,
so a tool that wants ten figures from two pages parses each page once. Counters are summed over
their label sets (vLLM exports one per engine and model) unless labels are given.

The speculative-decoding figures follow vLLM's own definitions (its `SpecDecodingLogging` and
`vllm bench serve`): acceptance length = 1 + accepted / drafts (tokens emitted per verification
step), acceptance rate = accepted / draft tokens, and per draft position i, accepted at i / drafts.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterable

__all__ = [
    "DECODE_TIME_COUNT",
    "DECODE_TIME_SUM",
    "GENERATION_TOKENS",
    "ITERATION_TOKENS_COUNT",
    "PROMPT_TOKENS",
    "REQUESTS_RUNNING",
    "REQUESTS_WAITING",
    "SPEC_ACCEPTED",
    "SPEC_DRAFTS",
    "SPEC_DRAFT_TOKENS",
    "SPEC_PER_POS",
    "MetricsSnapshot",
    "label_key",
]

SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
ITERATION_TOKENS_COUNT = "vllm:iteration_tokens_total_count"
REQUESTS_RUNNING = "vllm:num_requests_running"
REQUESTS_WAITING = "vllm:num_requests_waiting"
DECODE_TIME_SUM = "vllm:request_decode_time_seconds_sum"
DECODE_TIME_COUNT = "vllm:request_decode_time_seconds_count"

# name, optional {labels}, value, optional timestamp (the text exposition format, version 0.0.4)
_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+-?\d+)?$")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(value: str) -> str:
    return re.sub(r"\\[\\\"n]", lambda m: _ESCAPES[m.group(0)], value)


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def label_key(labels: dict[str, str]) -> str:
    """A label set as one string, sorted by label name: '{engine="0",model_name="m"}' ('' for none)."""
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_quote(v)}"' for k, v in sorted(labels.items())) + "}"


class MetricsSnapshot:
    """The samples of one Prometheus text page: (name, labels, value), in page order."""

    def __init__(self, samples: Iterable[tuple[str, dict[str, str], float]] = ()):
        self.samples: tuple[tuple[str, dict[str, str], float], ...] = tuple(samples)
        self._by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
        for name, labels, value in self.samples:
            self._by_name.setdefault(name, []).append((labels, value))

    @classmethod
    def parse(cls, text: str) -> MetricsSnapshot:
        """Parse a page. Comments (# HELP, # TYPE), blank lines and lines that are no sample are
        skipped; a value that is no number (never seen from vLLM) skips its line."""
        samples = []
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            match = _SAMPLE_RE.match(line)
            if not match:
                continue
            try:
                value = float(match.group(3))  # also NaN, +Inf, -Inf
            except ValueError:
                continue
            labels = {k: _unescape(v) for k, v in _LABEL_RE.findall(match.group(2) or "")}
            samples.append((match.group(1), labels, value))
        return cls(samples)

    @classmethod
    def fetch(cls, base_url: str, timeout: float = 30) -> MetricsSnapshot:
        """GET BASE_URL/metrics and parse it (URLError / OSError propagate: the server is gone)."""
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as resp:
            return cls.parse(resp.read().decode())

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def values(self, name: str) -> dict[str, float]:
        """Every sample of `name`, by its label set (`label_key`): {'{engine="0",...}': 3.0}."""
        return {label_key(labels): value for labels, value in self._by_name.get(name, [])}

    def label_values(self, name: str, label: str) -> list[str]:
        """The values label `label` takes among the samples of `name`, sorted (numerically where
        they are whole numbers, e.g. draft positions)."""
        found = {labels[label] for labels, _ in self._by_name.get(name, []) if label in labels}
        return sorted(found, key=lambda v: (0, int(v), "") if v.isdigit() else (1, 0, v))

    def sum(self, name: str, **labels: str) -> float | None:
        """Sum of the samples of `name` whose labels include `labels`; None when there is none."""
        picked = [
            value
            for sample_labels, value in self._by_name.get(name, [])
            if all(sample_labels.get(k) == v for k, v in labels.items())
        ]
        return sum(picked) if picked else None

    def delta(self, before: MetricsSnapshot, name: str, **labels: str) -> float | None:
        """self - before of one metric (summed as `sum` does); None when this page lacks it.
        A metric absent from `before` counts from 0 there (it appears with its first event)."""
        now = self.sum(name, **labels)
        if now is None:
            return None
        return now - (before.sum(name, **labels) or 0.0)

    def counter_deltas(self, before: MetricsSnapshot) -> dict[str, float]:
        """self - before of every `*_total` counter sample, keyed by name and label set."""
        first = {n + label_key(lab): v for n, lab, v in before.samples if n.endswith("_total")}
        second = {n + label_key(lab): v for n, lab, v in self.samples if n.endswith("_total")}
        return {key: second[key] - first.get(key, 0.0) for key in sorted(second)}

    def engine_decode_rate(self, before: MetricsSnapshot) -> float | None:
        """Decode tok/s per request from the engine's own timestamps, between `before` and self.

        vLLM times each finished request's decode from its first to its last token with the
        engine core's timestamps, so a busy front-end (chunks arriving in bursts) does not distort
        it: (generated tokens - one first token per request) / summed decode seconds.
        """
        seconds = self.delta(before, DECODE_TIME_SUM)
        requests = self.delta(before, DECODE_TIME_COUNT)
        tokens = self.delta(before, GENERATION_TOKENS)
        if not seconds or requests is None or tokens is None:
            return None
        return (tokens - requests) / seconds

    def spec_decode(self, before: MetricsSnapshot | None = None) -> dict | None:
        """MTP acceptance since `before` (since the server started when None), or None when this
        page has no speculative-decoding counters (speculative decoding is off).

        drafts, draft_tokens, accepted_tokens, accepted_per_position (counts), acceptance_length,
        acceptance_rate, per_position_acceptance (None without drafts), num_speculative_tokens
        (the draft positions the page reports).
        """
        if SPEC_DRAFTS not in self:
            return None
        before = before if before is not None else MetricsSnapshot()

        def delta(name: str, **labels: str) -> float:
            return self.delta(before, name, **labels) or 0.0

        drafts, draft_tokens, accepted = delta(SPEC_DRAFTS), delta(SPEC_DRAFT_TOKENS), delta(SPEC_ACCEPTED)
        positions = self.label_values(SPEC_PER_POS, "position")
        per_position = [delta(SPEC_PER_POS, position=p) for p in positions]
        return {
            "drafts": drafts,
            "draft_tokens": draft_tokens,
            "accepted_tokens": accepted,
            "accepted_per_position": per_position,
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "per_position_acceptance": [x / drafts for x in per_position] if drafts else None,
            "num_speculative_tokens": len(positions),
        }
