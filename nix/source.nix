# Filtered copies of the repository, so that editing docs or tests rebuilds nothing heavy.
{ lib }:
let
  fs = lib.fileset;
  root = ../.;
in
{
  # The patch series (read by vllm.nix) and the tool that checks it.
  patches = fs.toSource {
    inherit root;
    fileset = fs.unions [
      ../patches
      ../scripts/patches.py
    ];
  };

  # Everything the apps run (scripts/*) plus the series the `patches` app reads.
  scripts = fs.toSource {
    inherit root;
    fileset = fs.unions [
      ../scripts
      ../patches
    ];
  };

  # What the lint and test checks read.
  checks = fs.toSource {
    inherit root;
    fileset = fs.unions [
      ../.ci
      ../flake.nix
      ../flake.lock
      ../nix
      ../patches
      ../pyproject.toml
      ../requirements
      ../scripts
      ../tests
    ];
  };
}
