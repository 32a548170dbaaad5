"""The decode bench's client-side figures and the sweep, against one real vLLM server on 127.0.0.1.

One server of the tiny Qwen3.5 + MTP "increment" model (MTP k=3, every draft accepted) serves
the whole module, with VLLM_SERVER_DEV_MODE=1 so that /reset_prefix_cache exists: the session
pool's (tests/conftest.py), which tests/test_vllm_server.py shares. The sweep launches a second
configuration (MTP off) itself, through serve.sh, once, eager (what is checked is the sweep's
launch and stop of a configuration, not compiled serving).

- bench_decode's TTFT / TPOT / ITL / E2EL are computed with vLLM's own `calculate_metrics` from
  the same per-request timings (exact agreement), and measured side by side with the real
  `vllm bench serve` CLI on the same server and prompts (same chunking, figures of one size).
- A reply that reaches the client in a burst (a starved front-end; reproduced by a buffering
  proxy on 127.0.0.1 in front of the real server) gives no decode rate of 10^4+ tok/s: decode
  tok/s is the engine's only. A server that dies mid-run (the proxy stops answering) still has
  its MTP reported as on.
- The sweep: a config x input length x concurrency grid with repeats, resumed without redoing
  finished runs, the prefix cache reset before every run, the memory gate, JSON + CSV + chart.
"""

from __future__ import annotations

import csv
import http.client
import http.server
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

from magpie.measure import common, report, sweep
from magpie.serving.process import VllmServer
from tests.conftest import EAGER, MTP_TOKENS
from tests.serving.helpers import MEASURE, PYTHON, REPO, run_tool, tool, vllm_env

pytestmark = pytest.mark.slow

MAX_TOKENS = 48
PROMPT_COUNT = 6


@pytest.fixture(scope="module")
def server(mtp3_server):
    """The pool's MTP k=3 server (tests/conftest.py: MTP3_ARGS, VLLM_SERVER_DEV_MODE=1)."""
    return mtp3_server


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    from magpie.measure import bench_decode

    return bench_decode.BUILTIN_PROMPTS[:PROMPT_COUNT]


def bench(url: str, out: Path, prompt_file: Path, *extra: str) -> dict:
    proc = run_tool(
        "bench-decode",
        "--url", url,
        "-n", str(PROMPT_COUNT),
        "-c", "1",
        "--max-tokens", str(MAX_TOKENS),
        "--ignore-eos",
        "--warmup", "1",
        "--repeats", "1",
        "--prompts", str(prompt_file),
        "--output", str(out),
        *extra,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    result["stdout"] = proc.stdout
    return result


def write_prompts(folder: Path, prompts: list[str]) -> Path:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


# --------------------------------------------------------------------------------------------
# The bench's figures are vllm bench serve's


def test_bench_figures_equal_vllm_calculate_metrics_on_the_same_timings(server, prompts, tmp_path):
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput
    from vllm.benchmarks.serve import calculate_metrics

    qs = [25.0, 50.0, 99.9]
    rows, lines = tmp_path / "bench.csv", tmp_path / "bench.jsonl"
    result = bench(
        server.url, tmp_path / "bench.json", write_prompts(tmp_path, prompts),
        "--metric-percentiles", "25,50,99.9", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--goodput", "ttft:600000", "e2el:600000", "--csv", str(rows), "--jsonl", str(lines),
    )  # fmt: skip
    stdout = result.pop("stdout")
    jsonschema.validate(result, json.loads((MEASURE / "schemas" / "bench-decode.schema.json").read_text()))
    assert result["schema"] == "magpie/bench-decode/4"
    outputs = [
        RequestFuncOutput(
            success=True,
            latency=r["latency_s"],
            output_tokens=r["output_tokens"],
            ttft=r["ttft_s"],
            itl=r["itl_s"],
            prompt_len=r["prompt_tokens"],
        )
        for r in result["records"]
    ]
    metrics, lens = calculate_metrics([], outputs, result["summary"]["duration_s"], None, [50, 90, 99], {})
    assert lens == [MAX_TOKENS] * PROMPT_COUNT
    s = result["summary"]
    for ours, name in ((s["ttft_ms"], "ttft"), (s["tpot_ms"], "tpot"), (s["itl_ms"], "itl"), (s["e2el_ms"], "e2el")):
        assert ours["mean"] == pytest.approx(getattr(metrics, f"mean_{name}_ms"), rel=1e-9), name
        assert ours["median"] == pytest.approx(getattr(metrics, f"median_{name}_ms"), rel=1e-9), name
        assert ours["std"] == pytest.approx(getattr(metrics, f"std_{name}_ms"), rel=1e-9, abs=1e-12), name
        percentiles = dict(getattr(metrics, f"percentiles_{name}_ms"))
        for q in (50, 90, 99):
            assert ours[f"p{q}"] == pytest.approx(percentiles[q], rel=1e-9), (name, q)
    # The chosen percentiles and goodput, as vLLM computes them (its own SLO comparison).
    metrics, _ = calculate_metrics([], outputs, s["duration_s"], None, qs, {"ttft": 600000.0, "e2el": 600000.0})
    for name in ("ttft", "tpot", "itl", "e2el"):
        theirs = dict(getattr(metrics, f"percentiles_{name}_ms"))
        ours = s["percentiles_ms"][name]
        assert set(ours) == {"p25", "p50", "p99.9"}, ours
        for q in qs:
            assert ours[f"p{q:g}"] == pytest.approx(theirs[q], rel=1e-9), (name, q)
        assert f"{name.upper()} ms percentiles" in stdout
    assert s["goodput"]["good_requests"] == PROMPT_COUNT
    assert s["goodput"]["request_per_s"] == pytest.approx(metrics.request_goodput, rel=1e-9)
    # An SLO between two requests' TTFTs: some requests meet it, as in vLLM's count.
    ttfts = sorted(r["ttft_s"] for r in result["records"])
    slo = {"ttft": (ttfts[1] + ttfts[-2]) / 2 * 1000, "tpot": 10**6}
    metrics, _ = calculate_metrics([], outputs, s["duration_s"], None, qs, slo)
    good = common.goodput(result["records"], slo, s["duration_s"])
    assert 0 < good["good_requests"] < PROMPT_COUNT
    assert good["request_per_s"] == pytest.approx(metrics.request_goodput, rel=1e-9)
    # CSV: one row per metric; JSONL: one line per request, the JSON's records.
    table = list(csv.DictReader(rows.open()))
    assert [r["metric"] for r in table][:4] == ["ttft", "tpot", "itl", "e2el"]
    assert float(table[0]["p99.9"]) == pytest.approx(s["percentiles_ms"]["ttft"]["p99.9"])
    assert float(table[1]["mean"]) == pytest.approx(s["tpot_ms"]["mean"])
    assert [json.loads(x)["output_sha256"] for x in lines.read_text().splitlines()] == [
        r["output_sha256"] for r in result["records"]
    ]
    # The machine's state: no GPU here, MemAvailable's low-water mark under its start.
    state = result["machine"]
    assert state["launch"]["vllm_server"] == result["server"]["vllm_version"]
    assert state["gpu"]["name"] == "unknown" or state["gpu"]["driver"] != "unknown"
    assert 0 < state["mem_available_low_water_bytes"] <= state["mem_available_before_bytes"]
    # Per request only vLLM's figures: no rate over a client-side window.
    for record in result["records"]:
        assert not {"decode_tok_per_s", "decode_interval_s", "decode_unmeasured_reason"} & set(record)
        assert record["tpot_s"] == pytest.approx((record["latency_s"] - record["ttft_s"]) / (MAX_TOKENS - 1))


def test_bench_repeats_3_by_default_keep_each_figures_range_and_the_report_shows_it(server, prompts, tmp_path):
    out = tmp_path / "bench.json"
    # No --repeats: the default, 3.
    proc = run_tool(
        "bench-decode", "--url", server.url, "-n", "2", "-c", "1", "--max-tokens", "16", "--ignore-eos",
        "--warmup", "0", "--prompts", str(write_prompts(tmp_path, prompts)), "--output", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    jsonschema.validate(result, json.loads((MEASURE / "schemas" / "bench-decode.schema.json").read_text()))
    assert [r["repeat"] for r in result["records"]] == [1, 1, 2, 2, 3, 3]
    assert [r["index"] for r in result["records"]] == [0, 1, 2, 3, 4, 5]
    rates = [r["engine_decode_tok_per_s"] for r in result["repeats"]]
    spread = result["summary"]["spread"]["engine_decode_tok_per_s"]
    assert spread == {"median": sorted(rates)[1], "min": min(rates), "max": max(rates), "n": 3}
    assert min(rates) <= result["summary"]["engine_decode_tok_per_s"] <= max(rates)  # pooled sums
    assert "engine_decode_tok_per_s over repeats" in proc.stdout
    # The same measurement twice in the report: its ranges overlap.
    folders = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "bench-c1.json").write_text(json.dumps({**result, "label": name}))
        folders.append(str(folder))
    table = run_tool("report", "--compare", *folders)
    assert table.returncode == 0, table.stderr
    assert "c=1 median [min - max] (repeats)" in table.stdout and "c=1 decode vs first (repeats)" in table.stdout
    shown = f"{spread['median']:.1f} [{spread['min']:.1f} - {spread['max']:.1f}] (3)"
    for name, versus in (("a", "(reference)"), ("b", "within noise")):
        assert re.search(rf"^{name} .*{re.escape(shown)} +{re.escape(versus)}", table.stdout, re.M), table.stdout


def test_bench_agrees_with_the_real_vllm_bench_serve_cli(server, prompts, tmp_path):
    ours = bench(server.url, tmp_path / "bench.json", write_prompts(tmp_path, prompts))
    # The same prompts as a ShareGPT-format file (the custom dataset needs pandas, not installed).
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(
        json.dumps(
            [
                {"id": str(i), "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "x " * 64}]}
                for i, p in enumerate(prompts)
            ]
        )
    )
    proc = subprocess.run(
        [PYTHON, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
         "--backend", "openai-chat", "--base-url", server.url, "--endpoint", "/v1/chat/completions",
         "--model", "tiny", "--tokenizer", server.model,
         "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--sharegpt-output-len", str(MAX_TOKENS),
         "--num-prompts", str(PROMPT_COUNT), "--max-concurrency", "1", "--ignore-eos", "--temperature", "0",
         "--num-warmups", "1", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
         "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "vllm.json",
         "--disable-tqdm"],
        env=vllm_env(None), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    theirs = json.loads((tmp_path / "vllm.json").read_text())
    s = ours["summary"]
    assert theirs["completed"] == s["completed"] == PROMPT_COUNT
    assert theirs["output_lens"] == [r["output_tokens"] for r in ours["records"]] == [MAX_TOKENS] * PROMPT_COUNT
    # At most one chunk per engine step (48 tokens at 4 per step, plus the role chunk: 13 gaps);
    # a front-end that falls behind merges several steps' outputs into one chunk, more so on a
    # loaded machine, so only the bound is the same for both clients.
    for counts in ([len(x) for x in theirs["itls"]], [len(r["itl_s"]) for r in ours["records"]]):
        assert all(0 <= n <= 13 for n in counts), counts
    assert theirs["spec_decode_acceptance_length"] == pytest.approx(s["spec_decode"]["acceptance_length"]) == 4.0
    # Two runs on a shared 2-core machine: the same definitions give figures of one size. Only
    # E2E latency: a client that reads several chunks in one go (theirs as well as ours, on a
    # loaded machine) stamps them microseconds apart, so ITL percentiles collapse (seen: vLLM's
    # median ITL 0.03 ms beside our 7.9 ms), and when most of a reply arrives in one read, TPOT
    # and TTFT do too (seen in a clean-clone CI run: vLLM's median TPOT 0.0016 ms beside our
    # 0.90 ms). The definitions themselves are checked against vLLM's calculate_metrics on the
    # same timings (test_bench_figures_equal_vllm_calculate_metrics_on_the_same_timings).
    # The fastest request of each run, not the median: the suite runs two test files at once, so
    # the other worker's load can rise between the two runs (seen in a clean-clone run: vLLM's
    # median E2EL 1,240 ms beside our 290 ms), and the fastest of six requests is the one least
    # slowed by it. vLLM's per-request E2EL is its TTFT plus its inter-chunk gaps (the time of the
    # last chunk; its own latency adds the stream's end).
    theirs_fastest = min(ttft + sum(itl) for ttft, itl in zip(theirs["ttfts"], theirs["itls"], strict=True)) * 1000
    ratio = s["e2el_ms"]["min"] / theirs_fastest
    assert 1 / 3 < ratio < 3, ("fastest e2el ms", s["e2el_ms"]["min"], theirs_fastest)
    assert theirs["median_e2el_ms"] > 0
    assert theirs["mean_itl_ms"] >= 0 and s["itl_ms"]["mean"] > 0
    for label in ("TTFT ms", "TPOT ms", "ITL ms (per chunk)"):
        assert re.search(rf"^  {re.escape(label)}\s+mean \S+  p50 \S+  p90 \S+  p99 \S+", ours["stdout"], re.M)


class BurstProxy:
    """An HTTP proxy on 127.0.0.1 in front of the real server that holds every `burst_every`-th
    streamed chat reply until it is complete, then sends its first `head_lines` lines, waits
    `pause_s` and sends the rest in one write: what a client sees when the server's front-end is
    starved of CPU and flushes a whole reply at once. Paths in `missing` answer 404, as vLLM does
    for its dev endpoints without VLLM_SERVER_DEV_MODE=1. After `die_after` streamed replies the
    proxy stops listening: to the client, the server has died."""

    def __init__(
        self,
        upstream: str,
        burst_every: int = 2,
        missing: tuple[str, ...] = (),
        head_lines: int = 0,
        pause_s: float = 0.0,
        die_after: int | None = None,
    ):
        target = urllib.parse.urlsplit(upstream)
        proxy = self
        self.streams = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _forward(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if urllib.parse.urlsplit(self.path).path in missing:
                    self.send_error(404)
                    return
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=600)
                conn.request(method, self.path, body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                burst = streamed = False
                if method == "POST" and self.path.endswith("/chat/completions"):
                    streamed = True
                    proxy.streams += 1
                    burst = proxy.streams % burst_every == 0
                self.send_response(resp.status)
                self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
                self.send_header("Connection", "close")
                self.end_headers()
                if burst:
                    lines = resp.read().splitlines(keepends=True)
                    head = [x for x in lines if x.startswith(b"data:")][:head_lines]
                    cut = lines.index(head[-1]) + 1 if head else 0
                    self.wfile.write(b"".join(lines[:cut]))
                    self.wfile.flush()
                    time.sleep(pause_s)
                    self.wfile.write(b"".join(lines[cut:]))
                else:
                    while line := resp.readline():
                        self.wfile.write(line)
                        self.wfile.flush()
                conn.close()
                if streamed and die_after is not None and proxy.streams >= die_after:
                    threading.Thread(target=proxy.close, daemon=True).start()

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.closed = threading.Event()

    def close(self) -> None:
        if not self.closed.is_set():
            self.closed.set()
            self.httpd.shutdown()
            self.httpd.server_close()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.close()


def tok_s_figures(stdout: str) -> list[float]:
    """Every number on the table's lines that speak of tok/s."""
    return [float(x) for line in stdout.splitlines() if "tok/s" in line for x in re.findall(r"\d+\.\d+", line)]


@pytest.mark.parametrize(("head_lines", "pause_s"), [(0, 0.0), (2, 0.003)], ids=["one-write", "3ms-after-first"])
def test_a_reply_that_arrives_in_a_burst_gives_no_burst_rate(server, prompts, tmp_path, head_lines, pause_s):
    """Every second reply arrives in one write, or (the H200 sweep's case: two 256-token replies
    in 2.45 and 10.7 ms read as 97,701 and 23,600 tok/s) the role and first token chunks, then
    3 ms, then the rest: a window over the 2 ms floor the bench used to have."""
    # The case needs the held replies to reach the client at once (within 20 ms of the pause): on a
    # host busy with another test file (tests/run.sh runs two) the client can be descheduled
    # between chunks (seen: 64 ms), which is no burst. Such a run is made again, up to three times.
    windows = []
    for attempt in range(3):
        with BurstProxy(server.url, head_lines=head_lines, pause_s=pause_s) as proxy:
            out = tmp_path / f"bench-{attempt}.json"
            result = bench(proxy.url, out, write_prompts(tmp_path, prompts), "--warmup", "0")
        records, s = result["records"], result["summary"]
        bursts = [r for r in records if r["index"] % 2 == 1]  # the proxy holds every second stream
        windows = [r["chunks"][-1][0] - r["chunks"][0][0] for r in bursts]
        if bursts and all(w < pause_s + 0.02 for w in windows):
            break
    assert bursts and all(w < pause_s + 0.02 for w in windows), ("no run delivered the bursts at once", windows)
    for record in bursts:
        # vLLM's TPOT of such a reply is what the client saw: the burst, not the engine's time.
        assert record["tpot_s"] == pytest.approx((record["latency_s"] - record["ttft_s"]) / (MAX_TOKENS - 1))
    engine = s["engine_decode_tok_per_s"]
    assert engine > 0
    # Every tok/s figure on the table stays of the engine's size (before: a median / p90 of
    # 10^4+ tok/s), none printed but the engine's, and no decode figure per request.
    figures = tok_s_figures(result["stdout"])
    assert figures and all(value < engine * 3 for value in figures), (result["stdout"], engine)
    assert re.search(rf"^  decode tok/s, engine times {engine:.1f}$", result["stdout"], re.M), result["stdout"]
    assert "decode_tok_per_s" not in s and all("decode_tok_per_s" not in r for r in records)


def test_a_server_that_dies_mid_run_is_still_reported_with_mtp_on(server, prompts, tmp_path):
    out = tmp_path / "bench.json"
    with BurstProxy(server.url, burst_every=10**9, die_after=2) as proxy:
        proc = run_tool(
            "bench-decode", "--url", proxy.url, "-n", "6", "-c", "1", "--max-tokens", "16", "--warmup", "0",
            "--repeats", "1", "--prompts", str(write_prompts(tmp_path, prompts)), "--output", str(out),
        )  # fmt: skip
    assert proc.returncode == 3, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.strip().startswith("MTP"))
    assert f"on (k={MTP_TOKENS}); acceptance not measured" in line and "off" not in line, proc.stdout
    result = json.loads(out.read_text())
    jsonschema.validate(result, json.loads((MEASURE / "schemas" / "bench-decode.schema.json").read_text()))
    assert result["status"] == "server-died" and result["summary"]["spec_decode"] is None
    assert result["server"]["mtp"] == {"on": True, "num_speculative_tokens": MTP_TOKENS}


# --------------------------------------------------------------------------------------------
# The report's tables and charts, from real result files


@pytest.fixture(scope="module")
def result_folder(server, tmp_path_factory, gsm8k_fixture) -> Path:
    """A run_suite.sh-shaped folder from this module's server (bench at c=1 and c=4, GSM8K on
    the fixture problems) and the split of the real H200 trace (tests/fixtures), whose GPU
    figures a CPU trace has not."""
    folder = tmp_path_factory.mktemp("result") / "cpu-mtp3"
    folder.mkdir()
    for concurrency, count in ((1, 3), (4, 4)):
        proc = run_tool(
            "bench-decode", "--url", server.url, "-n", str(count), "-c", str(concurrency), "--max-tokens", "24",
            "--ignore-eos", "--warmup", "0", "--repeats", "1", "--label", "MTP k=3",
            "--output", str(folder / f"bench-c{concurrency}.json"),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    proc = run_tool(
        "gsm8k", "--url", server.url, "--dataset", str(gsm8k_fixture), "--limit", "4", "--max-tokens", "16",
        "--label", "MTP k=3", "--output", str(folder / "gsm8k.json"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    split = folder / "profile" / "decode-c1" / "split.json"
    split.parent.mkdir(parents=True)
    trace = REPO / "tests" / "fixtures" / "h200-q4e-mmap12-fp-decode.pt.trace.json.gz"
    proc = run_tool("trace-split", str(trace), "--output", str(split))
    assert proc.returncode == 0, proc.stderr
    return folder


def test_report_compare_names_per_request_and_aggregate_figures_apart(result_folder):
    proc = run_tool("report", "--compare", str(result_folder))
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.splitlines()[0]
    assert "c=1 decode tok/s per request" in header and "c=4 aggregate tok/s, all requests" in header, header
    c1 = json.loads((result_folder / "bench-c1.json").read_text())["summary"]["engine_decode_tok_per_s"]
    c4 = json.loads((result_folder / "bench-c4.json").read_text())["summary"]["aggregate_output_tok_per_s"]
    row = proc.stdout.splitlines()[2]
    assert f"{c1:.1f}" in row and f"{c4:.1f}" in row, (row, c1, c4)
    assert "c=1 decode: one request at a time" in proc.stdout and "c=4 aggregate: four requests" in proc.stdout


def test_report_charts_gpu_time_shares_apart_from_step_shares(result_folder, tmp_path):
    page_path = tmp_path / "report.html"
    proc = run_tool("report", "--seed", "none", str(result_folder), "--output", str(page_path))
    assert proc.returncode == 0, proc.stderr
    page = page_path.read_text()
    section = page.split("<h2>Step-time breakdown</h2>", 1)[1].split("<h2>", 1)[0]
    charts = [chunk.split("</svg>", 1)[0] for chunk in section.split("<svg")[1:]]
    assert len(charts) == 2, section
    step_chart, gpu_chart = charts
    summary = json.loads((result_folder / "profile" / "decode-c1" / "split.json").read_text())["traces"][0]["summary"]
    assert "share of step (%)" in step_chart and "GPU busy" in step_chart and "GPU:" not in step_chart
    assert "share of GPU time (%)" in gpu_chart and "share of step" not in gpu_chart
    families = summary["gpu_share_by_family"]
    assert families and sum(families.values()) == pytest.approx(1.0)
    for family, share in families.items():
        assert f"{family} share of GPU time: {share * 100:.1f} %" in gpu_chart, family


def test_report_says_why_gsm8k_is_zero_on_the_counting_model(result_folder, tmp_path):
    gsm8k = json.loads((result_folder / "gsm8k.json").read_text())
    assert gsm8k["summary"]["accuracy"] == 0
    page_path = tmp_path / "report.html"
    assert run_tool("report", "--seed", "none", str(result_folder), "--output", str(page_path)).returncode == 0
    explanation = "every reply of this model counts upwards"
    assert explanation in page_path.read_text()
    for mode in ("--compare", "--summary"):
        assert explanation in run_tool("report", mode, str(result_folder)).stdout, mode
    # A model whose replies do not count upwards gets no such note: one reply changed.
    other = tmp_path / "other"
    other.mkdir()
    for name in ("bench-c1.json", "bench-c4.json", "gsm8k.json"):
        (other / name).write_bytes((result_folder / name).read_bytes())
    bench = json.loads((other / "bench-c1.json").read_text())
    bench["records"][0]["token_ids"][3] += 7
    (other / "bench-c1.json").write_text(json.dumps(bench))
    assert explanation not in run_tool("report", "--compare", str(other)).stdout


# --------------------------------------------------------------------------------------------
# The sweep


def sweep_cmd(run_dir: Path, *args: str, timeout: float = 900, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*tool("sweep"), str(run_dir), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


GRID = ["--input-lens", "64,200", "--concurrency", "1,2", "--output-len", "12", "--prompts-per-point", "2"]


def resets(server: VllmServer) -> int:
    return server.log_path.read_text().count("Resetting prefix cache")


@pytest.fixture(scope="module")
def first_sweep(server, tmp_path_factory) -> SimpleNamespace:
    """A first sweep of the running MTP k=3 server (the sweep launches a configuration later,
    once that server is stopped: one vLLM server at a time on this machine)."""
    run_dir = tmp_path_factory.mktemp("sweep") / "run"
    before = resets(server)
    proc = sweep_cmd(run_dir, "--server", f"mtp3={server.url}", "--repeats", "1", "--min-free", "1GiB", *GRID)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return SimpleNamespace(path=run_dir, resets_on_mtp3=resets(server) - before, stderr=proc.stderr)


@pytest.fixture(scope="module")
def sweep_dir(first_sweep) -> Path:
    return first_sweep.path


def test_sweep_measures_every_point_with_a_prefix_cache_reset_before_each(first_sweep):
    sweep_dir = first_sweep.path
    results = json.loads((sweep_dir / "results.json").read_text())
    assert results["schema"] == "magpie/sweep/4" and results["status"] == "complete"
    assert results["points_expected"] == results["points_complete"] == 4
    assert {(r["config"], r["input_len"], r["concurrency"]) for r in results["summary"]} == {
        ("mtp3", n, k) for n in (64, 200) for k in (1, 2)
    }
    assert first_sweep.resets_on_mtp3 == 4  # one reset before each run, seen in the server's log
    for row in results["summary"]:
        assert row["requests"] == 2 and row["failed"] == 0
        assert abs(row["prompt_tokens_mean"] - row["input_len"]) <= 8, row  # prompts cut to the input length
        assert row["ttft_p50_ms"] > 0 and row["ttft_p99_ms"] >= row["ttft_p50_ms"]
        assert row["tpot_p99_ms"] >= row["tpot_p50_ms"] > 0 and row["itl_p99_ms"] >= row["itl_p50_ms"] > 0
        assert row["acceptance_length"] == MTP_TOKENS + 1
        assert row["engine_decode_tok_s"] > 0  # pooled from the runs' engine sums
    runs = [p for p in results["points"] if (p["input_len"], p["concurrency"]) == (64, 1)]
    assert len(runs) == 1 and runs[0]["engine_decode_tok_s"] == pytest.approx(
        json.loads((sweep_dir / runs[0]["file"]).read_text())["summary"]["engine_decode_tok_per_s"]
    )
    with open(sweep_dir / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and set(rows[0]) == set(sweep.SUMMARY_FIELDS)
    assert float(rows[0]["tpot_p50_ms"]) == pytest.approx(results["summary"][0]["tpot_p50_ms"])
    with open(sweep_dir / "points.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 4
    # Each figure's spread over the repeats (one here), one CSV row per point and figure.
    row = results["summary"][0]
    assert row["spread"]["engine_decode_tok_s"]["n"] == 1
    assert row["spread"]["engine_decode_tok_s"]["median"] == pytest.approx(row["engine_decode_tok_s"])
    assert set(row["percentiles_ms"]) == {"ttft", "tpot", "itl", "e2el"} and "p90" in row["percentiles_ms"]["itl"]
    with open(sweep_dir / "metrics.csv", newline="") as f:
        figures = list(csv.DictReader(f))
    assert {r["figure"] for r in figures} >= {"engine_decode_tok_s", "ttft_p50_ms", "acceptance_length"}
    assert len([r for r in figures if r["figure"] == "engine_decode_tok_s"]) == 4
    # Every request had a prompt of its own.
    files = (sweep_dir / "prompts").glob("*.jsonl")
    texts = [json.loads(line)["prompt"] for p in files for line in p.read_text().splitlines()]
    assert len(texts) == len(set(texts)) == 2 * 2  # 2 lengths x 2 prompts (repeat 1)


def test_sweep_at_context_depths_prefixes_every_prompt_with_the_depth(server, tmp_path):
    run_dir = tmp_path / "depth"
    proc = sweep_cmd(
        run_dir, "--server", f"mtp3={server.url}", "--depths", "0,256", "--input-lens", "64",
        "--concurrency", "1", "--repeats", "1", "--output-len", "8", "--prompts-per-point", "1", "--min-free", "1GiB",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["grid"]["depths"] == [0, 256] and results["points_complete"] == 2
    tokens = {}
    for depth, name in ((0, "in64-c1-r1.json"), (256, "d256-in64-c1-r1.json")):
        point = json.loads((run_dir / "points" / "mtp3" / name).read_text())
        assert point["status"] == "complete"
        tokens[depth] = point["records"][0]["prompt_tokens"]
    assert abs(tokens[256] - tokens[0] - 256) <= 8, tokens  # the context of 256 tokens before the same input
    assert {(r["depth"], r["input_len"]) for r in results["summary"]} == {(0, 64), (256, 64)}
    with open(run_dir / "results.csv", newline="") as f:
        assert [r["depth"] for r in csv.DictReader(f)] == ["0", "256"]
    assert re.search(r"^mtp3 +256 +64 +1 +1 ", proc.stdout, re.M), proc.stdout


def test_sweep_rerun_skips_finished_runs_and_extends_the_grid(sweep_dir, server):
    points = sorted((sweep_dir / "points").rglob("*.json"))
    stamps = {p: p.stat().st_mtime_ns for p in points}
    again = sweep_cmd(sweep_dir, "--server", f"mtp3={server.url}", "--repeats", "1", "--min-free", "1GiB", *GRID)
    assert again.returncode == 0, again.stderr
    assert "mtp3: 0 runs to do, 4 done before (skipped)" in again.stderr
    # One more repeat: only the new runs are made.
    more = sweep_cmd(sweep_dir, "--server", f"mtp3={server.url}", "--repeats", "2", "--min-free", "1GiB", *GRID)
    assert more.returncode == 0, more.stderr
    assert "mtp3: 4 runs to do, 4 done before (skipped)" in more.stderr
    assert {p: p.stat().st_mtime_ns for p in points} == stamps  # finished runs untouched
    results = json.loads((sweep_dir / "results.json").read_text())
    assert results["points_expected"] == results["points_complete"] == 8
    assert all(r["repeats"] == 2 and r["requests"] == 4 for r in results["summary"])
    # Other settings would mix two sweeps in one folder: refused.
    other = sweep_cmd(sweep_dir, "--server", f"mtp3={server.url}", "--output-len", "32", "--input-lens", "64")
    assert other.returncode != 0 and "output_len=12" in other.stderr


def test_sweep_results_take_runs_an_older_bench_wrote_without_their_engine_sums(sweep_dir, tmp_path):
    """A folder resumed across the bench-decode/3 change: its older runs have no engine sums."""
    copy = tmp_path / "run"
    shutil.copytree(sweep_dir, copy)
    old = copy / "points" / "mtp3" / "in64-c1-r1.json"
    result = json.loads(old.read_text())
    result["schema"] = "flash-next/bench-decode/2"
    del result["summary"]["engine_decode_seconds"], result["summary"]["engine_decode_requests"]
    old.write_text(json.dumps(result))
    document = sweep.write_results(str(copy), json.loads((copy / "sweep.json").read_text()))
    rows = {(r["input_len"], r["concurrency"]): r for r in document["summary"] if r["config"] == "mtp3"}
    assert rows[(64, 1)]["engine_decode_tok_s"] is None  # not pooled from a part of the runs
    assert all(row["engine_decode_tok_s"] > 0 for key, row in rows.items() if key != (64, 1))


def test_sweep_memory_gate_stops_before_a_run_and_keeps_the_rest(sweep_dir, server):
    before = len(list((sweep_dir / "points").rglob("*.json")))
    proc = sweep_cmd(
        sweep_dir, "--server", f"mtp3={server.url}", "--repeats", "1", "--min-free", "100000GiB", "--gate-wait", "1",
        "--input-lens", "96", "--concurrency", "1", "--output-len", "12", "--prompts-per-point", "2",
    )  # fmt: skip
    assert proc.returncode == 4, proc.stderr
    assert re.search(r"memory gate: MemAvailable [\d.]+ GiB < --min-free 100000\.0 GiB", proc.stderr)
    assert len(list((sweep_dir / "points").rglob("*.json"))) == before
    assert json.loads((sweep_dir / "results.json").read_text())["points_complete"] == 8


def test_sweep_refuses_a_server_without_the_reset_endpoint(tmp_path, server):
    small = [
        "--repeats",
        "1",
        "--input-lens",
        "64",
        "--concurrency",
        "1",
        "--output-len",
        "4",
        "--prompts-per-point",
        "1",
    ]
    with BurstProxy(server.url, burst_every=10**9, missing=("/reset_prefix_cache",)) as proxy:
        proc = sweep_cmd(tmp_path / "a", "--server", f"x={proxy.url}", *small)
        assert proc.returncode == 1 and "VLLM_SERVER_DEV_MODE=1" in proc.stderr, proc.stderr
        assert not list((tmp_path / "a").rglob("in64-*.json"))
        unreset = sweep_cmd(tmp_path / "b", "--server", f"x={proxy.url}", "--no-reset-prefix-cache", *small)
        assert unreset.returncode == 0, unreset.stderr
    proc = sweep_cmd(tmp_path / "c", "--server", "x=http://127.0.0.1:9", *small)
    assert proc.returncode == 3 and "no healthy server at http://127.0.0.1:9" in proc.stderr


def test_random_prompts_have_the_asked_length(server):
    texts = sweep.make_prompts(server.url, "tiny", "random", 150, 2, seed=5)
    assert len(set(texts)) == 2
    for text in texts:
        body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "add_generation_prompt": True}
        count = len(server.post("/tokenize", body)["tokens"])
        assert abs(count - 150) <= 8, count


def test_sweep_launches_a_configuration_through_serve_sh(sweep_dir, tiny_mtp_model):
    # The pool's MTP server stays up, idle, for the later module that shares it; the sweep's
    # launched configuration runs beside it.
    env = vllm_env(None, VLLM_PYTHON=PYTHON, MAX_MODEL_LEN="2048", PLE="0")
    proc = sweep_cmd(
        sweep_dir, "--config", "off:mtp=0", "--model", str(tiny_mtp_model), "--repeats", "1", "--min-free", "1GiB",
        *GRID, *(f"--serve-arg={arg}" for arg in EAGER), env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "off: starting serve.sh" in proc.stderr and "off: its server stopped" in proc.stderr
    log = next((sweep_dir / "servers").glob("off-*.log"))
    text = log.read_text()
    command = text.split("# command:", 1)[1].splitlines()[0]
    assert "--speculative-config" not in command  # serve.sh's MTP=0
    assert "--enforce-eager" in command  # the sweep's --serve-arg reached vllm serve
    assert text.count("Resetting prefix cache") == 4
    pid = int(re.search(r"server PID (\d+)", (log.parent / (log.name + ".serve-sh.err")).read_text()).group(1))
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    results = json.loads((sweep_dir / "results.json").read_text())
    assert {c["name"]: c["kind"] for c in results["configs"]} == {"mtp3": "running", "off": "launched"}
    off = [r for r in results["summary"] if r["config"] == "off"]
    assert len(off) == 4 and all(r["acceptance_length"] is None and r["failed"] == 0 for r in off)
    assert results["points_complete"] == 12
    # The table compares with the first configuration; one run per point has no noise range.
    assert "decode vs first" in proc.stdout
    assert re.search(r"^off .*% \(one run: noise unknown\)$", proc.stdout, re.M), proc.stdout


def test_report_draws_the_sweep(sweep_dir, tmp_path):
    html_path = tmp_path / "report.html"
    proc = run_tool("report", "--seed", "none", "--sweep", str(sweep_dir), "--output", str(html_path))
    assert proc.returncode == 0, proc.stderr
    page = html_path.read_text()
    assert "Sweep: latency by input length and concurrency" in page
    assert page.count("<polyline") == 2 * 4  # TPOT and TTFT: one line per config x concurrency
    assert page.count("<circle") == 2 * 8
    for label in ("mtp3 c=1", "mtp3 c=2", "off c=1", "off c=2"):
        assert label in page
    assert report.load_sweep(str(sweep_dir))["points_complete"] == 12


def test_sweep_help_stands_on_its_own():
    proc = run_tool("sweep", "--help", timeout=60)
    assert proc.returncode == 0
    for option in ("--config", "--server", "--input-lens", "--concurrency", "--repeats", "--min-free"):
        assert option in proc.stdout


def test_report_reads_sweeps_under_the_legacy_and_the_current_schema_prefix(tmp_path):
    committed = REPO / "docs" / "data" / "sweep-cpu-tiny"  # an older sweep.py wrote it: flash-next/sweep/1
    assert json.loads((committed / "results.json").read_text())["schema"] == "flash-next/sweep/1"
    page = "".join(report.sweep_section(report.load_sweep(str(committed))))
    assert "written by an older sweep.py (flash-next/sweep/1)" in page
    for schema, older in (
        ("magpie/sweep/1", True),
        ("magpie/sweep/2", False),
        ("magpie/sweep/3", False),
        ("magpie/sweep/4", False),
        ("flash-next/sweep/2", False),
    ):
        folder = tmp_path / schema.replace("/", "-")
        folder.mkdir()
        document = {**json.loads((committed / "results.json").read_text()), "schema": schema}
        (folder / "results.json").write_text(json.dumps(document))
        page = "".join(report.sweep_section(report.load_sweep(str(folder))))
        assert ("written by an older sweep.py" in page) is older, schema
    (folder / "results.json").write_text(json.dumps({**document, "schema": "magpie/sweep/5"}))
    with pytest.raises(
        SystemExit,
        match=r"not a sweep.py result \(magpie/sweep/4 or magpie/sweep/3 or magpie/sweep/2 or magpie/sweep/1\)",
    ):
        report.load_sweep(str(folder))
