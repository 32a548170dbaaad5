"""The tools package as users get it: its entry point from any folder, and `pip install` of the
checkout giving one console script per tool (the list in magpie.TOOLS and pyproject.toml agree)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from magpie import TOOLS

REPO = Path(__file__).resolve().parent.parent


def test_console_scripts_are_the_tools_of_the_entry_point():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {f"magpie-{name}": f"{module}:main" for name, module in TOOLS.items()}


def test_the_entry_point_runs_a_tool_from_any_folder_and_names_the_tools(tmp_path):
    listed = subprocess.run([sys.executable, str(REPO / "magpie")], cwd=tmp_path, capture_output=True, text=True)
    assert listed.returncode == 0 and all(name in listed.stdout for name in TOOLS)  # listing is no failure
    unknown = subprocess.run(
        [sys.executable, str(REPO / "magpie"), "nope"], cwd=tmp_path, capture_output=True, text=True
    )
    assert unknown.returncode == 2 and "no tool 'nope'" in unknown.stderr and "bench-decode" in unknown.stderr
    # A tool that imports a sibling module of the package (bench_decode -> magpie.serving.client).
    helped = subprocess.run(
        [sys.executable, str(REPO / "magpie"), "bench-decode", "--help"], cwd=tmp_path, capture_output=True, text=True
    )
    assert helped.returncode == 0 and "usage:" in helped.stdout


def test_pip_install_gives_working_console_scripts_with_the_data_files(tmp_path):
    # From a copy: setuptools writes build/ and *.egg-info beside the sources it builds.
    source = tmp_path / "src"
    source.mkdir()
    shutil.copy(REPO / "pyproject.toml", source)
    shutil.copytree(REPO / "magpie", source / "magpie", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
        + ["--target", str(target), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in TOOLS:
        assert (target / "bin" / f"magpie-{name}").exists(), name
    installed = target / "magpie"
    # The files the tools read beside their code travel with the package.
    for data in ("serving/serve.sh", "serving/profiles/seed-gb10.yaml", "measure/run_suite.sh"):
        assert (installed / data).is_file(), data
    assert list((installed / "measure" / "schemas").glob("*.schema.json"))
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, str(target / "bin" / "magpie-memguard"), "--help"], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr
    sibling = subprocess.run(  # imports magpie.serving.client from the installed package
        [sys.executable, str(target / "bin" / "magpie-bench-decode"), "--help"], env=env, capture_output=True, text=True
    )
    assert sibling.returncode == 0 and "usage:" in sibling.stdout, sibling.stderr
