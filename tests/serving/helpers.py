"""Helpers for the Flash-Next tool tests: paths, running a tool, a real server launched by serve.sh."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
PACKAGE = REPO / "magpie"  # `python3 PACKAGE TOOL` runs a tool as users do
TOOLS = PACKAGE / "serving"  # serve.sh, profiles/
MEASURE = PACKAGE / "measure"  # run_suite.sh, schemas/

from magpie.demo.demo_overlay import vllm_env  # noqa: E402
from magpie.serving.process import ServeShServer  # noqa: E402

PYTHON = sys.executable  # the test venv's interpreter, which has the CPU build of vLLM


def tool(name: str) -> list[str]:
    """The command of magpie's tool NAME (e.g. "memguard"), as a user runs it from any folder."""
    return [PYTHON, str(PACKAGE), name]


def run_tool(name: str, *args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """Run magpie's tool NAME (e.g. "log-check") the way a user does, in a subprocess."""
    return subprocess.run([*tool(name), *args], capture_output=True, text=True, timeout=timeout, check=False, **kwargs)


class ServeSh(ServeShServer):
    """serve.sh LOG [args] with the test venv's vLLM, the tiny model and `settings` (serve.sh
    variables), on a free port; the lifecycle is the product's (magpie.serving.process)."""

    def __init__(self, log_path: Path, model: Path, overlay: Path | None, settings: dict[str, str], extra_args=()):
        env = vllm_env(overlay, MODEL=str(model), VLLM_PYTHON=PYTHON, MAX_MODEL_LEN="2048", PLE="0", **settings)
        super().__init__(log_path, env, list(extra_args))


def counter_samples(page: str, name: str) -> dict[str, float]:
    """The test's own reader of a Prometheus page, independent of magpie.serving.metrics (the
    product's, which the tests check against it): every sample line of `name`, by the labels
    text as the server wrote it."""
    found = {}
    for line in page.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        labels = series[len(name) :]
        if labels == "" or labels.startswith("{"):  # not another metric whose name starts alike
            found[labels] = float(value)
    return found
