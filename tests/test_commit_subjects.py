"""Commit subjects at most 72 characters: tests/commit_subjects.sh over the commits after its base
(tests/lint.sh's `commits` part), HEAD alone in a shallow clone, and the commit-msg hook
(.githooks/commit-msg) refusing a long subject. Real git, in scratch repositories; seconds."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "commit_subjects.sh"
HOOK = REPO / ".githooks" / "commit-msg"
LONG = "Make the subject of this commit long enough to go past the limit of 72 characters"
SHORT = "A short subject"


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """git with no user or system configuration but a name to commit under."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return dict(
        keep,
        GIT_CONFIG_GLOBAL=str(tmp_path / "no-gitconfig"),
        GIT_CONFIG_NOSYSTEM="1",
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@example.invalid",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@example.invalid",
    )


def git(repo: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True)


def commit(repo: Path, env: dict[str, str], message: str) -> subprocess.CompletedProcess:
    (repo / "n").write_text(str(int((repo / "n").read_text()) + 1) if (repo / "n").exists() else "0")
    git(repo, env, "add", "n")
    return git(repo, env, "commit", "-q", "-m", message)


def head(repo: Path, env: dict[str, str]) -> str:
    return git(repo, env, "rev-parse", "HEAD").stdout.strip()


@pytest.fixture
def repo(tmp_path, env) -> Path:
    """A repository holding this script and hook, with a long subject before its base commit."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / ".githooks").mkdir()
    shutil.copy2(SCRIPT, repo / "tests" / "commit_subjects.sh")
    shutil.copy2(HOOK, repo / ".githooks" / "commit-msg")
    assert git(repo, env, "init", "-q", "-b", "main").returncode == 0
    git(repo, env, "add", ".")
    assert commit(repo, env, LONG + " (old history)").returncode == 0
    assert commit(repo, env, "The base").returncode == 0
    return repo


def check(repo: Path, env: dict[str, str], base: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(repo / "tests" / "commit_subjects.sh")],
        env=dict(env, COMMIT_SUBJECTS_BASE=base),
        capture_output=True,
        text=True,
    )


def test_this_repositorys_new_commits_pass():
    proc = subprocess.run(["bash", str(REPO / "tests" / "lint.sh"), "commits"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all at most 72 characters" in proc.stdout


def test_a_long_subject_after_the_base_fails_naming_the_commit_and_the_old_history_passes(repo, env):
    base = head(repo, env)
    assert commit(repo, env, SHORT).returncode == 0
    passed = check(repo, env, base)
    assert passed.returncode == 0, passed.stderr
    assert "1 checked (the commits after" in passed.stdout
    assert commit(repo, env, LONG).returncode == 0
    failed = check(repo, env, base)
    assert failed.returncode == 1
    short_hash = git(repo, env, "rev-parse", "--short", "HEAD").stdout.strip()
    assert f"{short_hash}'s subject is {len(LONG)} characters, at most 72" in failed.stderr
    assert "1 of 2 over 72 characters" in failed.stderr


def test_a_first_paragraph_of_two_lines_counts_as_one_subject_in_characters(repo, env):
    base = head(repo, env)
    assert commit(repo, env, "é" * 40 + "\n" + "ü" * 31).returncode == 0  # 40 + space + 31 = 72
    assert check(repo, env, base).returncode == 0
    assert (
        commit(repo, env, "é" * 40 + "\n" + "ü" * 32 + "\n\nThe body may be as long as it needs " * 9).returncode == 0
    )
    failed = check(repo, env, base)
    assert failed.returncode == 1 and "subject is 73 characters" in failed.stderr


def test_a_shallow_clone_without_the_base_checks_head_only_and_says_so(repo, env, tmp_path):
    base = head(repo, env)
    assert commit(repo, env, LONG).returncode == 0
    assert commit(repo, env, SHORT).returncode == 0
    shallow = tmp_path / "shallow"
    assert git(tmp_path, env, "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow)).returncode == 0
    proc = check(shallow, env, base)
    assert proc.returncode == 0, proc.stderr  # the long subject is not in this clone
    assert "1 checked (HEAD only: the base" in proc.stdout and "shallow clone?" in proc.stdout
    assert commit(shallow, env, LONG).returncode == 0
    assert check(shallow, env, base).returncode == 1


def test_a_plain_copy_of_the_source_has_no_commits_to_check(tmp_path, env):
    copy = tmp_path / "copy" / "tests"
    copy.mkdir(parents=True)
    shutil.copy2(SCRIPT, copy / "commit_subjects.sh")
    proc = check(copy.parent, dict(env, GIT_CEILING_DIRECTORIES=str(tmp_path)), "0" * 40)
    assert proc.returncode == 0 and "not a git checkout with commits; nothing to check" in proc.stdout


def test_the_commit_msg_hook_refuses_a_long_subject_and_keeps_nothing(repo, env):
    assert git(repo, env, "config", "core.hooksPath", ".githooks").returncode == 0
    before = head(repo, env)
    refused = commit(repo, env, LONG + "\n\nWhy, in the body.")
    assert refused.returncode != 0 and head(repo, env) == before
    assert f"commit-msg: the subject is {len(LONG)} characters, at most 72" in refused.stderr
    accepted = commit(repo, env, SHORT + "\n\n" + "A body line may be long; " * 10)
    assert accepted.returncode == 0, accepted.stderr
    assert git(repo, env, "log", "-1", "--format=%s").stdout.strip() == SHORT
