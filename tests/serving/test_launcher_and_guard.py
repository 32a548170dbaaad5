"""serve.sh's refusals, the memory guard on real processes, and the tools' pure logic.

No vLLM server is started here: serve.sh must refuse before it would launch one.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from magpie import TOOLS, cli
from magpie.measure import gsm8k_eval, trace_split
from magpie.serving import cgroup, memguard
from magpie.serving.metrics import MetricsSnapshot
from magpie.serving.process import group_members
from tests.serving.helpers import MEASURE, PYTHON, REPO, run_tool, tool

SERVE_SH = REPO / "magpie" / "serving" / "serve.sh"
# Refusals must come before the weight load (about 10 minutes for Flash-Next); a refusal that
# took anywhere near a server start here (about two minutes) would have loaded vLLM first.
REFUSAL_DEADLINE_S = 30


def serve_sh(tmp_path: Path, env_overrides: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ)
    env.update({"VLLM_PYTHON": PYTHON, "PORT": "18999", "MAX_MODEL_LEN": "2048"})
    env.update(env_overrides)
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", str(SERVE_SH), str(tmp_path / "server.log"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    return proc, time.monotonic() - start


def assert_refused_before_launch(tmp_path: Path, proc, elapsed: float, *needles: str) -> None:
    assert proc.returncode == 1, proc.stderr
    assert "serve.sh: refusing to start" in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr
    assert elapsed < REFUSAL_DEADLINE_S, f"refusal took {elapsed:.1f} s"
    assert not (tmp_path / "server.log").exists(), "the log is written only when the server is launched"
    assert not (tmp_path / "server.log.pid").exists()


# --------------------------------------------------------------------------------------------
# serve.sh refusals


def test_serve_sh_refuses_ple_on_unpatched_vllm(tmp_path, tiny_mtp_model):
    # The venv's own vLLM is pristine: PLE=1 needs the ple_ssd patches.
    proc, elapsed = serve_sh(tmp_path, {"MODEL": str(tiny_mtp_model), "PLE": "1", "MTP": "0"})
    assert_refused_before_launch(tmp_path, proc, elapsed, "PLE=1", "ple_ssd")


def test_serve_sh_refuses_keep_set_without_the_mtp_pruning_patch(tmp_path, tiny_mtp_model):
    keep = tmp_path / "keep.pt"
    torch.save(torch.arange(0, 100, dtype=torch.int64), keep)
    proc, elapsed = serve_sh(tmp_path, {"MODEL": str(tiny_mtp_model), "PLE": "0", "DRAFT_VOCAB_PATH": str(keep)})
    assert_refused_before_launch(tmp_path, proc, elapsed, "DRAFT_VOCAB_PATH", "mtp_pruning")


@pytest.mark.parametrize(
    "name, content, needle",
    [
        ("unsorted.pt", lambda: torch.tensor([5, 3, 9]), "is not sorted"),
        ("duplicates.pt", lambda: torch.tensor([1, 2, 2, 7]), "duplicate id 2"),
        ("out-of-range.pt", lambda: torch.tensor([1, 2, 99999]), "out of range"),
        ("floats.pt", lambda: torch.tensor([1.0, 2.0]), "integer dtype"),
        ("missing.pt", None, "no such file"),
    ],
)
def test_serve_sh_refuses_invalid_keep_set(tmp_path, tiny_mtp_model, patched_vllm, name, content, needle):
    keep = tmp_path / name
    if content is not None:
        torch.save(content(), keep)
    env = {"MODEL": str(tiny_mtp_model), "PLE": "0", "DRAFT_VOCAB_PATH": str(keep), "PYTHONPATH": str(patched_vllm)}
    proc, elapsed = serve_sh(tmp_path, env)
    assert_refused_before_launch(tmp_path, proc, elapsed, "DRAFT_VOCAB_PATH", needle)


def test_serve_sh_refuses_a_keep_set_that_would_run_code(tmp_path, tiny_mtp_model, patched_vllm):
    marker = tmp_path / "code-ran"
    keep = tmp_path / "evil.pt"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save(Evil(), keep)
    env = {"MODEL": str(tiny_mtp_model), "PLE": "0", "DRAFT_VOCAB_PATH": str(keep), "PYTHONPATH": str(patched_vllm)}
    proc, elapsed = serve_sh(tmp_path, env)
    assert_refused_before_launch(tmp_path, proc, elapsed, "refused")
    assert not marker.exists(), "loading the keep-set ran code"


def test_serve_sh_refuses_relative_keep_set_path(tmp_path, tiny_mtp_model, patched_vllm):
    torch.save(torch.arange(10), tmp_path / "keep.pt")
    env = {"MODEL": str(tiny_mtp_model), "PLE": "0", "DRAFT_VOCAB_PATH": "keep.pt", "PYTHONPATH": str(patched_vllm)}
    proc, elapsed = serve_sh(tmp_path, env)
    assert_refused_before_launch(tmp_path, proc, elapsed, "relative")


def _path_without(tmp_path: Path, tool: str) -> str:
    """A PATH with every program of the current PATH except `tool` (symlinks), as on a host lacking it."""
    dirs = []
    for number, directory in enumerate(os.environ["PATH"].split(os.pathsep)):
        if not os.path.isdir(directory):
            continue
        shadow = tmp_path / "path" / str(number)
        shadow.mkdir(parents=True)
        for entry in os.listdir(directory):
            if entry != tool:
                os.symlink(os.path.join(directory, entry), shadow / entry)
        dirs.append(str(shadow))
    return os.pathsep.join(dirs)


def test_serve_sh_refuses_when_flashinfer_jit_needs_ninja_and_it_is_missing(tmp_path, tiny_mtp_model):
    # serve.sh puts VLLM_PYTHON's folder on PATH (the venv has a ninja): point it at a wrapper elsewhere.
    wrapper_dir = tmp_path / "env-bin"
    wrapper_dir.mkdir()
    wrapper = wrapper_dir / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{PYTHON}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    env = {
        "MODEL": str(tiny_mtp_model),
        "PLE": "0",
        "MTP": "0",
        "JIT_CHECK": "1",  # this host has no GPU; JIT_CHECK=1 asks for the check a GPU host gets by default
        "VLLM_PYTHON": str(wrapper),
        "PATH": _path_without(tmp_path, "ninja"),
    }
    proc, elapsed = serve_sh(tmp_path, env)
    assert_refused_before_launch(tmp_path, proc, elapsed, "ninja is not on PATH")


def test_serve_sh_refuses_without_model_and_never_overwrites_a_log(tmp_path, tiny_mtp_model):
    proc, elapsed = serve_sh(tmp_path, {"MODEL": "", "PLE": "0"})
    assert_refused_before_launch(tmp_path, proc, elapsed, "MODEL is not set")
    (tmp_path / "server.log").write_text("an earlier run\n")
    proc, _ = serve_sh(tmp_path, {"MODEL": str(tiny_mtp_model), "PLE": "0"})
    assert proc.returncode == 1 and "exists" in proc.stderr
    assert (tmp_path / "server.log").read_text() == "an earlier run\n"


def test_serve_sh_help_shows_the_defaults():
    proc = subprocess.run(["bash", str(SERVE_SH), "--help"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0
    for default in ("PORT=8100", "HOST=127.0.0.1"):
        assert default in proc.stdout
    # The default profile's values, as its file holds them (test_serve_sh_profile_list.py: every file).
    seed = proc.stdout[proc.stdout.index("  seed-gb10 ") :]
    for value in ("gpu-memory-utilization=0.76", "max-num-seqs=4", "max-model-len=65536", "ple=true"):
        assert value in seed.split("\n  PROFILE=")[0], value
    assert "num_speculative_tokens=3" in seed


# --------------------------------------------------------------------------------------------
# Memory guard, on real processes

HOG = textwrap.dedent(
    """
    import os, sys, time
    if os.environ.get("MEMGUARD_TEST_ROLE") == "hungry":
        hold = []
        for _ in range(64):  # up to 4 GiB, 64 MiB at a time, every page written
            hold.append(bytearray(b"\\x01") * (64 << 20))
            time.sleep(0.05)
    time.sleep(120)
    """
)


def _spawn(script: Path, role: str) -> subprocess.Popen:
    env = dict(os.environ, MEMGUARD_TEST_ROLE=role)
    # Identical command lines: the guard must tell them apart by PID, not by name.
    proc = subprocess.Popen([sys.executable, str(script)], env=env, start_new_session=True)
    # Right after fork the child may not have exec'd yet (its cmdline reads empty or as ours).
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 30
    while str(script).encode() not in cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc


def test_memguard_stops_the_hungry_process_and_leaves_a_same_named_sibling(tmp_path):
    script = tmp_path / "hog.py"
    script.write_text(HOG)
    sibling = _spawn(script, "idle")
    hungry = _spawn(script, "hungry")
    log = tmp_path / "guard.log"
    try:
        assert Path(f"/proc/{sibling.pid}/cmdline").read_bytes() == Path(f"/proc/{hungry.pid}/cmdline").read_bytes()
        threshold = memguard.mem_available() - (512 << 20)  # just above the current usage
        guard = subprocess.run(
            [*tool("memguard"), "watch", "--pid", str(hungry.pid), "--min-available", str(threshold)]
            + ["--interval", "0.05", "--grace", "10", "--log", str(log)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert guard.returncode == 3, guard.stderr + log.read_text()
        assert hungry.wait(timeout=30) == -signal.SIGTERM
        assert sibling.poll() is None, "the same-named sibling was stopped"
        text = log.read_text()
        assert f"stopping process group {hungry.pid}" in text and "SIGTERM" in text
        assert "stopped by the memory guard" in text
    finally:
        for proc in (hungry, sibling):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_memguard_exits_when_its_server_exits(tmp_path):
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"], start_new_session=True)
    log = tmp_path / "guard.log"
    guard = subprocess.run(
        [*tool("memguard"), "watch", "--pid", str(server.pid), "--min-available", "1MiB"]
        + ["--interval", "0.1", "--log", str(log)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    server.wait()
    assert guard.returncode == 0
    assert f"server PID {server.pid} exited; the guard exits" in log.read_text()


def test_memguard_run_guards_the_command_it_starts_and_returns_its_status(tmp_path):
    proc = run_tool("memguard", "run", "--min-available", "1MiB", "--", sys.executable, "-c", "exit(7)")
    assert proc.returncode == 7, proc.stderr
    script = tmp_path / "hog.py"
    script.write_text(HOG)
    threshold = memguard.mem_available() - (512 << 20)
    env = dict(os.environ, MEMGUARD_TEST_ROLE="hungry")
    cmd = ["memguard", "run", "--min-available", str(threshold), "--interval", "0.05", "--grace", "10"]
    proc = run_tool(*cmd, "--", sys.executable, str(script), env=env, timeout=120)
    assert proc.returncode == 3 and "stopped by the memory guard" in proc.stderr


# A server whose worker outlives it: the leader forks a child that ignores SIGTERM (as vLLM's engine
# core took 12 s to go after a kill -9 of its API server), writes the child's PID, and waits.
LEADER_WITH_STUBBORN_WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    child = os.fork()
    if child == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(300)
        os._exit(0)
    with open(sys.argv[1], "w") as f:
        f.write(str(child))
    time.sleep(300)
    """
)


def test_memguard_run_kills_what_outlives_a_killed_server_after_the_grace(tmp_path):
    script = tmp_path / "leader.py"
    script.write_text(LEADER_WITH_STUBBORN_WORKER)
    worker_file, pid_file, log = tmp_path / "worker.pid", tmp_path / "server.pid", tmp_path / "run.log"
    cmd = [*tool("memguard"), "run", "--no-guard", "--grace", "2", "--pid-file", str(pid_file), "--log", str(log)]
    supervisor = subprocess.Popen([*cmd, "--", sys.executable, str(script), str(worker_file)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not (worker_file.exists() and worker_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        leader, worker = int(pid_file.read_text()), int(worker_file.read_text())
        os.kill(leader, signal.SIGKILL)
        killed = time.monotonic()
        assert supervisor.wait(timeout=30) == 128 + signal.SIGKILL
        waited = time.monotonic() - killed
        assert group_members(leader) == [], "the worker outlived its server and the grace"  # gone, or a zombie
        assert 2 <= waited < 10, f"the worker got SIGKILL {waited:.1f} s after its server died (--grace 2)"
        text = log.read_text()
        assert f"process(es) of the server's group {leader} (PIDs {worker}) still running 2 s" in text, text
        assert "the server exited with status 137" in supervisor.stderr.read().decode()
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
        with contextlib.suppress(ProcessLookupError, ValueError, OSError):
            os.kill(int(worker_file.read_text()), signal.SIGKILL)


def test_memguard_run_says_when_its_server_exits_0_without_a_stop(tmp_path):
    proc = run_tool("memguard", "run", "--no-guard", "--", sys.executable, "-c", "pass")
    assert proc.returncode == 0
    assert "exited with status 0 without a stop from this supervisor" in proc.stderr, proc.stderr


def test_memguard_refuses_a_pid_in_its_own_process_group(tmp_path):
    # Stopping this group would stop the guard and its caller too.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        proc = run_tool("memguard", "watch", "--pid", str(child.pid), timeout=60)
        assert proc.returncode == 2
        assert "own process group" in proc.stderr
    finally:
        child.kill()
        child.wait()


def _cgroup2_memory_available() -> bool:
    mount, own = cgroup.cgroup2_mount(), cgroup.own_cgroup2_path()
    if mount is None or own is None:
        return False
    try:
        return "memory" in Path(mount, own.lstrip("/"), "cgroup.controllers").read_text().split()
    except OSError:
        return False


def test_memguard_hard_limit_runs_the_command_under_memory_max_or_says_why_not(tmp_path):
    out = tmp_path / "cgroup.txt"
    cmd = [
        sys.executable,
        "-c",
        f"import pathlib; pathlib.Path({str(out)!r}).write_text(open('/proc/self/cgroup').read())",
    ]
    proc = run_tool("memguard", "exec", "--max", "2GiB", "--", *cmd, timeout=60)
    if _cgroup2_memory_available() or os.path.isdir("/run/systemd/system"):
        assert proc.returncode == 0, proc.stderr
        assert "magpie-" in out.read_text() or "scope" in proc.stderr
    else:
        # This host (cgroup v1 memory controller, no systemd): a clear refusal, and the command never ran.
        assert proc.returncode == 2
        assert "no hard memory limit possible" in proc.stderr
        assert not out.exists()


def test_memguard_parses_sizes():
    assert cli.parse_size("6GiB") == 6 << 30
    assert cli.parse_size("512MiB") == 512 << 20
    assert cli.parse_size("110G") == 110 * 10**9
    assert cli.parse_size("1048576") == 1 << 20
    with pytest.raises(Exception, match="not a size"):
        cli.parse_size("six gigs")


# --------------------------------------------------------------------------------------------
# GSM8K answer extraction and data set checks


@pytest.mark.parametrize(
    "reply, value, method",
    [
        ("She has 42 - 35 = 7 left.\n#### 7", 7.0, "hash"),
        ("Total: 1,800 pages.\n#### 1,800", 1800.0, "hash"),
        ("#### $28.", 28.0, "hash"),
        ("It is -4 + 11 = 7, so the answer is \\boxed{7}", 7.0, "boxed"),
        ("First 12, then 15, so 15 days in all.", 15.0, "last-number"),
        ("The temperature is -3 degrees", -3.0, "last-number"),
        ("I cannot tell.", None, "none"),
        ("#### 5 ... wait, let me redo it. #### 6", 6.0, "hash"),
    ],
)
def test_gsm8k_answer_extraction(reply, value, method):
    assert gsm8k_eval.extract_answer(reply) == (value, method)


def test_gsm8k_fixture_references_parse(gsm8k_fixture):
    problems, digest = gsm8k_eval.load_dataset(str(gsm8k_fixture))
    assert len(problems) == 12 and len(digest) == 64
    assert [p["reference"] for p in problems][:3] == [7.0, 15.0, 28.0]


def test_gsm8k_refuses_records_without_a_final_answer(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "2+2?", "answer": "four"}) + "\n")
    proc = run_tool("gsm8k", "--dataset", str(bad), "--url", "http://127.0.0.1:9")
    assert proc.returncode != 0 and "record 1" in proc.stderr and "####" in proc.stderr


def test_gsm8k_parquet_without_pyarrow_says_what_to_do(tmp_path):
    try:
        import pyarrow  # noqa: F401

        pytest.skip("pyarrow is installed here; the parquet path is then read by pyarrow itself")
    except ImportError:
        pass
    data = tmp_path / "test.parquet"
    data.write_bytes(b"PAR1")
    proc = run_tool("gsm8k", "--dataset", str(data), "--url", "http://127.0.0.1:9")
    assert proc.returncode != 0 and "needs pyarrow" in proc.stderr


# --------------------------------------------------------------------------------------------
# Trace split arithmetic (GPU events cannot be recorded on this machine: a hand-made trace with
# known overlaps checks the union and the launch counts)


def _synthetic_gpu_trace(path: Path) -> None:
    engine = "vllm/v1/engine/core.py(1468): _process_engine_step"
    events = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "EngineCore"}}]
    for step in range(3):
        t = step * 1000.0
        events += [
            {"ph": "X", "cat": "python_function", "name": engine, "pid": 1, "tid": 1, "ts": t, "dur": 900},
            {
                "ph": "X",
                "cat": "python_function",
                "name": "vllm/v1/core/sched/scheduler.py(501): schedule",
                "pid": 1,
                "tid": 1,
                "ts": t + 10,
                "dur": 50,
            },
            {
                "ph": "X",
                "cat": "python_function",
                "name": "vllm/v1/worker/gpu_worker.py(1107): execute_model",
                "pid": 1,
                "tid": 1,
                "ts": t + 100,
                "dur": 700,
            },
            {
                "ph": "X",
                "cat": "python_function",
                "name": "vllm/v1/core/sched/scheduler.py(1802): update_from_output",
                "pid": 1,
                "tid": 1,
                "ts": t + 820,
                "dur": 40,
            },
            # Two overlapping kernels on two streams (busy = 300 us, not 400) and one later kernel.
            {"ph": "X", "cat": "kernel", "name": "nvjet_tst_gemm_bf16", "pid": 0, "tid": 7, "ts": t + 200, "dur": 200},
            {
                "ph": "X",
                "cat": "kernel",
                "name": "flash_fwd_splitkv_kernel",
                "pid": 0,
                "tid": 8,
                "ts": t + 300,
                "dur": 200,
            },
            {"ph": "X", "cat": "kernel", "name": "rms_norm_kernel", "pid": 0, "tid": 7, "ts": t + 600, "dur": 100},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t + 150, "dur": 5},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": 1, "tid": 1, "ts": t + 160, "dur": 5},
        ]
    with gzip.open(path, "wt") as f:
        json.dump({"schemaVersion": 1, "traceEvents": events, "traceName": "synthetic"}, f)


def test_trace_split_counts_overlapping_kernels_once_and_never_makes_other_negative(tmp_path):
    trace = tmp_path / "synthetic.pt.trace.json.gz"
    _synthetic_gpu_trace(trace)
    result = trace_split.split(str(trace))
    assert result["anchor"].startswith("engine-core")
    assert len(result["steps"]) == 3
    # A step runs to the next step's start; the last one to the end of its own work.
    assert [s["step_ms"] for s in result["steps"]] == pytest.approx([1.0, 1.0, 0.9])
    for step in result["steps"][:2]:
        assert step["worker_ms"] == pytest.approx(0.7)
        assert step["scheduler_ms"] == pytest.approx(0.09)
        assert step["other_ms"] == pytest.approx(1.0 - 0.7 - 0.09) and step["other_ms"] >= 0
        assert step["gpu_busy_ms"] == pytest.approx(0.4)  # [200, 500) and [600, 700)
        assert step["kernel_launches"] == 1 and step["graph_launches"] == 1
        assert step["gpu_ms_by_family"] == pytest.approx({"attention": 0.2, "GEMM (BF16 dense)": 0.2, "norms": 0.1})


def test_trace_split_streams_a_large_trace_in_small_chunks(tmp_path, monkeypatch):
    trace = tmp_path / "synthetic.json"
    _synthetic_gpu_trace(tmp_path / "synthetic.json.gz")
    trace.write_bytes(gzip.decompress((tmp_path / "synthetic.json.gz").read_bytes()))
    whole = json.loads(trace.read_text())["traceEvents"]
    # A 7-byte read size cuts every number, string and object across reads.
    monkeypatch.setattr(trace_split._Stream.__init__, "__defaults__", (7,))
    streamed = [item[1] for item in trace_split.iter_trace(str(trace)) if item[0] == "event"]
    assert streamed == whole


# --------------------------------------------------------------------------------------------
# Metrics arithmetic on a real-format page

METRICS_BEFORE = """# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 25.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="2"} 6.0
"""


def test_spec_decode_figures_from_two_snapshots():
    after = (
        METRICS_BEFORE.replace("} 10.0", "} 20.0", 1)
        .replace("} 30.0", "} 60.0")
        .replace("} 25.0", "} 45.0")
        .replace('position="0"} 10.0', 'position="0"} 19.0')
        .replace('position="1"} 9.0', 'position="1"} 16.0')
        .replace('position="2"} 6.0', 'position="2"} 10.0')
    )
    figures = MetricsSnapshot.parse(after).spec_decode(MetricsSnapshot.parse(METRICS_BEFORE))
    assert figures["drafts"] == 10 and figures["draft_tokens"] == 30 and figures["accepted_tokens"] == 20
    assert figures["acceptance_length"] == pytest.approx(3.0)
    assert figures["acceptance_rate"] == pytest.approx(20 / 30)
    assert figures["per_position_acceptance"] == pytest.approx([0.9, 0.7, 0.4])
    assert figures["num_speculative_tokens"] == 3
    assert MetricsSnapshot.parse("vllm:generation_tokens_total 5.0\n").spec_decode(MetricsSnapshot()) is None


# Two engines, a sibling metric sharing the name's prefix, a timestamp, a histogram bucket with
# le="+Inf", an escaped label value and an unlabelled sample, as the exposition format allows.
METRICS_PAGE = r"""# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 120.0
vllm:generation_tokens_total{model_name="tiny",engine="1"} 80.0
vllm:generation_tokens_created{engine="0",model_name="tiny"} 1.7e+09
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0 1764590000000
vllm:request_decode_time_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 3.0
vllm:request_decode_time_seconds_sum{engine="0",model_name="tiny"} 4.0
vllm:request_decode_time_seconds_count{engine="0",model_name="tiny"} 3.0
vllm:cache_config_info{block_size="16",note="a \"quoted\" value"} 1.0
process_open_fds 9.0
"""
METRICS_PAGE_BEFORE = """vllm:generation_tokens_total{engine="0",model_name="tiny"} 100.0
vllm:request_decode_time_seconds_sum{engine="0",model_name="tiny"} 1.0
vllm:request_decode_time_seconds_count{engine="0",model_name="tiny"} 1.0
"""


def test_metrics_snapshot_reads_a_hand_written_page():
    page = MetricsSnapshot.parse(METRICS_PAGE)
    assert page.sum("vllm:generation_tokens_total") == 200.0  # both engines
    assert page.sum("vllm:generation_tokens_total", engine="1") == 80.0
    assert page.sum("vllm:generation_tokens") is None  # a prefix is no metric
    assert page.sum("vllm:num_requests_running") == 2.0  # the timestamp is not the value
    assert page.sum("process_open_fds") == 9.0
    assert page.values("vllm:generation_tokens_total") == {
        '{engine="0",model_name="tiny"}': 120.0,
        '{engine="1",model_name="tiny"}': 80.0,  # labels in one order whatever the page's
    }
    assert page.label_values("vllm:cache_config_info", "note") == ['a "quoted" value']
    assert page.label_values("vllm:request_decode_time_seconds_bucket", "le") == ["+Inf"]
    assert "vllm:spec_decode_num_drafts_total" not in page and page.spec_decode() is None


def test_metrics_deltas_between_two_hand_written_pages():
    before, after = MetricsSnapshot.parse(METRICS_PAGE_BEFORE), MetricsSnapshot.parse(METRICS_PAGE)
    assert after.delta(before, "vllm:generation_tokens_total") == 100.0  # engine 1 counts from 0
    assert after.delta(before, "vllm:prompt_tokens_total") is None  # not exported
    # (200 - 100 generated - 2 first tokens of the 2 requests finished) / (4 - 1) s
    assert after.engine_decode_rate(before) == pytest.approx(98 / 3)
    assert after.counter_deltas(before) == {
        'vllm:generation_tokens_total{engine="0",model_name="tiny"}': 20.0,
        'vllm:generation_tokens_total{engine="1",model_name="tiny"}': 80.0,
    }


def test_tools_show_help_without_a_server():
    for name in TOOLS:  # every tool of the package, through its entry point as users run it
        proc = run_tool(name, "--help", timeout=60)
        assert proc.returncode == 0 and "usage:" in proc.stdout, name
    assert (MEASURE / "run_suite.sh").stat().st_mode & stat.S_IXUSR


# --------------------------------------------------------------------------------------------
# Memory guard: the signals besides MemAvailable, on real processes


def _idle_server() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)


def _watch(pid: int, log: Path, *options: str, timeout: float = 60) -> subprocess.Popen:
    cmd = [*tool("memguard"), "watch", "--pid", str(pid), "--min-available", "1MiB"]
    cmd += ["--interval", "0.1", "--grace", "5", "--log", str(log), "--kernel-log", "none", *options]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _replace(path: Path, text: str) -> None:
    """Write a file the guard polls in one step, as the kernel presents /proc files (never half-written)."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def _wait_for(path: Path, needle: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if needle in text:
            return text
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} not in {path} after {timeout} s:\n{text}")


@pytest.mark.parametrize(
    "source, line",
    [
        ("server", "RuntimeError: CUDA error: cudaErrorMemoryAllocation: out of memory"),
        ("server", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
        ("kernel", "NVRM: nvAssertOkFailedNoLog: Assertion failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051)"),
    ],
)
def test_memguard_stops_its_server_on_a_driver_out_of_memory_line(tmp_path, source, line):
    server, sibling = _idle_server(), _idle_server()
    server_log, kernel_log, guard_log = tmp_path / "server.log", tmp_path / "kern.log", tmp_path / "guard.log"
    # serve.sh's header explains the GB10 settings by the very errors they avoid: not evidence.
    server_log.write_text(
        "# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False (... NV_ERR_NO_MEMORY ...)\nINFO start\n"
    )
    kernel_log.write_text("an old line: NVRM: Xid (PCI:0000:01:00): 31, pid=1, name=x\n")  # history: not acted on
    try:
        guard = _watch(server.pid, guard_log, "--server-log", str(server_log), "--kernel-log", str(kernel_log))
        _wait_for(guard_log, "driver errors: stop on server log")
        time.sleep(0.5)
        assert guard.poll() is None, "a line from before the guard started stopped the server"
        with open(server_log if source == "server" else kernel_log, "a") as f:
            f.write(line + "\n")
        assert guard.wait(timeout=30) == 3, guard_log.read_text()
        assert server.wait(timeout=10) == -signal.SIGTERM
        assert sibling.poll() is None
        text = guard_log.read_text()
        assert f"driver error in {'server log ' + str(server_log) if source == 'server' else 'kernel log'}" in text
        assert line[:40] in text and f"stopping process group {server.pid}" in text
        # log_check reads the guard's stop line back, whatever the signal was (not only MemAvailable).
        check = run_tool("log-check", str(guard_log), "--expect", "memguard=stopped the server", timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        for proc in (server, sibling):
            proc.kill()
            proc.wait()


def test_memguard_leaves_its_server_on_an_xid_of_another_process(tmp_path):
    server = _idle_server()
    kernel_log, guard_log = tmp_path / "kern.log", tmp_path / "guard.log"
    kernel_log.write_text("")
    try:
        guard = _watch(server.pid, guard_log, "--kernel-log", str(kernel_log))
        _wait_for(guard_log, "kernel log: ")
        other = os.getpid()  # not in the server's process group
        with open(kernel_log, "a") as f:
            f.write(f"NVRM: Xid (PCI:0000:01:00): 13, pid={other}, name=python3, Graphics Exception\n")
        _wait_for(guard_log, f"driver error of another process (PID {other})")
        assert guard.poll() is None and server.poll() is None
        with open(kernel_log, "a") as f:
            f.write(f"NVRM: Xid (PCI:0000:01:00): 31, pid={server.pid}, name=python3, MMU Fault\n")
        assert guard.wait(timeout=30) == 3
    finally:
        server.kill()
        server.wait()


def test_memguard_stops_on_psi_full_pressure_and_warns_on_some(tmp_path):
    server = _idle_server()
    psi, guard_log = tmp_path / "memory.pressure", tmp_path / "guard.log"
    _replace(psi, "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    try:
        guard = _watch(server.pid, guard_log, "--psi-file", str(psi), "--max-psi-full", "20", "--warn-psi-some", "10")
        _wait_for(guard_log, f"PSI: {psi}")
        _replace(psi, "some avg10=15.00 avg60=3.00 avg300=1.00 total=9\nfull avg10=4.00 avg60=1.0 avg300=0.2 total=5\n")
        _wait_for(guard_log, "warning: memory pressure rising: PSI some avg10 15.00 %")
        assert guard.poll() is None
        _replace(psi, "some avg10=60.00 avg60=9.00 avg300=1.00 total=99\nfull avg10=35.50 avg60=6 avg300=1 total=50\n")
        assert guard.wait(timeout=30) == 3
        assert "memory pressure: PSI full avg10 35.50 % >= 20 %" in guard_log.read_text()
        assert server.wait(timeout=10) == -signal.SIGTERM
    finally:
        server.kill()
        server.wait()


def test_memguard_says_when_psi_is_missing_and_keeps_guarding(tmp_path):
    server = _idle_server()
    guard_log = tmp_path / "guard.log"
    try:
        guard = _watch(server.pid, guard_log, "--psi-file", str(tmp_path / "absent"))
        text = _wait_for(guard_log, "GPU memory: ")
        assert f"PSI: not available ({tmp_path / 'absent'} missing" in text
        assert guard.poll() is None
    finally:
        server.kill()
        server.wait()
    assert guard.wait(timeout=30) == 0


def test_memguard_stops_when_swap_in_use_grows(tmp_path):
    # Swap cannot be filled on purpose on a shared machine: a meminfo file in /proc's format stands in.
    real = Path("/proc/meminfo").read_text()

    def meminfo(swap_free_kib: int) -> str:
        lines = [line for line in real.splitlines() if not line.startswith(("SwapTotal:", "SwapFree:"))]
        return "\n".join(lines + ["SwapTotal:       8388608 kB", f"SwapFree:        {swap_free_kib} kB"]) + "\n"

    fake = tmp_path / "meminfo"
    _replace(fake, meminfo(8388608))
    server, guard_log = _idle_server(), tmp_path / "guard.log"
    try:
        guard = _watch(server.pid, guard_log, "--meminfo", str(fake), "--max-swap-growth", "1GiB")
        _wait_for(guard_log, "swap: stop when swap in use grows by 1.00 GiB (now 0.00 GiB)")
        _replace(fake, meminfo(8388608 - 512 * 1024))  # 0.5 GiB: under the limit
        time.sleep(0.5)
        assert guard.poll() is None
        _replace(fake, meminfo(8388608 - 1536 * 1024))
        assert guard.wait(timeout=30) == 3
        assert "swap in use grew by 1.50 GiB to 1.50 GiB" in guard_log.read_text()
    finally:
        server.kill()
        server.wait()


def test_memguard_reports_gpu_memory_where_the_driver_gives_it_and_says_why_not(tmp_path):
    # No NVIDIA driver here: the guard must say so and keep guarding. Then a stand-in nvidia-smi that
    # prints what the real one prints for `--query-gpu=memory.free,memory.total --format=csv,noheader,nounits`:
    # "[N/A], [N/A]" on a GB10 (unified memory), MiB figures on a discrete GPU.
    server = _idle_server()
    try:
        log = tmp_path / "none.log"
        env = dict(os.environ, PATH=_path_without(tmp_path / "a", "nvidia-smi"))
        guard = subprocess.Popen(
            [*tool("memguard"), "watch", "--pid", str(server.pid), "--min-available", "1MiB"]
            + ["--kernel-log", "none", "--log", str(log)],
            env=env,
        )
        text = _wait_for(log, "GPU memory: ")
        if "libnvidia-ml" not in text and "NVML unavailable" not in text:
            pytest.skip("this host has an NVIDIA driver")
        assert "GPU memory: not available (NVML unavailable" in text and "no nvidia-smi on PATH" in text
        guard.terminate()
        guard.wait(timeout=10)
        for name, output, needle, stops in (
            ("gb10", "[N/A], [N/A]", "nvidia-smi reports no memory figures ([N/A], [N/A])", False),
            ("h200", "1024, 143771", "GPU 0 free memory 1.00 GiB of 140.40 GiB < threshold 4.00 GiB", True),
        ):
            bin_dir = tmp_path / name
            bin_dir.mkdir()
            smi = bin_dir / "nvidia-smi"
            smi.write_text(f"#!/bin/sh\necho '{output}'\n")
            smi.chmod(0o755)
            log = tmp_path / f"{name}.log"
            guard = subprocess.Popen(
                [*tool("memguard"), "watch", "--pid", str(server.pid), "--min-available", "1MiB"]
                + ["--kernel-log", "none", "--log", str(log), "--gpu-memory", "nvidia-smi", "--min-gpu-free", "4GiB"]
                + ["--interval", "0.1", "--gpu-interval", "0.1"],
                env=dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"),
            )
            if stops:
                assert guard.wait(timeout=30) == 3
                assert needle in log.read_text()
                server = _idle_server()
            else:
                assert needle in _wait_for(log, "GPU memory: ")
                time.sleep(0.5)
                assert guard.poll() is None
                guard.terminate()
                guard.wait(timeout=10)
    finally:
        server.kill()
        server.wait()


def test_memguard_warns_when_the_page_cache_is_dropped(tmp_path):
    # drop_caches would slow every session on this shared machine; evicting one file of our own
    # (posix_fadvise DONTNEED) makes the same kind of sudden Cached drop for the kernel's counters.
    data = tmp_path / "table.bin"
    with open(data, "wb") as f:
        for _ in range(12):
            f.write(os.urandom(64 << 20))  # 768 MiB
        f.flush()
        os.fsync(f.fileno())
    with open(data, "rb") as f:
        while f.read(64 << 20):
            pass
    server, guard_log = _idle_server(), tmp_path / "guard.log"
    try:
        guard = _watch(
            server.pid,
            guard_log,
            "--cache-drop-min",
            "600MiB",
            "--cache-drop-fraction",
            "0",
            "--cache-drop-window",
            "3",
        )
        _wait_for(guard_log, "GPU memory: ")
        time.sleep(1)
        assert "page cache dropped" not in guard_log.read_text()
        fd = os.open(data, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        text = _wait_for(guard_log, "warning: page cache dropped: Cached", timeout=10)
        assert "magpie ple-warmup warm" in text
        assert guard.poll() is None, "a dropped page cache is a warning, not a reason to stop"
    finally:
        server.kill()
        server.wait()
