"""The Flash-Next tools against real vLLM servers on 127.0.0.1, each launched by serve.sh.

Three servers of the tiny Qwen3.5 + MTP "increment" model (greedy next id = previous id + 1, and
the MTP block drafts exactly that), all with the whole patch series applied (inert unless asked).
Only one runs at a time: starting the next stops the previous one (its log and results stay), so
the tests that talk to a live server come in the order of the servers:
- mtp: MTP k=3 with the full draft head, and a torch profiler;
- pruned: MTP k=3 with the draft head pruned to a keep-set fitted from the mtp server's outputs;
- plain: MTP off; the last test kills it in the middle of a bench.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import jsonschema
import numpy
import pytest

from magpie.measure import report, trace_split
from tests.conftest import EAGER
from tests.serving.helpers import MEASURE, PACKAGE, PYTHON, REPO, ServeSh, counter_samples, run_tool, tool

pytestmark = pytest.mark.slow

SCHEMAS = MEASURE / "schemas"
MTP_TOKENS = 3
PROFILER = '{{"profiler": "torch", "torch_profiler_dir": "{}", "torch_profiler_dump_cuda_time_total": false}}'


def schema(name: str) -> dict:
    return json.loads((SCHEMAS / f"{name}.schema.json").read_text())


def suite(out: Path, server: ServeSh, label: str, expect: str, gsm8k: Path | None) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        URL=server.url,
        LABEL=label,
        SERVER_LOG=str(server.log_path),
        EXPECT=expect,
        N_C1="4",
        N_C4="8",
        REPEATS="1",
        MAX_TOKENS="48",
        BENCH_ARGS="--ignore-eos",
        GSM8K=str(gsm8k or ""),
        GSM8K_ARGS="--max-tokens 32",
        PYTHON=PYTHON,
    )
    return subprocess.run(
        ["bash", str(MEASURE / "run_suite.sh"), str(out)], env=env, capture_output=True, text=True, timeout=900
    )


_live: list[ServeSh] = []


def start_server(tmp: Path, name: str, model: Path, overlay: Path, settings: dict, extra=()) -> ServeSh:
    """Start a server through serve.sh, after stopping the one started before (one at a time on 2 cores).

    Eager (EAGER, passed last as serve.sh passes extra arguments): what these tests read (outputs,
    counters, logs, traces' step roles, PID and process tree) does not depend on torch.compile, and
    each start is ~30 s shorter; tests/test_vllm_server.py keeps a compiled server."""
    while _live:
        _live.pop().stop()
    args = ["--served-model-name", "tiny", "--no-enable-prefix-caching", *extra, *EAGER]  # MTP on CPU needs the 2nd
    server = ServeSh(tmp / f"{name}.log", model, overlay, settings, args).start()
    _live.append(server)
    return server


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("magpie")


@pytest.fixture(scope="module")
def mtp_server(work, tiny_mtp_model, patched_vllm):
    traces = work / "traces"
    traces.mkdir()
    server = start_server(
        work,
        "mtp",
        tiny_mtp_model,
        patched_vllm,
        # The CPU default process layout (tests/conftest.py moves the others' workers into the engine
        # core): profiled inside the engine-core process instead, the torch profiler on this CPU build
        # held 8.8 GB and a core for 8+ minutes writing a half-second window's trace.
        # The watchdog's stall limit above the trace export: writing a window's trace stops the
        # engine core, and under the other worker's load (2026-12-07) that took over 60 s, the
        # default limit, so the watchdog stopped the server in the middle of profile-capture.
        {"MTP": str(MTP_TOKENS), "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "WATCHDOG_ARGS": "--stall-after 600"},
        ["--profiler-config", PROFILER.format(traces)],
    )
    server.trace_dir = traces
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mtp_results(work, mtp_server, gsm8k_fixture) -> Path:
    out = work / "results" / "cpu-mtp3"
    proc = suite(out, mtp_server, "CPU, MTP k=3, full draft head", "mtp=3 draft_head=full", gsm8k_fixture)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (out / "suite.log").read_text()
    capture = run_tool(
        "profile-capture",
        "--url",
        mtp_server.url,
        "--trace-dir",
        str(mtp_server.trace_dir),
        "--out",
        str(out / "profile"),
        "--decode-steps",
        "8",
        "--min-window-s",
        "0.5",
        "--prefill-tokens",
        "600",
        "--timeout",
        "300",
        timeout=900,
    )
    assert capture.returncode == 0, capture.stdout + capture.stderr
    return out


@pytest.fixture(scope="module")
def keep_set(work, mtp_results, tiny_mtp_model) -> Path:
    """A keep-set fitted from the mtp server's own generations by the mtp_pruning tools.

    Coverage 1.0: every id those generations hold, so the pruned server (same prompts, greedy)
    loses no draft and its acceptance can be compared exactly.
    """
    path = work / "keep.npy"
    proc = subprocess.run(
        [PYTHON, str(REPO / "magpie"), "fit-keepset"]
        + [str(mtp_results / name) for name in ("bench-c1.json", "bench-c4.json", "gsm8k.json")]
        + ["--model", str(tiny_mtp_model), "-o", str(path), "--coverage", "1.0", "--quiet"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return path


@pytest.fixture(scope="module")
def pruned_server(work, tiny_mtp_model, patched_vllm, keep_set):
    server = start_server(
        work, "pruned", tiny_mtp_model, patched_vllm, {"MTP": str(MTP_TOKENS), "DRAFT_VOCAB_PATH": str(keep_set)}
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pruned_results(work, pruned_server) -> Path:
    out = work / "results" / "cpu-mtp3-pruned"
    proc = suite(out, pruned_server, "CPU, MTP k=3, pruned draft head", "mtp=3 draft_head=pruned", None)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (out / "suite.log").read_text()
    return out


@pytest.fixture(scope="module")
def plain_server(work, tiny_mtp_model, patched_vllm):
    server = start_server(work, "plain", tiny_mtp_model, patched_vllm, {"MTP": "0"})
    yield server
    server.stop()


# --------------------------------------------------------------------------------------------
# serve.sh's launch


def test_serve_sh_log_header_has_command_versions_and_patch_status(mtp_server, patched_vllm):
    header = [line for line in mtp_server.log_path.read_text().splitlines() if line.startswith("# ")]
    text = "\n".join(header)
    assert re.search(r"^# command: .*-m vllm\.entrypoints\.cli\.main serve ", text, re.M)
    assert "--host 127.0.0.1" in text and f"--port {mtp_server.port}" in text
    assert f'num_speculative_tokens\\":\\ {MTP_TOKENS}' in text
    assert re.search(r"^# command: .* --enforce-eager$", text, re.M), "serve.sh passes extra arguments last"
    assert re.search(r"^# vllm: 0\.29\.0", text, re.M) and re.search(r"^# torch: ", text, re.M)
    status = subprocess.run(
        [PYTHON, str(REPO / "magpie" / "patches.py"), "status", "--json", "--target", str(patched_vllm)],
        capture_output=True,
        text=True,
        check=True,
    )
    for patch in json.loads(status.stdout)["patches"]:
        assert re.search(rf"^# patches:\s+{re.escape(patch['name'])}\s+applied", text, re.M), patch["name"]


def test_serve_sh_binds_loopback_and_writes_the_server_pid(mtp_server):
    pid = mtp_server.server_pid
    assert "vllm.entrypoints.cli.main" in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    assert os.getpgid(pid) == pid, "the server leads its own process group"
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":  # LISTEN
                address, port = local.split(":")
                listening.add((address, int(port, 16)))
    assert ("0100007F", mtp_server.port) in listening  # 127.0.0.1, little-endian hex
    assert not any(port == mtp_server.port and set(address) == {"0"} for address, port in listening)


def test_serve_sh_supervises_its_server_through_memguard_run(mtp_server):
    pid = mtp_server.server_pid
    assert re.search(
        rf"\[memguard [^\]]*\] guarding server PID {pid} \(process group {pid}\)", mtp_server.log_path.read_text()
    )
    # The server's parent is the supervisor, `memguard run` (the guard runs in it), and serve.sh
    # is the supervisor's parent; no separate `memguard watch` process.
    parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    argv = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
    assert argv[1:4] == [str(PACKAGE).encode(), b"memguard", b"run"], argv
    assert argv[argv.index(b"--pid-file") + 1] == str(mtp_server.pid_file).encode()
    grandparent = int(Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert grandparent == mtp_server.pid  # serve.sh
    # Only this server's: serve.sh's descendants, or a process naming its PID or PID file (another
    # test file may run a `memguard watch` of its own meanwhile).
    table = processes()
    names = (f"--pid\0{pid}\0".encode(), str(mtp_server.pid_file).encode())
    ours = set(descendants(table, mtp_server.pid)) | {
        p for p, (_, argv) in table.items() if any(n in argv for n in names)
    }
    watchers = [p for p in ours if b"memguard\0watch" in table[p][1]]
    assert watchers == [], {p: table[p][1] for p in watchers}


def processes() -> dict[int, tuple[int, bytes]]:
    """Every process in /proc now: PID -> (parent PID, raw command line)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                table[int(entry)] = (ppid, Path(f"/proc/{entry}/cmdline").read_bytes())
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
    return table


def descendants(table: dict[int, tuple[int, bytes]], root: int) -> list[int]:
    """Every process below ROOT in TABLE (processes())."""
    found, todo = [], [root]
    while todo:
        parent = todo.pop()
        kids = [p for p, (ppid, _) in table.items() if ppid == parent]
        found += kids
        todo += kids
    return found


# --------------------------------------------------------------------------------------------
# bench and GSM8K


def test_bench_json_is_schema_valid_with_plausible_figures(mtp_results):
    for name, concurrency, requests in (("bench-c1.json", 1, 4), ("bench-c4.json", 4, 8)):
        result = json.loads((mtp_results / name).read_text())
        jsonschema.validate(result, schema("bench-decode"))
        s = result["summary"]
        assert result["status"] == "complete" and result["config"]["concurrency"] == concurrency
        assert s["requests"] == s["completed"] == requests and s["failed"] == 0
        assert s["output_tokens"] == requests * 48  # --ignore-eos: every request runs to max_tokens
        assert s["generation_tokens_counted_by_server"] == s["output_tokens"]
        assert all(r["output_tokens"] == 48 and len(r["token_ids"]) == 48 for r in result["records"])
        assert 0 < s["ttft_s"]["median"] < 60 and s["tpot_ms"]["p50"] > 0 and s["itl_ms"]["n"] > 0
        # Decode tok/s is the engine's: one decode time per request, one first token each.
        assert s["engine_decode_requests"] == requests and s["engine_decode_seconds"] > 0
        assert s["engine_decode_tok_per_s"] == pytest.approx(
            (s["output_tokens"] - requests) / s["engine_decode_seconds"]
        )
        assert result["server"]["mtp"] == {"on": True, "num_speculative_tokens": MTP_TOKENS}
        assert 0 < s["aggregate_output_tok_per_s"] < 1e5
        # The increment model drafts exactly what the target emits: every draft is accepted.
        spec = s["spec_decode"]
        assert spec["num_speculative_tokens"] == MTP_TOKENS
        assert spec["acceptance_rate"] == 1.0 and spec["acceptance_length"] == MTP_TOKENS + 1
        for record in result["records"]:
            ids = record["token_ids"]
            assert ids == list(range(ids[0], ids[0] + len(ids)))


def test_acceptance_figures_equal_raw_metrics_counters(mtp_server, tmp_path):
    before = mtp_server.get("/metrics")
    out = tmp_path / "bench.json"
    proc = run_tool(
        "bench-decode",
        "--url",
        mtp_server.url,
        "-n",
        "3",
        "-c",
        "1",
        "--max-tokens",
        "40",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--output",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    after = mtp_server.get("/metrics")

    def delta(name, position=None):  # the test's own reading of the two pages, not the bench's
        a = counter_samples(after, name)
        b = counter_samples(before, name)
        keys = [k for k in a if position is None or f'position="{position}"' in k]
        return sum(a[k] - b.get(k, 0.0) for k in keys)

    spec = json.loads(out.read_text())["summary"]["spec_decode"]
    drafts = delta("vllm:spec_decode_num_drafts_total")
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    draft_tokens = delta("vllm:spec_decode_num_draft_tokens_total")
    assert drafts > 0
    assert spec["drafts"] == drafts and spec["accepted_tokens"] == accepted and spec["draft_tokens"] == draft_tokens
    assert spec["acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert spec["acceptance_rate"] == pytest.approx(accepted / draft_tokens)
    per_pos = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", p) / drafts for p in range(MTP_TOKENS)]
    assert spec["per_position_acceptance"] == pytest.approx(per_pos)


def test_gsm8k_json_is_schema_valid_and_consistent(mtp_results, gsm8k_fixture):
    import hashlib

    result = json.loads((mtp_results / "gsm8k.json").read_text())
    jsonschema.validate(result, schema("gsm8k"))
    s = result["summary"]
    assert result["status"] == "complete" and s["problems"] == 12 and s["answered"] == 12
    assert result["dataset"]["sha256"] == hashlib.sha256(gsm8k_fixture.read_bytes()).hexdigest()
    assert s["accuracy"] == s["correct"] / s["problems"]
    assert s["truncated"] == sum(r["finish_reason"] == "length" for r in result["records"])
    assert s["output_tokens"] == sum(r["output_tokens"] for r in result["records"]) > 0
    assert all(0 < r["output_tokens"] <= 32 for r in result["records"])
    assert sum(s["extraction"].values()) == s["answered"]


def test_gsm8k_refuses_a_file_of_the_wrong_size(mtp_server, gsm8k_fixture, tmp_path):
    proc = run_tool("gsm8k", "--url", mtp_server.url, "--dataset", str(gsm8k_fixture), "--expect-records", "1319")
    assert proc.returncode == 2 and "12 problems, not the expected 1319" in proc.stderr


def test_suite_summary_fits_one_screen(mtp_results):
    summary = (mtp_results / "summary.txt").read_text().splitlines()
    assert 4 <= len(summary) <= 25
    assert any("MTP acceptance length 4.000" in line for line in summary)


# --------------------------------------------------------------------------------------------
# Profiles and the trace split


def test_profile_capture_yields_real_traces_that_trace_split_parses(mtp_results, tmp_path):
    capture = json.loads((mtp_results / "profile" / "capture.json").read_text())
    assert [w["window"] for w in capture["windows"]] == ["decode-c1", "prefill", "decode-c4"]
    assert all(w["ok"] for w in capture["windows"])
    prefill = next(w for w in capture["windows"] if w["window"] == "prefill")
    assert 500 <= prefill["prompt_tokens"] <= 700
    for window in ("decode-c1", "prefill", "decode-c4"):
        folder = mtp_results / "profile" / window
        workers = sorted(folder.glob("*-rank-0.*.pt.trace.json.gz"))
        assert len(workers) == 1, os.listdir(folder)
        out = tmp_path / f"{window}.json"
        proc = run_tool("trace-split", str(folder), "--output", str(out), "--keep-steps")
        assert proc.returncode == 0, proc.stderr
        result = json.loads(out.read_text())
        jsonschema.validate(result, schema("trace-split"))
        worker = next(t for t in result["traces"] if "-rank-0." in t["file"])
        assert worker["gpu_events"] is False and any("no GPU kernel events" in n for n in worker["notes"])
        assert worker["steps"], "no engine step found in a real worker trace"
        for step in worker["steps"]:
            parts = step["worker_ms"] + step["scheduler_ms"] + step["engine_io_ms"] + step["other_ms"]
            assert step["other_ms"] >= 0 and parts == pytest.approx(step["step_ms"])
        # The role patterns match vLLM 0.29's real function names: a missed name would show up as
        # "other". The worker/engine-I/O split itself moves with the machine's load, so only a
        # floor is asserted for the worker (81 % on an idle machine, 45 % seen under a loaded CI).
        share = worker["summary"]["share"]
        assert share["other"] < 0.05, share
        assert share["worker"] > 0.2, share
        frontend = [t for t in result["traces"] if "async_llm" in t["file"]]
        assert frontend and frontend[0]["summary"] is None
    decode = json.loads((mtp_results / "profile" / "decode-c4" / "split.json").read_text())["traces"]
    assert any(t["summary"] and t["summary"]["steps"] >= 4 for t in decode)
    decode = json.loads((mtp_results / "profile" / "decode-c1" / "split.json").read_text())["traces"]
    assert any(t["summary"] and t["summary"]["steps"] >= 4 for t in decode)


def test_trace_split_streaming_reads_every_event_of_a_real_trace(mtp_results, tmp_path):
    import gzip

    source = next((mtp_results / "profile" / "decode-c1").glob("*-rank-0.*.pt.trace.json.gz"))
    plain = tmp_path / "trace.json"
    plain.write_bytes(gzip.decompress(source.read_bytes()))
    whole = json.loads(plain.read_text())["traceEvents"]
    for path in (source, plain):
        streamed = [item[1] for item in trace_split.iter_trace(str(path)) if item[0] == "event"]
        assert streamed == whole


# --------------------------------------------------------------------------------------------
# Pruned draft head


def test_pruned_draft_head_changes_nothing_in_the_output(mtp_results, pruned_results):
    base, pruned = report.load_run(str(mtp_results)), report.load_run(str(pruned_results))
    for bench in ("bench_c1", "bench_c4"):
        compared, same = report.identical_outputs(base, pruned, bench)
        assert compared == same > 0, bench
    # The keep-set holds every id these prompts produce, so no draft is lost to the pruning.
    assert pruned["acceptance_length"] == MTP_TOKENS + 1


# --------------------------------------------------------------------------------------------
# Log check


def log_check(server: ServeSh, *args: str) -> tuple[int, dict]:
    proc = run_tool("log-check", str(server.log_path), "--json", *args)
    return proc.returncode, json.loads(proc.stdout)


def test_log_check_recognises_mtp_with_the_full_draft_head(mtp_results, mtp_server):
    code, result = log_check(mtp_server, "--expect", "mtp=3", "--expect", "draft_head=full")
    assert code == 0, result["expectations_failed"]
    f = result["features"]
    assert f["mtp"]["state"] == "on" and f["mtp"]["num_speculative_tokens"] == MTP_TOKENS
    assert f["draft_head"]["state"] == "full (shared with the target)"
    assert f["ple_mmap"]["state"] == "off" and f["cudagraph_mode"]["state"] == "NONE"
    assert f["prefix_caching"]["state"] == "off" and f["memguard"]["state"] == "on"
    assert f["startup"]["state"] == "complete"
    assert all(state == "applied" for state in result["serve_sh"]["patches"].values())
    assert result["memory"]["kv_cache_gib"] > 0
    code, result = log_check(mtp_server, "--expect", "draft_head=pruned")
    assert code == 1 and "draft_head: expected pruned" in result["expectations_failed"][0]


def test_log_check_recognises_the_pruned_draft_head(pruned_results, pruned_server, keep_set):
    code, result = log_check(pruned_server, "--expect", "mtp=3", "--expect", "draft_head=pruned")
    assert code == 0, result["expectations_failed"]
    head = result["features"]["draft_head"]
    assert head["keep_set"] == str(keep_set)
    assert head["keep_ids"] == len(numpy.load(keep_set)) and head["vocab_size"] == 4096
    assert len(head["evidence"]) == 2  # the head built with K rows, and still in place when used


def test_log_check_recognises_mtp_off(plain_server):
    code, result = log_check(plain_server, "--expect", "mtp=off")
    assert code == 0, result["expectations_failed"]
    assert result["features"]["draft_head"]["state"] == "none (MTP off)"
    assert result["summary"].startswith("MTP off")


# --------------------------------------------------------------------------------------------
# Report


def test_report_renders_from_real_result_folders(mtp_results, pruned_results, tmp_path):
    html_path = tmp_path / "report.html"
    proc = run_tool("report", str(mtp_results), str(pruned_results), "--output", str(html_path))
    assert proc.returncode == 0, proc.stderr
    page = html_path.read_text()
    # Self-contained: nothing is fetched (no script, stylesheet, font or image from anywhere).
    assert not re.search(r"<script|<link|<img|@import|url\(|src=", page, re.I)
    assert page.count("<svg") >= 4
    assert "CPU, MTP k=3, pruned draft head" in page and "41.8" in page  # ours beside the seed's
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "headless Chromium is needed to look at the report: apt-get install -y chromium"
    shot = tmp_path / "report.png"
    profile = tmp_path / "chromium-profile"
    subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", f"--user-data-dir={profile}", "--window-size=1100,2600",
         f"--screenshot={shot}", html_path.as_uri()],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    assert image.size == (1100, 2600)
    colors = image.getcolors(maxcolors=1 << 20)
    counts = {rgb: n for n, rgb in colors}
    assert counts.get((0x3B, 0x6E, 0xA8), 0) > 2000, "the charts' bars were not drawn"
    assert counts.get((0xE0, 0x8A, 0x2E), 0) > 2000


# --------------------------------------------------------------------------------------------
# A dead server


def test_killing_the_server_mid_bench_leaves_partial_json_and_nonzero_exit(plain_server, tmp_path):
    out = tmp_path / "bench.json"
    bench = subprocess.Popen(
        [*tool("bench-decode"), "--url", plain_server.url, "-n", "400", "-c", "1"]
        + ["--max-tokens", "64", "--ignore-eos", "--warmup", "0", "--repeats", "1", "--output", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        done = counter_samples(plain_server.get("/metrics"), "vllm:request_success_total")
        if sum(done.values()) >= 3:
            break
        time.sleep(0.2)
    os.killpg(plain_server.server_pid, signal.SIGKILL)
    stdout, stderr = bench.communicate(timeout=300)
    assert bench.returncode == 3, stderr
    assert "stopped answering; partial results written" in stderr
    result = json.loads(out.read_text())
    jsonschema.validate(result, schema("bench-decode"))
    assert result["status"] == "server-died"
    ok = [r for r in result["records"] if r["ok"]]
    assert len(ok) >= 3 and len(result["records"]) < 400
    assert any(not r["ok"] for r in result["records"])
    assert plain_server.proc.wait(timeout=120) != 0  # serve.sh reports the server's death
    assert not plain_server.pid_file.exists()
