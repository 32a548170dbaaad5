"""magpie/patches.py under concurrent runs, signals and odd --python values, on real trees (copies
of the pristine vLLM sdists) and real processes: two runs on one tree take turns (the lock), a
signal at every step of a change set leaves the tree stock or patched (the journal), an
interpreter that reports no vLLM is refused, a hand edit is named by its file.

The signal tests use the tool's test hook (MAGPIE_PATCHES_TEST_SIGNAL_AFTER="N:SIGNAL": the tool
sends SIGNAL to itself after step N of writing a change set), so every step is hit, not a lucky one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.releases import sdist_tree

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "magpie" / "patches.py"
FIXTURES = REPO / "tests" / "fixtures" / "patches"
PATCHES = REPO / "patches"
HOOK = "MAGPIE_PATCHES_TEST_SIGNAL_AFTER"


def tool_cmd(*args, patches_dir=FIXTURES) -> list[str]:
    return [sys.executable, str(TOOL), *args, "--patches-dir", str(patches_dir)]


def run_tool(*args, patches_dir=FIXTURES, hook=None, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(HOOK, None)
    if hook:
        env[HOOK] = hook
    return subprocess.run(tool_cmd(*args, patches_dir=patches_dir), capture_output=True, text=True, env=env, cwd=cwd)


def copy_tree(release: str, dest: Path) -> Path:
    src = sdist_tree(release)
    shutil.copytree(src / "vllm", dest / "vllm", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(src / "pyproject.toml", dest / "pyproject.toml")
    return dest


def digest(root: Path) -> dict[str, str]:
    """sha256 of every file under root (the journal and side files included), __pycache__ aside."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def leftovers(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in root.rglob(".magpie-patches*")]


@pytest.fixture
def tree(tmp_path) -> Path:
    return copy_tree("0.29.0", tmp_path / "tree")


@pytest.fixture
def states(tmp_path) -> tuple[dict, dict]:
    """(pristine, patched) digests of the 0.29.0 tree under the fixture series."""
    scratch = copy_tree("0.29.0", tmp_path / "scratch")
    pristine = digest(scratch)
    assert run_tool("apply", "--target", str(scratch)).returncode == 0
    return pristine, digest(scratch)


# --------------------------------------------------------------------------- the lock


def test_a_second_run_waits_for_the_first_then_refuses_naming_it(tree, states):
    pristine, patched = states
    env = dict(os.environ, **{HOOK: "1:SIGSTOP"})  # the first run stops itself holding the lock
    first = subprocess.Popen(tool_cmd("apply", "--target", str(tree)), env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while (tree / ".magpie-patches.journal").exists() is False and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tree / ".magpie-patches.journal").exists()
        started = time.monotonic()
        second = run_tool("apply", "--target", str(tree), "--wait", "1.5")
        waited = time.monotonic() - started
        assert second.returncode == 1, second.stdout + second.stderr
        assert 1.5 <= waited < 30
        assert f"is locked by another magpie/patches.py run (pid {first.pid}, `apply` since" in second.stderr
        assert "waited 1.5 s" in second.stderr and "--wait SECONDS" in second.stderr
        assert "nothing was changed" in second.stderr and "Traceback" not in second.stderr
        assert second.stdout == ""
    finally:
        os.kill(first.pid, signal.SIGCONT)
        out, _ = first.communicate(timeout=60)
    assert first.returncode == 0, out
    assert "applied demo/0002-touch-mtp.patch" in out
    assert digest(tree) == patched and not leftovers(tree)


def test_two_applies_started_together_leave_one_patched_tree(tree, states):
    _, patched = states
    procs = [
        subprocess.Popen(tool_cmd("apply", "--target", str(tree)), stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted("applied demo/0001-marker-module.patch" in out for out in outs) == [False, True], outs
    assert any("nothing to apply" in out for out in outs)
    assert digest(tree) == patched and not leftovers(tree)
    proc = run_tool("status", "--json", "--target", str(tree))
    assert {p["state"] for p in json.loads(proc.stdout)["patches"]} == {"applied"}


def test_sigint_while_waiting_for_the_lock_is_one_line_and_changes_nothing(tree):
    pristine = digest(tree)
    env = dict(os.environ, **{HOOK: "1:SIGSTOP"})
    first = subprocess.Popen(tool_cmd("apply", "--target", str(tree)), env=env, stdout=subprocess.PIPE, text=True)
    try:
        while not (tree / ".magpie-patches.journal").exists():
            time.sleep(0.05)
        second = subprocess.Popen(
            tool_cmd("revert", "--target", str(tree), "--wait", "60"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)
        second.send_signal(signal.SIGINT)
        _, err = second.communicate(timeout=30)
        assert second.returncode == 130, err
        assert err.strip().splitlines()[-1] == "error: interrupted by SIGINT; nothing was changed", err
        assert "Traceback" not in err
    finally:
        first.send_signal(signal.SIGKILL)  # killed mid-set: the next run rolls it back
        first.communicate(timeout=30)
    proc = run_tool("status", "--target", str(tree))
    assert proc.returncode == 0, proc.stderr
    assert "its change set was rolled back" in proc.stderr
    assert digest(tree) == pristine


def test_wait_out_of_range_is_a_usage_error(tree):
    proc = run_tool("apply", "--target", str(tree), "--wait", "-1")
    assert proc.returncode == 2 and "--wait -1: give seconds from 0 to 86400" in proc.stderr


# --------------------------------------------------------------------------- a signal at every step


def _every_step(command: str, tree: Path, sig: str, start: dict, end: dict) -> int:
    """Run `command` with the hook at step 1, 2, ... until it runs through; check each outcome."""
    step = 0
    while True:
        step += 1
        assert digest(tree) == start, f"step {step}: the tree is not as the run starts it"
        proc = run_tool(command, "--target", str(tree), hook=f"{step}:{sig}")
        assert "Traceback" not in proc.stderr, proc.stderr
        if f"test hook: {sig} after step {step} " not in proc.stderr:
            assert proc.returncode == 0, proc.stderr
            assert digest(tree) == end and not leftovers(tree)
            return step - 1
        if sig == "SIGKILL":
            assert proc.returncode == -signal.SIGKILL
            # Killed before its last step, the journal stays; the next run, whatever it is,
            # settles the interrupted set before it does anything.
            journal = (tree / ".magpie-patches.journal").exists()
            settle = run_tool("status", "--json", "--target", str(tree))
            assert ("was interrupted while it changed" in settle.stderr) == journal, settle.stderr
            after = digest(tree)
            assert after in (start, end), f"step {step}: the recovered tree is neither as before nor as after"
            assert not leftovers(tree)
            expected = "applied" if (after == end) == (command == "apply") else "not applied"
            assert {p["state"] for p in json.loads(settle.stdout)["patches"]} == {expected}
            if after == end:  # finished: undo it to try the next step from the same start
                back = run_tool("revert" if command == "apply" else "apply", "--target", str(tree))
                assert back.returncode == 0, back.stderr
        else:
            # A held signal: the set is written to the end, then the run stops, saying so.
            assert proc.returncode == 128 + getattr(signal, sig), proc.stderr
            assert f"error: {sig} arrived while the files were being written; the change set was finished" in (
                proc.stderr
            )
            assert digest(tree) == end and not leftovers(tree)
            back = run_tool("revert" if command == "apply" else "apply", "--target", str(tree))
            assert back.returncode == 0, back.stderr
        assert digest(tree) == start


@pytest.mark.parametrize(
    "sig, commands",
    # SIGTERM is held as SIGINT is (one mechanism): its revert pass would repeat SIGINT's.
    [("SIGINT", ("apply", "revert")), ("SIGTERM", ("apply",)), ("SIGKILL", ("apply", "revert"))],
)
def test_apply_and_revert_are_whole_or_nothing_at_every_step(tree, states, sig, commands):
    pristine, patched = states
    steps = _every_step("apply", tree, sig, pristine, patched)
    assert steps >= 10  # journal, 3 new texts, 2 kept aside, the renames, the clean-up
    if "revert" in commands:
        assert run_tool("apply", "--target", str(tree)).returncode == 0
        assert _every_step("revert", tree, sig, patched, pristine) >= 10


def test_a_recovery_killed_at_each_of_its_own_steps_is_taken_up_again(tree, states):
    pristine, _ = states
    # Killed after the journal says "committing" and one file was replaced: a half-patched tree.
    proc = run_tool("apply", "--target", str(tree), hook="8:SIGKILL")
    assert "test hook: SIGKILL after step 8 (vllm/config/speculative.py replaced)" in proc.stderr, proc.stderr
    assert digest(tree) != pristine
    step = 0
    while True:
        step += 1
        proc = run_tool("status", "--target", str(tree), hook=f"{step}:SIGKILL")
        if "test hook" not in proc.stderr:
            break
        assert proc.returncode == -signal.SIGKILL
    assert step > 4  # each file restored, then the journal removed
    assert digest(tree) == pristine and not leftovers(tree)


# --------------------------------------------------------------------------- targets and messages


def test_python_that_reports_no_vllm_is_refused_not_taken_as_the_current_folder(tree):
    before = digest(tree)
    for python in ("/bin/true", "/bin/echo"):
        proc = run_tool("apply", "--python", python, cwd=tree / "vllm")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"error: --python {python}: it did not report an installed vllm package" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert digest(tree) == before


def test_revert_over_a_hand_edit_names_the_edited_file(tmp_path):
    tree = copy_tree("0.33.0", tmp_path / "tree")
    assert run_tool("apply", "--target", str(tree), patches_dir=PATCHES).returncode == 0
    edited = tree / "vllm/v1/spec_decode/llm_base_proposer.py"
    text = edited.read_text()
    line = '                "Keeping it; not sharing the target model lm_head."\n'
    assert line in text  # a line mtp_pruning/0001 adds
    edited.write_text(text.replace(line, '                "Keeping it (edited by hand)."\n'))
    before = digest(tree)
    proc = run_tool("revert", "--target", str(tree), patches_dir=PATCHES)
    assert proc.returncode == 1
    assert (
        "mtp_pruning/0001-draft-vocab-pruning.patch is conflicting "
        "(vllm/v1/spec_decode/llm_base_proposer.py hunk 1 (" in proc.stderr
    ), proc.stderr
    assert "vllm/config/speculative.py" not in proc.stderr
    status = run_tool("status", "--target", str(tree), patches_dir=PATCHES)
    assert status.returncode == 3
    assert "llm_base_proposer.py hunk 1" in status.stdout and "edited since it was applied" in status.stdout
    assert digest(tree) == before
