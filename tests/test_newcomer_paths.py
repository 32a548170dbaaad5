"""The commands a newcomer types from the docs, run literally: the patch tool by path (its run
bit, in git and on disk), the package's entry point without a tool, a tool's help with a
continued example, output piped into a reader that stops early, and a keep-set tool run by a
Python that lacks its modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_the_patch_tool_runs_by_path_as_the_docs_write_it():
    mode = subprocess.run(
        ["git", "ls-files", "-s", "magpie/patches.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()[0]
    assert mode == "100755"  # what a clone checks out
    proc = subprocess.run("magpie/patches.py list", shell=True, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "series patches/vllm-0.29.0/series" in proc.stdout


def test_the_patch_tools_usage_names_how_it_was_run():
    by_entry = subprocess.run([sys.executable, "magpie", "patches", "--help"], cwd=REPO, capture_output=True, text=True)
    assert by_entry.returncode == 0 and by_entry.stdout.startswith("usage: magpie patches "), by_entry.stdout[:80]
    by_path = subprocess.run(["magpie/patches.py", "--help"], cwd=REPO, capture_output=True, text=True)
    assert by_path.returncode == 0 and by_path.stdout.startswith("usage: patches.py "), by_path.stdout[:80]


@pytest.mark.parametrize("command", [["magpie", "patches", "list"], ["magpie/patches.py", "list"], ["magpie"]])
def test_output_into_a_closed_pipe_ends_quietly_with_the_sigpipe_status(command):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (`| head`) is already gone: the first write fails
    try:
        proc = subprocess.run([sys.executable, *command], cwd=REPO, stdout=write_end, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)
    assert proc.returncode == 141
    assert proc.stderr == ""


@pytest.mark.parametrize(
    "tool, continued",
    [
        ("memguard", "--output server.log --log server.log \\\n        --server-log server.log --watchdog restart"),
        (
            "gpu-harness",
            "stage .gpu-harness/c \\\n         && python3 magpie gpu-harness run --suite mtp --budget 540   # there",
        ),
    ],
)
def test_help_keeps_an_example_continued_over_lines(tool, continued):
    proc = subprocess.run([sys.executable, "magpie", tool, "--help"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert continued in proc.stdout


def test_the_help_formatter_leaves_tables_and_aligned_comments_alone():
    from magpie import cli

    doc = (
        "Do it.\n\n"
        "    python3 magpie x --a 1 \\\n        --b 2\n"
        "    python3 magpie report --summary results/cpu-mtp          # one screen\n"
        "  list      print the configurations\n"
        '                 "some avg10" at or over --warn-psi-some                 -> warning\n'
    )
    text = cli.parser("magpie x", doc).format_help()
    assert "    python3 magpie x --a 1 \\\n        --b 2\n" in text
    assert "    python3 magpie report --summary results/cpu-mtp          # one screen\n" in text
    assert "  list      print the configurations\n" in text
    assert '"some avg10" at or over --warn-psi-some                 -> warning\n' in text


@pytest.mark.parametrize(
    "tool, args",
    [
        ("build-keepset", ["counts.npy", "--model", "m", "-o", "keep.npy"]),
        ("count-tokens", ["--vocab-size", "8", "--tokenizer", "t", "-o", "counts.npy", "in.jsonl"]),
        ("fit-keepset", ["results", "--model", "m", "-o", "keep.npy"]),
    ],
)
def test_a_keepset_tool_under_a_python_without_numpy_names_the_interpreter_to_use(tmp_path, tool, args):
    # -S: no site-packages, as the system's python3 without the vLLM environment.
    proc = subprocess.run(
        [sys.executable, "-S", str(REPO / "magpie"), tool, *args], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "ModuleNotFoundError" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"this Python ({sys.executable}) has no numpy" in lines[0]
    assert f".venv/bin/python magpie {tool}" in lines[0]
    assert not list(tmp_path.iterdir())
