"""serve.sh's refusals, the memory guard on real processes, and the tools' pure logic.

No vLLM server is started here: serve.sh must refuse before it would launch one.
"""

from __future__ import annotations

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

import gsm8k_eval
import memguard
import pytest
import torch
import trace_split
import vllm_client
from fn_helpers import PYTHON, REPO, TOOLS, run_tool

SERVE_SH = TOOLS / "serve.sh"
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
    # The venv's own vLLM is pristine: PLE=1 needs the ple-ssd patches.
    proc, elapsed = serve_sh(tmp_path, {"MODEL": str(tiny_mtp_model), "PLE": "1", "MTP": "0"})
    assert_refused_before_launch(tmp_path, proc, elapsed, "PLE=1", "ple-ssd")


def test_serve_sh_refuses_keep_set_without_the_mtp_pruning_patch(tmp_path, tiny_mtp_model):
    keep = tmp_path / "keep.pt"
    torch.save(torch.arange(0, 100, dtype=torch.int64), keep)
    proc, elapsed = serve_sh(tmp_path, {"MODEL": str(tiny_mtp_model), "PLE": "0", "DRAFT_VOCAB_PATH": str(keep)})
    assert_refused_before_launch(tmp_path, proc, elapsed, "DRAFT_VOCAB_PATH", "mtp-pruning")


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
    for default in (
        "GPU_MEM=0.76",
        "MAX_NUM_SEQS=4",
        "MAX_MODEL_LEN=65536",
        "MTP=3",
        "PLE=1",
        "PORT=8100",
        "HOST=127.0.0.1",
    ):
        assert default in proc.stdout


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
            [PYTHON, str(TOOLS / "memguard.py"), "watch", "--pid", str(hungry.pid), "--min-available", str(threshold)]
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
        [PYTHON, str(TOOLS / "memguard.py"), "watch", "--pid", str(server.pid), "--min-available", "1MiB"]
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
    proc = run_tool("memguard.py", "run", "--min-available", "1MiB", "--", sys.executable, "-c", "exit(7)")
    assert proc.returncode == 7, proc.stderr
    script = tmp_path / "hog.py"
    script.write_text(HOG)
    threshold = memguard.mem_available() - (512 << 20)
    env = dict(os.environ, MEMGUARD_TEST_ROLE="hungry")
    cmd = ["memguard.py", "run", "--min-available", str(threshold), "--interval", "0.05", "--grace", "10"]
    proc = run_tool(*cmd, "--", sys.executable, str(script), env=env, timeout=120)
    assert proc.returncode == 3 and "stopped by the memory guard" in proc.stderr


def test_memguard_refuses_a_pid_in_its_own_process_group(tmp_path):
    # Stopping this group would stop the guard and its caller too.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        proc = run_tool("memguard.py", "watch", "--pid", str(child.pid), timeout=60)
        assert proc.returncode == 2
        assert "own process group" in proc.stderr
    finally:
        child.kill()
        child.wait()


def _cgroup2_memory_available() -> bool:
    mount, own = memguard.cgroup2_mount(), memguard.own_cgroup2_path()
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
    proc = run_tool("memguard.py", "exec", "--max", "2GiB", "--", *cmd, timeout=60)
    if _cgroup2_memory_available() or os.path.isdir("/run/systemd/system"):
        assert proc.returncode == 0, proc.stderr
        assert "flash-next-" in out.read_text() or "scope" in proc.stderr
    else:
        # This host (cgroup v1 memory controller, no systemd): a clear refusal, and the command never ran.
        assert proc.returncode == 2
        assert "no hard memory limit possible" in proc.stderr
        assert not out.exists()


def test_memguard_parses_sizes():
    assert memguard.parse_size("6GiB") == 6 << 30
    assert memguard.parse_size("512MiB") == 512 << 20
    assert memguard.parse_size("110G") == 110 * 10**9
    assert memguard.parse_size("1048576") == 1 << 20
    with pytest.raises(Exception, match="not a size"):
        memguard.parse_size("six gigs")


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
    proc = run_tool("gsm8k_eval.py", "--dataset", str(bad), "--url", "http://127.0.0.1:9")
    assert proc.returncode != 0 and "record 1" in proc.stderr and "####" in proc.stderr


def test_gsm8k_parquet_without_pyarrow_says_what_to_do(tmp_path):
    try:
        import pyarrow  # noqa: F401

        pytest.skip("pyarrow is installed here; the parquet path is then read by pyarrow itself")
    except ImportError:
        pass
    data = tmp_path / "test.parquet"
    data.write_bytes(b"PAR1")
    proc = run_tool("gsm8k_eval.py", "--dataset", str(data), "--url", "http://127.0.0.1:9")
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
        assert step["gpu_ms_by_family"] == pytest.approx(
            {"attention": 0.2, "GEMM / GEMV (BF16 dense, lm_head)": 0.2, "norms": 0.1}
        )


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
    figures = vllm_client.spec_decode_figures(METRICS_BEFORE, after)
    assert figures["drafts"] == 10 and figures["draft_tokens"] == 30 and figures["accepted_tokens"] == 20
    assert figures["acceptance_length"] == pytest.approx(3.0)
    assert figures["acceptance_rate"] == pytest.approx(20 / 30)
    assert figures["per_position_acceptance"] == pytest.approx([0.9, 0.7, 0.4])
    assert vllm_client.spec_decode_figures("", "vllm:generation_tokens_total 5.0\n") is None


def test_tools_show_help_without_a_server():
    for tool in (
        "bench_decode.py",
        "gsm8k_eval.py",
        "profile_capture.py",
        "trace_split.py",
        "log_check.py",
        "report.py",
    ):
        proc = run_tool(tool, "--help", timeout=60)
        assert proc.returncode == 0 and "usage:" in proc.stdout, tool
    assert (REPO / "scripts" / "flash_next" / "run_suite.sh").stat().st_mode & stat.S_IXUSR
