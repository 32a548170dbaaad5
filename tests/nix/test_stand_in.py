"""The nixpkgs stand-in refuses what nixpkgs refuses (tests/nix/nixpkgs-stand-in/default.nix, each
rule read from nixpkgs' sources), and the flake's outputs pass those rules: its shell
applications pass the checkPhase nixpkgs runs on them, its one unfree package is let through by
its own predicate only, and the ShellCheck check takes any version from CI's up."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.nix.nixeval import NixError, nix_eval, shellcheck
from tests.nix.test_flake_outputs import STAND_IN, flake_eval

PKGS = 'let pkgs = import (/. + standIn) { system = "x86_64-linux"; config = { }; }; in '


def stand_in(body: str):
    return nix_eval(PKGS + body, standIn=str(STAND_IN))


def test_run_command_has_no_c_compiler_and_run_command_cc_has_one():
    got = stand_in(
        '{ plain = (pkgs.runCommand "a" { } "").stdenv.cc == null; '
        'cc = (pkgs.runCommandCC "b" { } "").stdenv.cc.name; '
        'path = map (p: p.name) (pkgs.runCommand "c" { } "").stdenv.initialPath; }'
    )
    assert got["plain"] is True and got["cc"] == "gcc-wrapper"
    assert {"coreutils", "gnused", "bash", "patch", "patchelf"} <= set(got["path"]) and "gcc" not in got["path"]


@pytest.mark.parametrize(
    "call",
    [
        'pkgs.fetchurl { url = "https://x.invalid/a"; hash = "sha256-AAAA"; sha256name = "a"; }',
        'pkgs.writeShellApplication { name = "a"; text = ""; runtimeInput = [ ]; }',
        'pkgs.writeTextFile { name = "a"; text = ""; mode = "0755"; }',
    ],
)
def test_closed_argument_sets_refuse_an_unknown_argument(call):
    with pytest.raises(NixError, match="called with unexpected argument"):
        stand_in(f"({call}).drvPath")


def test_fetchurl_needs_a_hash_and_an_address():
    with pytest.raises(NixError, match="fetchurl requires a hash"):
        stand_in('(pkgs.fetchurl { url = "https://x.invalid/a"; }).drvPath')
    with pytest.raises(NixError, match="fetchurl requires either `url` or `urls`"):
        stand_in('(pkgs.fetchurl { hash = "sha256-47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU="; }).drvPath')


def test_derivation_attributes_are_coerced_by_nix():
    """builtins.derivation: a set where a string is needed is refused, as in nixpkgs."""
    with pytest.raises(NixError, match="cannot coerce a set to a string"):
        stand_in('(pkgs.stdenv.mkDerivation { name = "a"; env = { A = "1"; }; }).drvPath')
    got = stand_in('let d = pkgs.runCommand "a" { flags = [ "x" 1 true ]; } "touch $out"; in d.drvPath')
    assert got.startswith("/nix/store/") and got.endswith("-a.drv")


def test_an_unfree_package_is_refused_unless_config_allows_it():
    drv = (
        'pkgs.stdenv.mkDerivation { pname = "blob"; version = "1"; '
        "meta.license = [ pkgs.lib.licenses.unfreeRedistributable ]; }"
    )
    with pytest.raises(NixError, match="Package ‘blob-1’ in the nixpkgs stand-in has an unfree license"):
        stand_in(f"({drv}).outPath")
    allowed = (
        'let pkgs = import (/. + standIn) { system = "x86_64-linux"; '
        'config.allowUnfreePredicate = p: p.pname == "blob"; }; in '
    )
    assert nix_eval(allowed + f"({drv}).outPath", standIn=str(STAND_IN)).endswith("-blob-1")


def test_the_flake_lets_through_only_its_unfree_wheel_closure():
    assert flake_eval('(scope "x86_64-linux").wheelClosure.outPath').endswith("-vllm-wheel-closure-0.29.0")
    without = (
        'let pkgs = import (/. + standIn) { system = "x86_64-linux"; '
        'overlays = [ (import (repo + "/nix/overlay.nix")) ]; }; '
        "in pkgs.magpie-vllm-plugins.wheelClosure.outPath"
    )
    with pytest.raises(
        NixError, match="vllm-wheel-closure-0.29.0.*has an unfree license \\(‘unfreeRedistributable’\\)"
    ):
        nix_eval(without, standIn=str(STAND_IN))


def test_write_shell_application_writes_nixpkgs_header():
    got = stand_in(
        'let a = pkgs.writeShellApplication { name = "hi"; text = "echo hi"; runtimeInputs = [ pkgs.gnused ]; '
        "inheritPath = false; }; in { inherit (a) text checkPhase destination; inherit (a.meta) mainProgram; "
        "bash = toString pkgs.bash; sed = toString pkgs.gnused; }"
    )
    assert got["text"] == (
        f"#!{got['bash']}/bin/bash\nset -o errexit\nset -o nounset\nset -o pipefail\n\n"
        f'export PATH="{got["sed"]}/bin"\n\necho hi\n'
    )
    assert got["destination"] == "/bin/hi" and got["mainProgram"] == "hi"
    assert '-n -O extglob "$target"' in got["checkPhase"] and "-shellcheck-minimal/bin/shellcheck" in got["checkPhase"]


def flake_shell_applications() -> dict:
    return flake_eval(
        'let s = scope "x86_64-linux"; in builtins.mapAttrs (_: a: a.text) '
        "(builtins.foldl' (all: r: all // r.apps) s.apps (builtins.attrValues s.releases) "
        "// { nvidia-driver-libs = s.nvidiaDriverLibs; })"
    )


def test_every_shell_application_of_the_flake_passes_nixpkgs_check_phase(tmp_path):
    """What writeShellApplication's checkPhase runs on $target: bash -n -O extglob, then ShellCheck."""
    texts = flake_shell_applications()
    assert "nvidia-driver-libs" in texts and "serve-flash-next" in texts
    for name, text in texts.items():
        target = tmp_path / name
        target.write_text(text)
        dry = subprocess.run(["bash", "-n", "-O", "extglob", str(target)], capture_output=True, text=True)
        assert dry.returncode == 0, f"{name}: {dry.stderr}"
        lint = subprocess.run([shellcheck(), str(target)], capture_output=True, text=True)
        assert lint.returncode == 0, f"{name}: {lint.stdout}"


def shellcheck_version_check() -> str:
    command = flake_eval('self.checks."x86_64-linux".shellcheck.buildCommand')
    return command.split("cd ", 1)[0]


@pytest.mark.parametrize(
    ("seen", "passes"), [("0.11.0", True), ("0.12.0", True), ("0.10.0", True), ("0.9.0", False), ("0.10", False)]
)
def test_shellcheck_check_takes_any_release_from_the_oldest_the_scripts_pass_with(tmp_path, seen, passes):
    """Issue 27: the pinned nixpkgs may carry ShellCheck 0.10.0 (CI pins 0.11.0); the scripts and
    the wrappers lint clean with 0.10.0, so the check holds with it and refuses older ones."""
    fake = tmp_path / "bin" / "shellcheck"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho 'ShellCheck - shell script analysis tool'\necho 'version: {seen}'\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", shellcheck_version_check()], capture_output=True, text=True, env=env
    )
    assert (out.returncode == 0) == passes, out.stderr
    if not passes:
        assert f"ShellCheck {seen} here, older than 0.10.0, the oldest" in out.stderr and "CI runs 0.11.0" in out.stderr
