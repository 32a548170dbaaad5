"""Fixtures of the ple_ssd tests: the scaled-down checkpoints, the patched vLLM overlays
(0001 alone, 0001 + 0002), and `run_ple`, which runs tests/ple_ssd/ple_runner.py under one
of them (or under the pytest process's own pristine vLLM) in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent

from magpie.demo.demo_overlay import make_overlay, vllm_env  # noqa: E402
from tests.ple_ssd.checkpoint import build_ple_checkpoint  # noqa: E402

RUNNER = HERE / "ple_runner.py"
SMALL_BASE = 2_000  # ~33k rows, 10 MB: enough for the refusal and FP8 cases


class JobResult:
    """One job of a batch child: its output file and its own log (what it wrote to fd 1 and 2)."""

    def __init__(self, out: Path, log: str):
        self.out = out
        self.log = log

    def json(self) -> dict:
        return json.loads(self.out.read_text())

    def tensors(self) -> dict:
        return torch.load(self.out)


class Batch:
    """batch(name) -> JobResult of that job, or fails the calling test with the job's traceback."""

    def __init__(self, command: list[str], jobs: dict, report: dict):
        self.command, self.jobs, self.report = command, jobs, report

    def __call__(self, name: str) -> JobResult:
        argv, log_path = self.jobs[name]
        log = Path(log_path).read_text()
        if self.report[name] is not None:
            pytest.fail(
                f"job {name} ({' '.join(argv)}) of {' '.join(self.command)} failed:\n{log[-4000:]}\n{self.report[name]}"
            )
        return JobResult(Path(argv[2]), log)


class RunResult:
    def __init__(self, proc: subprocess.CompletedProcess, out: Path):
        self.proc = proc
        self.out = out
        self.log = proc.stdout + proc.stderr

    def json(self) -> dict:
        return json.loads(self.out.read_text())

    def tensors(self) -> dict:
        return torch.load(self.out)


@pytest.fixture(scope="session")
def ple_checkpoint(tmp_path_factory) -> Path:
    """~320 MB of table in 16 shards over 4 safetensors files, plus the PLE layer's weights."""
    return build_ple_checkpoint(tmp_path_factory.mktemp("ple-ckpt") / "qwen4exp-ple")


@pytest.fixture(scope="session")
def filler_checkpoint(tmp_path_factory) -> Path:
    """~64 MB of table in 16 shards over 4 files, each shard followed by a 4 MiB other tensor."""
    folder = tmp_path_factory.mktemp("ple-filler") / "qwen4exp-ple"
    return build_ple_checkpoint(folder, ngram_vocab_size_base=12_500, filler_bytes_per_shard=4 << 20)


@pytest.fixture(scope="session")
def small_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ple-small")
    variants = {
        "good": {},
        "missing_shards": {"drop_shards": (3, 7)},
        "bad_shape": {"bad_shape_shard": 5},
        "bad_index": {"extra_shard_index": 16},
        "fp16_table": {"table_dtype": torch.float16},
        "fp8": {"table_dtype": torch.float8_e4m3fn, "fp8_scale": 0.0123},
        "fp8_no_scale": {"table_dtype": torch.float8_e4m3fn},
    }
    return {
        name: build_ple_checkpoint(root / name, ngram_vocab_size_base=SMALL_BASE, **kwargs)
        for name, kwargs in variants.items()
    }


@pytest.fixture(scope="session")
def overlays(tmp_path_factory) -> dict[str, Path | None]:
    """vLLM with ple_ssd/0001 alone, with 0001 + 0002 (the tool applies the prerequisite)."""
    return {
        "stock": None,
        "0001": make_overlay(tmp_path_factory.mktemp("vllm-ple-0001"), ["ple_ssd/0001"]),
        "0002": make_overlay(tmp_path_factory.mktemp("vllm-ple-0002"), ["ple_ssd/0002"]),
    }


@pytest.fixture(scope="session")
def run_ple(tmp_path_factory):
    """run_ple(overlay, mode, target, *args) -> RunResult; fails the test with the log tail."""
    scratch = tmp_path_factory.mktemp("ple-runs")
    counter = iter(range(10_000))

    def run(overlay, mode, target, *args, timeout=600, background=False):
        out = scratch / f"{mode}-{next(counter)}.{'pt' if mode == 'forward' else 'json'}"
        command = [sys.executable, str(RUNNER), mode, str(target), str(out), *map(str, args)]
        if background:
            return subprocess.Popen(
                command, env=vllm_env(overlay), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            ), out
        proc = subprocess.run(command, env=vllm_env(overlay), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            pytest.fail(f"{' '.join(command)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
        return RunResult(proc, out)

    return run


@pytest.fixture(scope="session")
def run_ple_batch(tmp_path_factory):
    """run_ple_batch(overlay, {name: (mode, target, *args)}) -> Batch: the jobs run in order in
    one ple_runner child (one vLLM import instead of one per job), each with its own log."""
    scratch = tmp_path_factory.mktemp("ple-batches")
    counter = iter(range(10_000))

    def run(overlay, jobs: dict, timeout=900) -> Batch:
        folder = scratch / f"batch-{next(counter)}"
        folder.mkdir()
        argvs = {}
        for name, (mode, target, *args) in jobs.items():
            out = folder / f"{name}.{'pt' if mode in ('forward', 'model_state') else 'json'}"
            argvs[name] = ([mode, str(target), str(out), *map(str, args)], str(folder / f"{name}.log"))
        (folder / "jobs.json").write_text(json.dumps(argvs, indent=1))
        report = folder / "report.json"
        command = [sys.executable, str(RUNNER), "batch", str(folder / "jobs.json"), str(report)]
        proc = subprocess.run(command, env=vllm_env(overlay), capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            pytest.fail(f"{' '.join(command)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
        return Batch(command, argvs, json.loads(report.read_text()))

    return run
