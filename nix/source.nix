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
      ../magpie/patches.py
    ];
  };

  # The tools package the apps run (magpie/) plus the series the `patches` app reads.
  tools = fs.toSource {
    inherit root;
    fileset = fs.unions [
      ../magpie
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
      ../setup.py
      ../MANIFEST.in
      ../magpie
      ../requirements
      ../scripts
      ../tests
    ];
  };
}
