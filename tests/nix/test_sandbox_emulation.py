"""checks.tests as a Nix build sandbox runs it, emulated here: its own build command (read from the
flake, evaluated with the stand-in), on a read-only copy of exactly its source, with PATH holding
only the programs of the check's inputs and of its stdenv (stdenvNoCC's tools; a C compiler only
for runCommandCC), and no /usr/bin/env.

How: each nixpkgs input the check names maps to the Debian package(s) with the same programs
(DEBIAN below; the Python environment is the test venv's interpreter, ShellCheck the venv's
pinned one), and their programs are linked into one folder, the build's only PATH. The build
runs in a private mount namespace (unshare) where /usr/bin, /usr/sbin and /usr/local/bin are
empty tmpfs folders into which only those programs are bind-mounted back: /usr/bin/env, and any
absolute path to a program the check does not list, is absent there as in the sandbox, which
has /bin/sh and the store only. What is not emulated: nixpkgs' own builds of these programs
(Debian's here: nix-instantiate 2.8, gcc 12, mawk for gawk), network isolation, the build user.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.nix.nixeval import REPO, shellcheck
from tests.nix.test_flake_outputs import flake_eval

SYSTEM = {"x86_64": "x86_64-linux", "aarch64": "aarch64-linux"}.get(platform.machine(), "x86_64-linux")
# nixpkgs package (its name) -> (Debian packages with its programs, programs found on this PATH).
DEBIAN = {
    "coreutils": (["coreutils"], []),
    "findutils": (["findutils"], []),
    "diffutils": (["diffutils"], []),
    "gnused": (["sed"], []),
    "gnugrep": (["grep"], []),
    "gawk": (["gawk"], ["awk"]),
    "gnutar": (["tar"], []),
    "gzip": (["gzip"], []),
    "bzip2": (["bzip2"], []),
    "gnumake": (["make"], []),
    "bash": (["bash"], []),
    "patch": (["patch"], []),
    "xz": (["xz-utils"], []),
    "file": (["file"], []),
    "patchelf": (["patchelf"], []),
    "git": (["git"], []),
    "nix": (["nix-bin"], []),
    # stdenv.cc: the cc-wrapper puts cc, c++ and binutils on PATH.
    "gcc-wrapper": (["gcc", "cpp", "g++", "binutils"], ["cc", "c++", "as", "ld"]),
}
HIDDEN = ["/usr/bin", "/usr/sbin", "/usr/local/bin"]
# Debian's compiler drivers find cc1 and the linker relative to their own place: they stay at
# their path under /usr/bin (bound back into the emptied folder), as a cc-wrapper's store path
# is absolute too. Every other program is a copy outside /usr/bin.
IN_PLACE = {"cc", "c++", "gcc", "g++", "cpp", "as", "ld"}


def debian_programs(package: str) -> list[Path]:
    out = subprocess.run(["dpkg-query", "-L", package], capture_output=True, text=True)
    if out.returncode != 0:
        return []
    programs = []
    for line in out.stdout.splitlines():
        path = Path(line)
        if path.parent in (Path("/usr/bin"), Path("/bin")) and os.access(path, os.X_OK) and not path.is_dir():
            programs.append(path)
    return programs


def build_path(folder: Path, store: Path, names: list[str]) -> None:
    """The build's PATH folder: one link per program of the named nixpkgs packages, each to a
    copy of the program in `store` (as a store path holds it: not under /usr/bin)."""
    folder.mkdir(parents=True)
    store.mkdir(parents=True, exist_ok=True)
    programs: dict[str, Path] = {}
    for name in names:
        if name.startswith("python3-"):
            # The check's Python environment (with pytest): this venv's interpreter, through
            # /bin/sh, which the sandbox has (a link would lose the venv).
            for command in ("python3", "python"):
                launcher = folder / command
                launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
                launcher.chmod(0o755)
            continue
        if name == "shellcheck":
            programs["shellcheck"] = Path(shellcheck())
            continue
        assert name in DEBIAN, f"the check lists {name}: add the Debian package(s) with its programs to DEBIAN"
        packages, commands = DEBIAN[name]
        for package in packages:
            for program in debian_programs(package):
                programs.setdefault(program.name, program)
        for command in commands:
            found = shutil.which(command)
            if found:
                programs.setdefault(command, Path(found))
    for command, program in programs.items():
        target = program.resolve()
        if target.parent == Path("/usr/bin") and command in IN_PLACE:
            (folder / command).symlink_to(target)  # bound back in place by emulate()
            continue
        copy = store / target.name
        if not copy.exists():
            shutil.copy2(target, copy)
        (folder / command).symlink_to(copy)


def emulate(tmp_path: Path, inputs: list[str], script: str):
    """Run `script` as a build would: bash -e -u -o pipefail (stdenv's setup), PATH = `inputs`'
    programs only, $out, $NIX_BUILD_TOP and HOME as the sandbox sets them, nothing of the host's
    environment, in a mount namespace where /usr/bin holds only `sh`."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare (util-linux): the build sandbox cannot be emulated here")
    namespace = [unshare, "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        namespace[1:1] = ["--user", "--map-root-user"]
    probe = subprocess.run([*namespace, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here ({probe.stderr.strip()}): the sandbox cannot be emulated")
    bin_dir, store = tmp_path / "path", tmp_path / "store"
    build_path(bin_dir, store, inputs)
    setup_tools = tmp_path / "setup"
    setup_tools.mkdir()
    for tool in ("mount", "touch"):
        shutil.copy2(Path(shutil.which(tool)).resolve(), setup_tools / tool)
    shell = Path("/bin/sh").resolve()
    shutil.copy2(shell, store / "sandbox-sh")
    top = tmp_path / "build"
    top.mkdir()
    (top / "build.sh").write_text(script)
    setup = ["set -euo pipefail"]
    setup += [f"{setup_tools}/mount -t tmpfs tmpfs {hidden}" for hidden in HIDDEN]
    # The sandbox's one program outside the store: /bin/sh (/bin is /usr/bin here).
    setup += [f"{setup_tools}/touch /usr/bin/sh", f"{setup_tools}/mount --bind {store}/sandbox-sh /usr/bin/sh"]
    in_place = sorted({str(link.resolve()) for link in bin_dir.iterdir() if link.name in IN_PLACE})
    for index, path in enumerate(in_place):
        # Bound from a copy made before /usr/bin was emptied.
        shutil.copy2(path, store / f"in-place-{index}")
        setup += [f"{setup_tools}/touch {path}", f"{setup_tools}/mount --bind {store}/in-place-{index} {path}"]
    setup.append(f'export PATH="{bin_dir}"; cd {top} && exec "{bin_dir}/bash" -e -u -o pipefail "{top}/build.sh"')
    env = {
        "HOME": "/homeless-shelter",
        "NIX_BUILD_TOP": str(top),
        "TMPDIR": str(top),
        "out": str(tmp_path / "out"),
        "NIX_BUILD_CORES": "1",
    }
    return subprocess.run(
        [*namespace, "/usr/bin/bash", "-c", "\n".join(setup)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1500,
    )


def checks_source_copy(tmp_path: Path, fileset: list[str]) -> Path:
    """What `${src}` is in the sandbox: the tracked files of source.checks' file set, read-only,
    without .git (the store path holds exactly those files)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *fileset],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    copy = tmp_path / "source-checks"
    for name in listed:
        if (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    subprocess.run(["chmod", "-R", "a-w", str(copy)], check=True)
    return copy


def check_of_the_flake(name: str) -> dict:
    return flake_eval(
        f"let d = self.checks.${{system}}.{name}; n = p: p.pname or p.name; "
        "src = (scope system).source.checks; in "
        "{ inputs = map n (d.nativeBuildInputs or [ ] ++ d.buildInputs or [ ]); "
        "stdenv = map n d.stdenv.initialPath ++ (if d.stdenv.cc == null then [ ] else [ (n d.stdenv.cc) ]); "
        "inherit (d) buildCommand; src = toString src; "
        'fileset = map (p: builtins.replaceStrings [ (toString repo + "/") ] [ "" ] (toString p)) src.fileset; }',
        system=SYSTEM,
    )


def test_checks_tests_passes_in_the_emulated_build_sandbox(tmp_path):
    check = check_of_the_flake("tests")
    assert "gcc-wrapper" in check["stdenv"], "checks.tests must build on a stdenv with a C compiler"
    source = checks_source_copy(tmp_path, check["fileset"])
    command = check["buildCommand"].replace(check["src"], str(source))
    assert str(source) in command
    probe = (
        'if [ -e /usr/bin/env ]; then echo "emulation: /usr/bin/env is visible" >&2; exit 97; fi\n'
        'echo "emulation: PATH=$PATH; cc=$(command -v cc)"\n'
    )
    out = emulate(tmp_path, check["inputs"] + check["stdenv"], probe + command)
    tail = (out.stdout + out.stderr)[-6000:]
    assert out.returncode == 0, tail
    assert f"cc={tmp_path}/path/cc" in out.stdout
    assert " passed" in out.stdout and " failed" not in out.stdout, tail
    assert (tmp_path / "out").exists()


def test_the_emulation_refuses_what_the_sandbox_refuses(tmp_path):
    """The two failures of issue 20 under a plain runCommand's PATH (stdenvNoCC, no compiler):
    a `#!/usr/bin/env bash` script cannot start, and there is no `cc`; /usr/bin holds sh only."""
    check = check_of_the_flake("shellcheck")  # a runCommand: stdenvNoCC
    assert "gcc-wrapper" not in check["stdenv"]
    script = (
        "printf '#!/usr/bin/env bash\\necho started\\n' > wrapper && chmod +x wrapper\n"
        "if ./wrapper; then echo 'env-shebang ran'; else echo 'env-shebang refused'; fi\n"
        "if command -v cc; then echo 'cc found'; else echo 'no cc'; fi\n"
        "ls /usr/bin | sort | tr '\\n' ' '\n"
    )
    out = emulate(tmp_path, check["inputs"] + check["stdenv"], script)
    assert out.returncode == 0, out.stderr
    assert "env-shebang refused" in out.stdout and "no cc" in out.stdout, out.stdout
    listed = out.stdout.strip().splitlines()[-1].split()
    assert listed == ["sh"]
