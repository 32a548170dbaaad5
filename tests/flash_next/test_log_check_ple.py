"""log_check.py on the log lines the ple-ssd patches really print.

A Qwen4Exp model cannot be served on this CPU build, so the PLE layer is built and loaded the
way vLLM does it, in a subprocess (tests/ple_ssd/ple_runner.py) with the patched vLLM, and its
output is the log: 0001 alone and 0001 + 0002 print different lines, and the check must
recognise both (the stock vLLM prints neither).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fn_helpers import PYTHON, TESTS, run_tool
from vllm_overlay import make_overlay, vllm_env

pytestmark = pytest.mark.slow

RUNNER = TESTS / "ple_ssd" / "ple_runner.py"


@pytest.fixture(scope="module")
def ple_checkpoint(tmp_path_factory):
    sys.path.insert(0, str(TESTS / "ple_ssd"))
    from checkpoint import build_ple_checkpoint

    return build_ple_checkpoint(tmp_path_factory.mktemp("ple-checkpoint"), ngram_vocab_size_base=2_000)


def ple_log(tmp_path, checkpoint, selectors: list[str]) -> str:
    overlay = make_overlay(tmp_path / "overlay", selectors)
    log = tmp_path / "ple.log"
    with open(log, "w") as out:
        for mode in ("config", "load"):
            args = [PYTHON, str(RUNNER), mode, str(checkpoint), str(tmp_path / f"{mode}.json"), "--ple-mmap"]
            subprocess.run(args, env=vllm_env(overlay), stdout=out, stderr=subprocess.STDOUT, timeout=600, check=True)
    return str(log)


def check(log: str) -> dict:
    proc = run_tool("log_check.py", log, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["features"]["ple_mmap"]


def test_log_check_recognises_ple_mmap_with_rows_gathered_in_the_forward(tmp_path, ple_checkpoint):
    ple = check(ple_log(tmp_path, ple_checkpoint, ["ple-ssd/0001"]))
    assert ple["state"] == "on" and ple["tables"] >= 1
    assert "gathered inside the forward" in ple["rows"]


def test_log_check_recognises_ple_mmap_with_rows_staged_before_the_forward(tmp_path, ple_checkpoint):
    ple = check(ple_log(tmp_path, ple_checkpoint, ["ple-ssd"]))
    assert ple["state"] == "on" and ple["tables"] >= 1
    assert "staged before the forward" in ple["rows"]


def test_log_check_does_not_see_ple_mmap_in_a_stock_log(tmp_path, ple_checkpoint):
    log = tmp_path / "stock.log"
    with open(log, "w") as out:
        subprocess.run(
            [PYTHON, str(RUNNER), "load", str(ple_checkpoint), str(tmp_path / "load.json")],
            env=vllm_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=600,
            check=True,
        )
    assert check(str(log))["state"] == "off"
