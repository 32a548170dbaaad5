"""serve.sh's refusals: each before it would launch vLLM, writing nothing.

No vLLM server is started here: serve.sh must refuse before it would launch one.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.serving.helpers import PYTHON, REPO

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
