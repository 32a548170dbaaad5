"""The real nixfmt over every tracked .nix file, as tests/lint.sh's `nix` part runs it (CI and the
flake's checks.formatting), and what that part does when no nixfmt is there."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.nix.nixeval import REPO
from tests.nix.test_nix_lib import tracked

LINT = REPO / "tests" / "lint.sh"
# nixfmt 1.4.0, built for this machine kind and kept beside the checkout (it is on no registry
# these machines reach); nixpkgs' nixfmt 1.2.0-1.4.0 format this project's files identically.
BESIDE = REPO.parent / "shared" / "tools" / "nixfmt" / "nixfmt"


def nixfmt() -> str:
    chosen = os.environ.get("NIXFMT") or (str(BESIDE) if BESIDE.exists() else None)
    if chosen is None:
        pytest.skip(f"no nixfmt: {BESIDE} is absent and NIXFMT is unset (the checkout has no ../shared)")
    return chosen


def test_every_tracked_nix_file_is_formatted_by_nixfmt():
    files = tracked("*.nix")
    assert {"flake.nix", "nix/checks.nix", "nix/lib.nix", "tests/nix/nixpkgs-stand-in/default.nix"} <= set(files)
    out = subprocess.run([nixfmt(), "--check", *files], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_lint_nix_part_runs_nixfmt_and_fails_on_an_unformatted_file(tmp_path):
    """tests/lint.sh nix on a copy holding one file laid out as the old home-made rules wanted it
    (a wrap nixfmt joins back into one line, nix/checks.nix before this change)."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    shutil.copy(LINT, repo / "tests" / "lint.sh")
    (repo / "a.nix").write_text(
        "{\n  sdist =\n"
        '    vllmSdists.${version} or (throw "checks.nix: no sdist of vLLM ${version} in vllmSdists");\n}\n'
    )
    env = {**os.environ, "NIXFMT": nixfmt()}
    out = subprocess.run(["bash", "tests/lint.sh", "nix"], cwd=repo, capture_output=True, text=True, env=env)
    assert out.returncode != 0
    assert "a.nix: not formatted" in out.stderr
    subprocess.run([nixfmt(), str(repo / "a.nix")], check=True)
    out = subprocess.run(["bash", "tests/lint.sh", "nix"], cwd=repo, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "--check over 1 Nix files" in out.stdout


def test_lint_nix_part_says_it_skipped_when_no_nixfmt_is_beside_the_checkout(tmp_path):
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    shutil.copy(LINT, repo / "tests" / "lint.sh")
    (repo / "a.nix").write_text("{ a = [ 1 2 ]; }\n")  # not nixfmt's layout: nothing checks it
    env = {k: v for k, v in os.environ.items() if k != "NIXFMT"}
    out = subprocess.run(["bash", "tests/lint.sh", "nix"], cwd=repo, capture_output=True, text=True, env=env)
    assert out.returncode == 0
    assert f"lint: SKIPPED nixfmt: no {tmp_path}/repo/../shared/tools/nixfmt/nixfmt" in out.stderr
    assert "the .nix files were not format-checked" in out.stderr


def test_lint_nix_part_refuses_a_named_nixfmt_that_is_not_there(tmp_path):
    env = {**os.environ, "NIXFMT": str(tmp_path / "no-nixfmt")}
    out = subprocess.run(["bash", str(LINT), "nix"], capture_output=True, text=True, env=env)
    assert out.returncode == 2
    assert f"lint: NIXFMT={tmp_path}/no-nixfmt is not an executable nixfmt" in out.stderr
