"""log_check.py on the log lines the ple_ssd patches really print.

A Qwen4Exp model cannot be served on this CPU build, so the PLE layer is built and loaded the
way vLLM does it, in a subprocess (tests/ple_ssd/ple_runner.py) with the patched vLLM, and its
output is the log: 0001 alone and 0001 + 0002 print different lines, and the check must
recognise both (the stock vLLM prints neither). The lines log_check looks for are the patches'
`Proof-Log:` header lines: each one is checked here against what the patched layer prints.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from magpie import patches
from magpie.demo.demo_overlay import make_overlay, vllm_env
from tests.serving.helpers import PYTHON, TESTS, run_tool

pytestmark = pytest.mark.slow

RUNNER = TESTS / "ple_ssd" / "ple_runner.py"


@pytest.fixture(scope="module")
def ple_checkpoint(tmp_path_factory):
    from tests.ple_ssd.checkpoint import build_ple_checkpoint

    return build_ple_checkpoint(tmp_path_factory.mktemp("ple-checkpoint"), ngram_vocab_size_base=2_000)


def run_layer(tmp_path, checkpoint, overlay, *flags: str, mode: str = "forward") -> str:
    """Build, load and run the PLE layer (the ple_ssd tests' runner); its output is the log."""
    log = tmp_path / f"ple-{mode}.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            [PYTHON, str(RUNNER), mode, str(checkpoint), str(tmp_path / f"{mode}.out"), *flags],
            env=vllm_env(overlay),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=600,
        )
    assert proc.returncode == 0, f"{RUNNER.name} {mode} failed (its interface changed?):\n{log.read_text()[-3000:]}"
    return str(log)


STOCK = None  # no overlay: the pristine vLLM of the test venv


@pytest.fixture(scope="module")
def layer_log(tmp_path_factory, ple_checkpoint):
    """layer_log(selectors, mode, *flags): the log of one runner run of the PLE layer under an
    overlay with those patches applied (STOCK: the pristine venv), made once for the module. A
    run starts a fresh Python that imports vLLM (about 16 s on two cores); the tests read the
    same runs (e.g. 0001's `forward --ple-mmap` is both a log for the check and a source of its
    Proof-Log lines), and every run is still its own process with its own log file."""
    folder = tmp_path_factory.mktemp("ple-runs")
    overlays: dict[tuple[str, ...], Path] = {}
    logs: dict[tuple, str] = {}

    def layer_log(selectors: list[str] | None, mode: str, *flags: str) -> str:
        key = (None if selectors is STOCK else tuple(selectors), mode, flags)
        if key not in logs:
            overlay = None
            if key[0] is not None:
                if key[0] not in overlays:
                    overlays[key[0]] = make_overlay(folder / f"overlay{len(overlays)}", list(key[0]))
                overlay = overlays[key[0]]
            run = folder / f"run{len(logs)}"
            run.mkdir()
            logs[key] = run_layer(run, ple_checkpoint, overlay, *flags, mode=mode)
        return logs[key]

    return layer_log


def check(log: str) -> dict:
    proc = run_tool("log-check", log, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["features"]["ple_mmap"]


def test_log_check_recognises_ple_mmap_with_rows_gathered_in_the_forward(layer_log):
    ple = check(layer_log(["ple_ssd/0001"], "forward", "--ple-mmap"))
    assert ple["state"] == "on" and ple["tables"] >= 1
    assert "gathered inside the forward" in ple["rows"]


def test_log_check_recognises_ple_mmap_with_rows_staged_before_the_forward(layer_log):
    ple = check(layer_log(["ple_ssd"], "forward", "--ple-mmap", "--stage"))
    assert ple["state"] == "on" and ple["tables"] >= 1
    assert "staged before the forward" in ple["rows"]


def test_log_check_does_not_see_ple_mmap_in_a_stock_log(layer_log):
    assert check(layer_log(STOCK, "forward"))["state"] == "off"


@pytest.mark.parametrize(
    "patch, selectors, modes",
    [
        ("ple_ssd/0001-ple-mmap-table.patch", ["ple_ssd/0001"], {"config": [], "forward": []}),
        (
            "ple_ssd/0002-stage-rows-before-forward.patch",
            ["ple_ssd"],
            {"config": [], "forward": ["--stage"], "model_state": None},
        ),
    ],
)
def test_every_proof_log_line_of_a_ple_ssd_patch_is_printed_by_it(layer_log, patch, selectors, modes):
    """The config hook (config), the table load (forward) and, for 0002, the model state: every
    `Proof-Log:` line of the patch matches a line the patched vLLM printed; the other patch's
    table line does not (the two are told apart)."""
    series = {p.name: p for p in patches.load_series(str(patches.PATCHES_DIR) + "/vllm-0.29.0")}
    lines = []
    for mode, extra in modes.items():  # None: the mode sets ple_mmap itself
        flags = [] if extra is None else ["--ple-mmap", *extra]
        with open(layer_log(selectors, mode, *flags)) as log:
            lines += log.read().splitlines()
    for proof in series[patch].proof_logs:
        assert any(proof.regex.search(line) for line in lines), f"{patch}: no line matches Proof-Log {proof.name}"
    other = next(name for name in series if name.startswith("ple_ssd/") and name != patch)
    table = next(p for p in series[other].proof_logs if p.name == "ple_active")
    assert not any(table.regex.search(line) for line in lines), re.escape(table.regex.pattern)
