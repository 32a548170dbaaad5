"""The measurement tools against ordinary mistakes: a server that answers wrongly, outputs that
cannot be written, result files of another version. Each case runs the real tool in a
subprocess against a real HTTP server on 127.0.0.1 that misbehaves as the case says (a proxy's
HTML page, an empty model list, a 500 from /metrics, replies no client can read), and asserts one
line on stderr, a non-zero exit, no traceback and nothing left behind. No vLLM is needed: the
figures against a real vLLM server are in tests/measure/test_bench_and_sweep.py.
"""

from __future__ import annotations

import http.server
import json
import os
import threading
from pathlib import Path

import pytest

from magpie.measure import common
from tests.serving.helpers import run_tool

MODELS_OK = json.dumps({"object": "list", "data": [{"id": "tiny", "max_model_len": 2048}]})
METRICS_OK = "# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total 0\n"


class Misbehaving:
    """An HTTP server on 127.0.0.1 whose answers per path are set by the test:
    {path: (status, content type, body)}; /health answers 200 unless given. POSTs to the chat
    endpoint are counted (`chat_requests`) and answered by `routes["/v1/chat/completions"]`."""

    def __init__(self, routes: dict[str, tuple[int, str, str]]):
        self.routes = {"/health": (200, "text/plain", ""), **routes}
        self.chat_requests = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self):
                path = self.path.split("?")[0]
                status, ctype, body = outer.routes.get(path, (404, "text/plain", "not found"))
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer()

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.startswith("/v1/chat/completions"):
                    outer.chat_requests += 1
                self._answer()

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def one_line_error(proc, *words: str) -> str:
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = err.splitlines()
    # The tool's own refusals say "error: ..."; those of the shared checks (files.check_output,
    # cli.run_tool) name the tool: "magpie bench-decode: ...".
    starts = ("error:", "magpie ")
    assert lines and lines[-1].startswith(starts), proc.stderr
    assert len([x for x in lines if x.startswith(starts)]) == 1, proc.stderr
    for word in words:
        assert word in lines[-1], proc.stderr
    return lines[-1]


HTML = (200, "text/html", "<html><body>Sign in to the proxy</body></html>")
EMPTY_LIST = (200, "application/json", json.dumps({"object": "list", "data": []}))
ERROR_500 = (500, "text/plain", "Internal Server Error")


def test_bench_output_under_a_regular_file_is_refused_before_any_request(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("user data\n")
    routes = {"/v1/models": (200, "application/json", MODELS_OK), "/metrics": (200, "text/plain", METRICS_OK)}
    for flag in ("--output", "--csv", "--jsonl"):
        with Misbehaving(routes) as server:
            proc = run_tool("bench-decode", "--url", server.url, "-n", "2", flag, str(blocker / "out" / "x"))
        assert proc.returncode == 1
        one_line_error(proc, flag, str(blocker))
        assert server.chat_requests == 0  # checked before the warm-up
    assert blocker.read_text() == "user data\n"


def test_bench_with_no_readable_reply_is_not_complete(tmp_path):
    routes = {
        "/v1/models": (200, "application/json", MODELS_OK),
        "/metrics": (200, "text/plain", METRICS_OK),
        "/v1/chat/completions": HTML,  # a 200 with no event stream in it
    }
    out, rows, lines = tmp_path / "bench.json", tmp_path / "bench.csv", tmp_path / "bench.jsonl"
    with Misbehaving(routes) as server:
        proc = run_tool(
            "bench-decode", "--url", server.url, "-n", "3", "--warmup", "0", "--repeats", "1",
            "--output", str(out), "--csv", str(rows), "--jsonl", str(lines),
        )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    one_line_error(proc, "none of the 3 requests")
    result = json.loads(out.read_text())
    assert result["status"] == "requests-failed" and result["summary"]["completed"] == 0
    assert "status=requests-failed" in proc.stdout
    assert len(lines.read_text().splitlines()) == 3
    assert all(json.loads(x)["ok"] is False for x in lines.read_text().splitlines())
    assert "requests-failed" in rows.read_text()


@pytest.mark.parametrize("models", [HTML, EMPTY_LIST, ERROR_500], ids=["html", "empty-list", "http-500"])
def test_a_bad_model_list_is_one_line_in_every_tool(tmp_path, models):
    routes = {"/v1/models": models, "/metrics": (200, "text/plain", METRICS_OK)}
    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    with Misbehaving(routes) as server:
        calls = {
            "bench-decode": ["--url", server.url, "-n", "1"],
            "sweep": [str(tmp_path / "sweep"), "--server", f"a={server.url}", "--input-lens", "16"],
            "profile-capture": ["--url", server.url, "--trace-dir", str(trace_dir), "--out", str(tmp_path / "p")],
        }
        for name, args in calls.items():
            proc = run_tool(name, *args, timeout=120)
            assert proc.returncode == 1, (name, proc.stdout, proc.stderr)
            one_line_error(proc, "/v1/models")
        assert server.chat_requests == 0
    assert not (tmp_path / "p").exists()  # profile-capture made no folder


def test_a_500_from_metrics_is_one_line(tmp_path):
    routes = {"/v1/models": (200, "application/json", MODELS_OK), "/metrics": ERROR_500}
    with Misbehaving(routes) as server:
        proc = run_tool("bench-decode", "--url", server.url, "-n", "1", "--warmup", "0")
    assert proc.returncode == 1
    one_line_error(proc, "/metrics", "HTTP 500")


def test_profile_capture_against_a_dead_server_leaves_no_folder(tmp_path):
    with Misbehaving({}) as server:
        url = server.url
    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    proc = run_tool("profile-capture", "--url", url, "--trace-dir", str(trace_dir), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "no healthy vLLM server" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def bench_result(status: str, schema: str = "magpie/bench-decode/4") -> dict:
    latency = {"n": 1, "mean": 1.0, "std": 0.0, "median": 1.0, "min": 1.0, "max": 1.0, "p50": 1, "p90": 1, "p99": 1}
    return {
        "schema": schema,
        "tool": "bench_decode.py",
        "label": "run",
        "status": status,
        "summary": {
            "requests": 4,
            "completed": 2,
            "output_tokens": 20,
            "aggregate_output_tok_per_s": 10.0,
            "engine_decode_tok_per_s": None,
            "ttft_s": {"median": 0.1},
            "ttft_ms": latency,
            "tpot_ms": latency,
            "itl_ms": latency,
            "e2el_ms": latency,
            "spec_decode": None,
            "percentiles_ms": {"ttft": {"p50": 1.0, "p99.9": 2.5}},
            "goodput": {"slo_ms": {"ttft": 500.0}, "good_requests": 2, "requests": 4, "request_per_s": 0.5},
        },
        "records": [],
    }


def test_report_marks_a_bench_whose_server_died_as_partial(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "bench-c1.json").write_text(json.dumps(bench_result("server-died")))
    (folder / "bench-c4.json").write_text(json.dumps(bench_result("complete")))
    proc = run_tool("report", "--compare", str(folder))
    assert proc.returncode == 0, proc.stderr
    assert "[partial: c=1 server-died]" in proc.stdout
    summary = run_tool("report", "--summary", str(folder))
    assert "[partial: c=1 server-died]" in summary.stdout
    assert "TTFT ms: p50 1.00  p99.9 2.50" in summary.stdout and "goodput 0.500 req/s" in summary.stdout
    page = tmp_path / "report.html"
    proc = run_tool("report", str(folder), "--output", str(page), "--seed", "none")
    assert proc.returncode == 0, proc.stderr
    assert "partial: c=1 server-died" in page.read_text()


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (json.dumps(bench_result("complete", "magpie/bench-decode/99")), ["magpie/bench-decode/99", "bench-decode/4"]),
        (json.dumps(bench_result("complete", "magpie/gsm8k/1")), ["magpie/gsm8k/1"]),
        ('{"schema": "magpie/bench-decode/4", "summ', ["not JSON"]),
        ("[1, 2]", ["not a result object"]),
    ],
    ids=["newer-version", "another-tool", "truncated", "a-list"],
)
def test_report_refuses_a_result_it_cannot_read_in_one_line(tmp_path, content, words):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "bench-c1.json").write_text(content)
    for args in (["--summary", str(folder)], ["--compare", str(folder)]):
        proc = run_tool("report", *args)
        assert proc.returncode == 1
        one_line_error(proc, "bench-c1.json", *words)


def test_compare_says_within_noise_when_ranges_overlap():
    a = common.spread([10.0, 11.0, 12.0])
    b = common.spread([11.5, 12.5, 13.0])
    c = common.spread([14.0, 14.5, 15.0])
    assert common.compare(a, b) == "within noise"
    assert common.compare(a, c) == "+31.8 %"
    assert common.compare(a, common.spread([12.0])) == "+9.1 % (one run: noise unknown)"
    assert common.compare(None, c) == "not measured"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--goodput", "ttft"], ["--goodput", "KEY:MS"]),
        (["--goodput", "itl:5"], ["--goodput", "ttft, tpot, e2el"]),
        (["--goodput", "ttft:-1"], ["> 0 ms"]),
        (["--metric-percentiles", "50,abc"], ["--metric-percentiles", "abc"]),
        (["--percentile-metrics", "ttft,latency"], ["--percentile-metrics"]),
    ],
)
def test_bad_percentile_and_goodput_flags_are_usage_errors(args, words):
    for name, base in (("bench-decode", []), ("sweep", ["/nonexistent-run", "--server", "a=http://127.0.0.1:9"])):
        proc = run_tool(name, *base, *args)
        assert proc.returncode == 2, (name, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert all(w in proc.stderr.strip().splitlines()[-1] for w in words), proc.stderr


def test_help_shows_the_new_options_with_defaults():
    bench = run_tool("bench-decode", "--help").stdout
    for text in ("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--goodput",
                 "--csv", "--jsonl", "--server-log"):  # fmt: skip
        assert text in bench, text
    sweep = run_tool("sweep", "--help").stdout
    for text in ("--percentile-metrics", "--metric-percentiles", "--goodput", "--repeats", "(default: 3)"):
        assert text in sweep, text


def test_machine_state_without_a_gpu_says_unknown(tmp_path):
    from magpie.measure import machine

    state = machine.Machine(None, "0.0-test")
    with state.watch():
        Path(tmp_path / "x").write_bytes(b"0" * 4096)
    record = state.record()
    assert record["launch"]["reason"] == "no --server-log given" and record["launch"]["vllm_server"] == "0.0-test"
    gpu = record["gpu"]
    if gpu["name"] == "unknown":
        assert gpu["reason"]
    assert 0 < record["mem_available_low_water_bytes"] <= record["mem_available_before_bytes"]
    assert isinstance(record["nv_err_no_memory"]["after"], int) or record["nv_err_no_memory"]["after"].startswith(
        "unreadable"
    )


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, ["No such file"]),
        ("folder", ["is a folder"]),
        ('{"prompt": "a"}\n{"prompt": "b', ["line 2", "not JSON"]),
        ('["a", ', ["not a JSON list"]),
        (b"\xff\xfe\x00", ["not UTF-8"]),
        ("[]", ["holds no prompt"]),
        ('[{"text": "a"}]', ["item 1"]),
    ],
    ids=["missing", "folder", "truncated-jsonl", "truncated-list", "binary", "empty", "wrong-item"],
)
def test_bench_bad_prompt_files_are_one_line_before_any_request(tmp_path, content, words):
    path = tmp_path / "prompts.jsonl"
    if content == "folder":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    routes = {"/v1/models": (200, "application/json", MODELS_OK), "/metrics": (200, "text/plain", METRICS_OK)}
    with Misbehaving(routes) as server:
        proc = run_tool("bench-decode", "--url", server.url, "-n", "1", "--prompts", str(path))
    assert proc.returncode == 1
    one_line_error(proc, str(path), *words)
    assert server.chat_requests == 0


def test_a_url_without_a_scheme_is_a_usage_error(tmp_path):
    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    for name, args in (
        ("bench-decode", ["--url", "127.0.0.1:8100"]),
        ("profile-capture", ["--url", "127.0.0.1:8100", "--trace-dir", str(trace_dir), "--out", str(tmp_path / "o")]),
    ):
        proc = run_tool(name, *args)
        assert proc.returncode == 2 and "give the scheme, e.g. http://127.0.0.1:8100" in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()


def test_sweep_run_dir_that_is_a_file_or_holds_a_broken_plan_is_one_line(tmp_path):
    server = ["--server", "a=http://127.0.0.1:9", "--input-lens", "16"]
    blocker = tmp_path / "a-file"
    blocker.write_text("user data\n")
    proc = run_tool("sweep", str(blocker), *server)
    assert proc.returncode == 1
    one_line_error(proc, "is a file")
    assert blocker.read_text() == "user data\n"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "sweep.json").write_text('{"output_len": 25')
    proc = run_tool("sweep", str(run_dir), *server)
    assert proc.returncode == 1
    one_line_error(proc, "sweep.json cannot be read")


def test_machine_state_reads_the_launch_manifest_and_the_ple_tables_residency(tmp_path):
    """A real launch manifest beside a log, the real patch files it names, and a checkpoint whose
    PLE table shard is a real safetensors tensor: the state gives each patch's sha256 and the
    table's resident fraction (mincore) before and after; reading the table makes it resident."""
    import hashlib
    import struct

    from magpie.measure import machine
    from tests.serving.helpers import REPO

    series = REPO / "patches" / "vllm-0.29.0"
    names = [x.strip() for x in (series / "series").read_text().splitlines() if x.strip() and not x.startswith("#")]
    model = tmp_path / "model"
    model.mkdir()
    table = b"\x01" * (64 * 4096)
    tensor = {"dtype": "U8", "shape": [len(table)], "data_offsets": [0, len(table)]}
    header = json.dumps({"model.ngram_embedding.shard_0.weight": tensor}).encode()
    shard = model / "model-00001.safetensors"
    shard.write_bytes(struct.pack("<Q", len(header)) + header + table)
    fd = os.open(shard, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # dropped from the page cache (a hint)
    os.close(fd)
    log = tmp_path / "server.log"
    (tmp_path / "server.log.launch.json").write_text(
        json.dumps(
            {
                "schema": "magpie/launch/1",
                "model": str(model),
                "overrides": {"PLE": "1", "MTP": "3"},
                "versions": {"vllm": "0.29.0", "magpie": {"commit": "abc"}},
                "patches": {
                    "target": "/venv/site-packages",
                    "series": str(series),
                    "patches": [{"name": names[0], "state": "applied", "detail": "", "requires": []}],
                },
            }
        )
    )
    state = machine.Machine(str(log), "0.29.0")
    with state.watch():
        shard.read_bytes()  # the run reads the table
    record = state.record()
    launch = record["launch"]
    assert launch["vllm"] == "0.29.0" and launch["ple"] == "1" and launch["series"] == str(series)
    assert launch["patches"] == [
        {"name": names[0], "state": "applied", "sha256": hashlib.sha256((series / names[0]).read_bytes()).hexdigest()}
    ]
    ple = record["ple_table"]
    assert ple["model"] == str(model) and ple["before"]["table_bytes"] == len(table)
    assert ple["after"]["resident_fraction"] == 1.0
    assert ple["before"]["resident_fraction"] <= ple["after"]["resident_fraction"]
    # PLE=1 from the profile (no PLE variable): the resolved config's switch says so.
    manifest_path = tmp_path / "server.log.launch.json"
    record = json.loads(manifest_path.read_text())
    record["overrides"] = {"MTP": "3"}
    record["config"] = {"hf-overrides": {"ple_mmap": True}}
    manifest_path.write_text(json.dumps(record))
    assert machine.launch_state(str(log))["ple"] == "1"
    record["config"] = {"hf-overrides": {"ple_mmap": False}}
    manifest_path.write_text(json.dumps(record))
    assert machine.launch_state(str(log))["ple"] is None
    # No manifest, or one of another schema: the reason, not a traceback.
    (tmp_path / "other.log.launch.json").write_text('{"schema": "magpie/launch/9"}')
    assert "magpie/launch/9" in machine.launch_state(str(tmp_path / "other.log"))["reason"]
    assert "no " in machine.launch_state(str(tmp_path / "none.log"))["reason"]
