"""The overlay fixture the optimization tests run patched vLLM through (magpie/demo/demo_overlay.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from magpie.demo.demo_overlay import make_overlay, vllm_env

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "patches"
PROBE = (
    "import dataclasses, vllm, vllm.config.speculative as s, vllm.magpie_fixture as m;"
    "print(vllm.__file__); print(m.MARKER);"
    "print('magpie_fixture_marker' in {f.name for f in dataclasses.fields(s.SpeculativeConfig)})"
)


def test_overlay_runs_patched_vllm_in_a_subprocess_and_leaves_the_venv_stock(tmp_path):
    overlay = make_overlay(tmp_path / "overlay", ["demo"], patches_dir=FIXTURES)
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=vllm_env(overlay))
    assert proc.returncode == 0, proc.stderr[-3000:]
    vllm_file, marker, has_field = proc.stdout.split()[-3:]
    assert vllm_file.startswith(str(overlay))
    assert marker == "demo-0002" and has_field == "True"
    # Without the overlay the same interpreter imports the stock package.
    stock = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=vllm_env())
    assert stock.returncode != 0 and "No module named 'vllm.magpie_fixture'" in stock.stderr
