# ruff from the wheel tests/env/requirements.txt pins (nix/pins "tools"): the flake's checks, the
# dev shell and tests/run.sh run the same binary release.
{
  stdenv,
  runCommand,
  fetchurl,
  unzip,
  autoPatchelfHook,
  magpieLib,
  pins,
  registryFileBases,
}:
let
  pin = pins.tools.ruff;
in
runCommand "ruff-${pin.version}"
  {
    nativeBuildInputs = [
      unzip
      autoPatchelfHook
    ];
    buildInputs = [ stdenv.cc.cc.lib ];
    meta.mainProgram = "ruff";
  }
  ''
    unzip -q ${fetchurl (magpieLib.pinToFetchurlArgs registryFileBases pin)} '*.data/scripts/ruff'
    install -Dm755 ./*.data/scripts/ruff "$out/bin/ruff"
    # runCommand runs no fixup phase: patch the wheel's binary for the store here.
    autoPatchelf "$out"
    "$out/bin/ruff" --version
  ''
