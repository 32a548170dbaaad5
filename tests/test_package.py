"""The tools package as users get it: its entry point from any folder, and the checkout really
installed (`pip install`, no network) giving one console script per tool of magpie/tools.json and
the patch series, which the installed patch tool finds from any folder."""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from magpie import TOOLS, releases

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_tool_list_lives_only_in_tools_json():
    """pyproject.toml lists no script of its own: setup.py derives them (`scripts` is dynamic)."""
    assert "scripts" not in PYPROJECT["project"] and "scripts" in PYPROJECT["project"]["dynamic"]
    assert not re.search(r"^magpie-[\w-]+ *=", (REPO / "pyproject.toml").read_text(), re.M)


def test_requires_python_is_the_oldest_python_the_tools_run_on():
    """Tools use datetime.UTC (Python 3.11): the floor pyproject.toml declares must allow it."""
    users = [p for p in (REPO / "magpie").rglob("*.py") if "datetime.UTC" in p.read_text()]
    assert users, "no tool uses datetime.UTC any more: the floor may be lower"
    floor = re.fullmatch(r">=(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"])
    assert floor and (int(floor[1]), int(floor[2])) >= (3, 11), PYPROJECT["project"]["requires-python"]


def test_the_series_folders_are_the_releases_with_a_series():
    folders = sorted(p.parent.name for p in (REPO / "patches").glob("vllm-*/series"))
    assert folders == [f"vllm-{r}" for r in releases.series_releases()]


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


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The checkout's tracked build inputs, copied (setuptools writes build/ and *.egg-info beside
    the sources), then `pip install --target` from them: no index, no build isolation."""
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in"):
        shutil.copy(REPO / name, source)
    for folder in ("magpie", "patches"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
        + ["--target", str(target), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def _run_script(installed: Path, name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, str(installed / "bin" / name), *args], env=env, cwd=cwd, capture_output=True, text=True
    )


def test_the_console_scripts_are_the_tools_of_tools_json(installed):
    (dist_info,) = installed.glob("magpie_vllm_plugins-*.dist-info")
    entry_points = configparser.ConfigParser()
    entry_points.read(dist_info / "entry_points.txt")
    scripts = dict(entry_points["console_scripts"])
    tools = json.loads((REPO / "magpie" / "tools.json").read_text())["tools"]
    # each runs its tool under magpie.cli.run_tool (one-line errors), as `python3 magpie TOOL` does
    assert scripts == {f"magpie-{name}": f"magpie.__main__:console_{name.replace('-', '_')}" for name in tools}
    assert sorted(p.name for p in (installed / "bin").iterdir()) == sorted(scripts)


def test_the_data_files_travel_with_the_package(installed, tmp_path):
    package = installed / "magpie"
    # The files the tools read beside their code.
    for data in ("serving/serve.sh", "serving/profiles/seed-gb10.yaml", "measure/run_suite.sh", "tools.json"):
        assert (package / data).is_file(), data
    assert list((package / "measure" / "schemas").glob("*.schema.json"))
    assert not list(package.rglob("*before-issue-14*")), "the bench's old baseline is no package data"
    run = _run_script(installed, "magpie-memguard", "--help", cwd=tmp_path)
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr
    sibling = _run_script(installed, "magpie-bench-decode", "--help", cwd=tmp_path)  # imports magpie.serving.client
    assert sibling.returncode == 0 and "usage:" in sibling.stdout, sibling.stderr


def test_the_series_ship_with_the_package_byte_for_byte(installed):
    shipped = installed / "magpie" / "patch_series"
    checkout = {p.relative_to(REPO / "patches"): p.read_bytes() for p in (REPO / "patches").rglob("*") if p.is_file()}
    assert {p.relative_to(shipped): p.read_bytes() for p in shipped.rglob("*") if p.is_file()} == checkout
    assert sorted(p.parent.name for p in shipped.glob("vllm-*/series")) == [
        f"vllm-{r}" for r in releases.series_releases()
    ]


def test_the_installed_patch_tool_lists_the_series_from_another_folder(installed, tmp_path):
    listed = _run_script(installed, "magpie-patches", "list", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    for release in releases.series_releases():
        assert f"magpie/patch_series/vllm-{release}/series" in listed.stdout, listed.stdout
    assert "ple_ssd/0001-ple-mmap-table.patch" in listed.stdout


def test_the_installed_patch_tool_reports_the_states_of_a_real_vllm(installed, tmp_path):
    """`status --python` of the test venv (stock vLLM 0.29.0) from a folder outside the checkout."""
    proc = _run_script(installed, "magpie-patches", "status", "--json", "--python", sys.executable, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert Path(record["series"]).parent == installed / "magpie" / "patch_series", record["series"]
    series = (Path(record["series"]) / "series").read_text()
    assert [p["name"] for p in record["patches"]] == [
        line for line in series.splitlines() if line and not line.startswith("#")
    ]
    assert {p["state"] for p in record["patches"]} == {"not applied"}
