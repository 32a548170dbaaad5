#!/usr/bin/env python3
"""Liveness watchdog for one vLLM server: find a stalled engine and stop it, by PID.

`/health` stays green on a wedged engine (it only asks whether the engine core has died). This
watchdog reads the server's own counters instead. The server is stalled when

- requests are running or waiting (`vllm:num_requests_running` + `vllm:num_requests_waiting` > 0)
  and no progress counter moved (`vllm:generation_tokens_total`, `vllm:prompt_tokens_total`,
  `vllm:iteration_tokens_total_count`) for `--stall-after` seconds; or
- the engine reports itself idle and a probe (a short completion of one output token) gets no
  answer within `--probe-timeout` while the counters do not move either. The running/waiting
  counts come from the engine, so a stopped engine reports 0 forever while requests hang in the API
  server: only the probe sees that. It runs when nothing ran and no counter moved for
  `--probe-interval` seconds (default 60; 0 = off), so a benchmark keeping the server busy never
  gets one; or
- `/metrics` itself does not answer for `--stall-after` seconds.

The probe's prompt has several tokens (PROBE_PROMPT): a one-token prompt crashes vLLM 0.29.0's CPU
build whenever MTP is on.

Judging starts when the server serves: its first healthy `/health`, or the line uvicorn prints
once it serves ("Application startup complete.") in `--server-log` (read from the watchdog's
start on), whichever comes first, so that a server that freezes right after it became healthy is
judged. Before that (weight loading, compilation: ~10 minutes for Flash-Next) nothing is judged.
What happens on a stall is the policy `--on-stall`: `stop`
(SIGTERM and SIGCONT to the server's process group, SIGKILL after `--grace`; exit 4) or `report`
(log it, keep watching, log again when the engine moves). serve.sh's `WATCHDOG=restart` launches
the server again after a `stop`.

    python3 magpie watchdog watch --pid 12345 --url http://127.0.0.1:8100 --on-stall stop --log server.log

A long prefill moves no token counter until it completes (vLLM 0.29 counts prompt tokens when
the first output token exists): set `--stall-after` above the longest prefill you serve.

Exit codes: 0 the server exited by itself; 4 the watchdog stopped it; 2 usage error (a value out
of its range names the flag: magpie/serving/bounds.py); 6 this user may not signal the server (one
line; no stop is claimed); 1 a file it writes fails.
"""

from __future__ import annotations

import argparse
import http.client
import os
import sys
import time
import urllib.error

from magpie import cli
from magpie.serving import bounds, client, pgroup
from magpie.serving.logs import SERVING_LINE, Log, LogFollower, open_log
from magpie.serving.metrics import (
    GENERATION_TOKENS,
    ITERATION_TOKENS_COUNT,
    PROMPT_TOKENS,
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
    MetricsSnapshot,
)
from magpie.serving.status import WATCHDOG_STOPPED

# Several tokens with any tokenizer (a one-token prompt crashes vLLM 0.29.0's CPU build under MTP).
PROBE_PROMPT = "Watchdog probe: answer with one word. Are you there?"
PROGRESS = (GENERATION_TOKENS, PROMPT_TOKENS, ITERATION_TOKENS_COUNT)
BUSY = (REQUESTS_RUNNING, REQUESTS_WAITING)
# What a request to a server that does not answer raises.
NO_ANSWER = (urllib.error.URLError, OSError, http.client.HTTPException)


def metric_sums(page: str, names) -> dict[str, float]:
    """Each metric summed over its label sets (engines, models) from a Prometheus text page
    (the one parser, magpie.serving.metrics); 0 for a metric the page does not have."""
    snapshot = MetricsSnapshot.parse(page)
    return {name: snapshot.sum(name) or 0.0 for name in names}


class Watchdog:
    def __init__(self, args: argparse.Namespace, log):
        self.args = args
        self.url = args.url.rstrip("/")
        self.log = Log(log, "watchdog")
        self.server = pgroup.Server(args.pid)  # the server by PID and start time; its stop sequence
        # From now on only: an earlier start's line (a restart appends to the same log) is not this one's.
        self.server_log = LogFollower(args.server_log, from_start=False) if args.server_log else None

    def get(self, path: str, timeout: float) -> str:
        return client.http_get(self.url + path, timeout=timeout)

    def serving(self) -> bool:
        """Whether the server serves: /health answers, or its log says uvicorn serves."""
        if self.server_log is not None and any(SERVING_LINE in line for line in self.server_log.lines()):
            self.log(f"the server log {self.args.server_log} says the server serves")
            return True
        return client.server_alive(self.url, timeout=5)

    def probe(self) -> str | None:
        """A completion of PROBE_PROMPT and one output token; None when it answered, else what went wrong
        (`probe_refused`: it answered with an HTTP error, which is not counted as a stall)."""
        self.probe_refused = False
        try:
            model = client.served_model(self.url, timeout=10)
            body = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0}
            client.http_post(self.url + client.COMPLETIONS, body, timeout=self.args.probe_timeout)
            return None
        except urllib.error.HTTPError as e:
            self.log(f"warning: the probe got HTTP {e.code}; not counted as a stall")
            self.probe_refused = True
            return None
        except (*NO_ANSWER, ValueError) as e:
            return f"the probe got no answer within {self.args.probe_timeout:g} s ({e})"

    def run(self) -> int:
        args = self.args
        self.log(
            f"watching server PID {args.pid} at {self.url}: stalled when no progress counter moves for "
            f"{args.stall_after:g} s while requests run or wait"
            + (
                f", or a probe after {args.probe_interval:g} idle s gets no answer within {args.probe_timeout:g} s"
                if args.probe_interval
                else "; no probe (--probe-interval 0): a stopped idle engine is not seen"
            )
            + f"; policy {args.on_stall}"
        )
        while not self.serving():  # start-up: nothing to judge yet
            if not self.server.alive():
                self.log(f"server PID {args.pid} exited; the watchdog exits")
                return 0
            time.sleep(min(args.interval, 1.0))
        self.log("server healthy; watching its counters")
        progress, moved_at, last_probe, answered_at = None, time.monotonic(), time.monotonic(), time.monotonic()
        active_at = time.monotonic()  # the last time requests ran or a counter moved
        probed = False
        stalled = False
        while True:
            if not self.server.alive():
                self.log(f"server PID {args.pid} exited; the watchdog exits")
                return 0
            now = time.monotonic()
            reason = None
            try:
                page = self.get("/metrics", args.metrics_timeout)
                answered_at = now
            except NO_ANSWER as e:
                page = None
                if now - answered_at >= args.stall_after:
                    reason = f"/metrics has not answered for {now - answered_at:.0f} s ({e})"
            if page is not None:
                sums = metric_sums(page, PROGRESS + BUSY)
                current = tuple(sums[name] for name in PROGRESS)
                busy = sums[REQUESTS_RUNNING] + sums[REQUESTS_WAITING]
                if current != progress or busy > 0:
                    active_at = now
                if current != progress or busy == 0:
                    if stalled and current != progress:
                        self.log(f"engine moving again: generation_tokens_total {sums[PROGRESS[0]]:.0f}")
                        stalled = False
                    progress, moved_at = current, now
                elif now - moved_at >= args.stall_after:
                    reason = (
                        f"stalled engine: generation_tokens_total frozen at {sums[PROGRESS[0]]:.0f} for "
                        f"{now - moved_at:.0f} s while {sums[BUSY[0]]:.0f} request(s) run and "
                        f"{sums[BUSY[1]]:.0f} wait"
                    )
                if (
                    reason is None
                    and busy == 0
                    and args.probe_interval
                    and now - active_at >= args.probe_interval
                    and now - last_probe >= args.probe_interval
                ):
                    last_probe = now
                    asked = time.monotonic()
                    failure = self.probe()
                    if failure is None and not self.probe_refused and not probed:
                        probed = True
                        self.log(f"first probe answered in {time.monotonic() - asked:.1f} s")
                    after = self.get_progress()
                    if failure and after == progress:
                        reason = f"stalled engine: {failure}, and no counter moved"
                    last_probe = time.monotonic()
            if reason and not stalled:
                if args.on_stall == "stop":
                    self.server.stop(reason, args.grace, self.log, "the watchdog")
                    return WATCHDOG_STOPPED
                self.log(f"{reason} (policy report: left running)")
                stalled = True
            time.sleep(args.interval)

    def get_progress(self):
        try:
            sums = metric_sums(self.get("/metrics", self.args.metrics_timeout), PROGRESS)
        except NO_ANSWER:
            return None
        return tuple(sums[name] for name in PROGRESS)


def build_parser() -> argparse.ArgumentParser:
    """`watchdog`'s parser (`memguard run` checks --watchdog-args with it before it starts anything)."""
    parser = cli.parser("magpie watchdog", __doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("watch", help="watch one server")
    p.add_argument("--pid", type=bounds.pid, required=True, help="the server's PID (it should lead its process group)")
    p.add_argument("--url", type=bounds.url, default=cli.DEFAULT_URL, help="the server")
    p.add_argument(
        "--stall-after",
        type=bounds.seconds(1, 7 * bounds.DAY),
        default=300.0,
        help="seconds without progress that make a stall",
    )
    p.add_argument(
        "--interval", type=bounds.seconds(0.1, 3600), default=5.0, help="seconds between two /metrics readings"
    )
    p.add_argument(
        "--metrics-timeout", type=bounds.seconds(1, 3600), default=30.0, help="timeout of one /metrics request"
    )
    p.add_argument(
        "--probe-interval",
        type=bounds.seconds(1, zero=True),
        default=60.0,
        help="idle seconds before a probe, and between two; 0 = off",
    )
    p.add_argument("--probe-timeout", type=bounds.seconds(1, 3600), default=60.0, help="seconds a probe may take")
    p.add_argument("--on-stall", choices=("stop", "report"), default="stop", help="the policy")
    p.add_argument("--grace", type=bounds.seconds(0), default=30.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--log", type=bounds.log_file, help="append messages to this file (default: stderr)")
    p.add_argument(
        "--server-log", help="the server's output: uvicorn's start-up line there starts the judging (serve.sh: LOG)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")  # urllib asks a proxy unless told: the server is local
    try:
        log = open_log(args.log)
    except OSError as e:
        print(f"watchdog: error: --log {args.log}: {e.strerror}", file=sys.stderr)
        return 1
    return pgroup.watch("watchdog", lambda: Watchdog(args, log))


if __name__ == "__main__":
    sys.exit(main())
