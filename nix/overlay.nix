# nixpkgs overlay: adds `magpie-vllm-plugins`, a package scope holding vLLM 0.29.0 from pinned
# binary wheels with the patch series applied, the apps and (opt-in) FlashInfer's
# ahead-of-time kernels; `magpie-vllm-plugins.releases."0.33.0"` is the same scope for 0.33.0. Override its knobs with `overrideScope`, e.g.
#   pkgs.magpie-vllm-plugins.overrideScope (final: prev: { cudaCapabilities = [ "9.0" ]; })
final: prev: {
  magpie-vllm-plugins = import ./scope.nix {
    inherit (final)
      lib
      newScope
      config
      stdenv
      ;
    # CPython 3.12: what DGX OS 7 ships, so the requirements files (same pins) install there too.
    python = final.python312;
    # nixpkgs' own list of download hosts; the wheels' addresses are built from its `pypi` entry.
    fetchurlMirrors = import (final.path + "/pkgs/build-support/fetchurl/mirrors.nix");
  };
}
