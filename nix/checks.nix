# `nix flake check`: the patch series against the pinned vLLM source, the patched package
# itself, the tests that need neither the network nor a GPU, and the linters.
{
  lib,
  runCommand,
  fetchPypi,
  python312,
  ruff,
  shellcheck,
  nixfmt,
  nix,
  findutils,
  magpieLib,
  source,
  vllm,
}:
let
  src = source.checks;
  # The vLLM 0.29.0 sdist (the full source tree); sha256 c03feb07...cd97 as the registry lists it.
  vllmSource = fetchPypi {
    pname = "vllm";
    version = "0.29.0";
    hash = "sha256-wD/rB5Q+yunmnn3EJNfFVp7PjRKSUTrvKk3mevOBzZc=";
  };
  seriesFiles = magpieLib.seriesPatches ../patches/vllm-0.29.0;
  testPython = python312.withPackages (ps: [
    ps.pytest
    ps.pytest-timeout
  ]);
in
{
  # Every patch applies in series order to the pristine source with no fuzz, and the
  # project's tool agrees: all "not applied" before, all "applied" after.
  patch-series = runCommand "magpie-patch-series-vllm-0.29.0" { nativeBuildInputs = [ python312 ]; } ''
    tar -xzf ${vllmSource}
    cd vllm-0.29.0
    python3 ${src}/scripts/patches.py status --target . --patches-dir ${src}/patches
    ${lib.concatMapStrings (patch: ''
      patch -p1 --fuzz=0 --forward --batch --no-backup-if-mismatch -i ${patch}
    '') seriesFiles}
    python3 ${src}/scripts/patches.py status --require-applied --target . --patches-dir ${src}/patches
    touch "$out"
  '';

  # The patched package builds, its import check passes and the tool sees the series applied.
  vllm-patched = vllm;

  # Pure Nix logic, pins/requirements/series consistency and the app and driver scripts. The
  # registry check of the pins is left out (the build sandbox has no network), and so is the
  # suite's conftest.py (it imports the CPU vLLM build of tests/env/setup.sh).
  tests =
    runCommand "magpie-nix-tests"
      {
        nativeBuildInputs = [
          testPython
          nix
          shellcheck
          findutils
        ];
      }
      ''
        cp -r ${src} repo && chmod -R u+w repo && cd repo
        export HOME="$(mktemp -d)" NIX_STATE_DIR="$(mktemp -d)"
        python3 -m pytest -p no:cacheprovider --noconftest -k "not registry" tests/nix
        touch "$out"
      '';

  ruff = runCommand "magpie-ruff" { nativeBuildInputs = [ ruff ]; } ''
    cd ${src}
    ruff check --no-cache .
    ruff format --no-cache --check .
    touch "$out"
  '';

  shellcheck = runCommand "magpie-shellcheck" { nativeBuildInputs = [ shellcheck findutils ]; } ''
    cd ${src}
    find . -name '*.sh' -print0 | xargs -0 shellcheck
    touch "$out"
  '';

  formatting = runCommand "magpie-nixfmt" { nativeBuildInputs = [ nixfmt findutils ]; } ''
    cd ${src}
    find . -name '*.nix' -print0 | xargs -0 nixfmt --check
    touch "$out"
  '';
}
