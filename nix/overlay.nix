# nixpkgs overlay: adds `magpie-vllm-plugins`, a package scope holding vLLM 0.29.0 from pinned
# binary wheels with the patch series applied, FlashInfer's ahead-of-time kernels and the apps.
# Override its knobs with `overrideScope`, e.g.
#   pkgs.magpie-vllm-plugins.overrideScope (final: prev: { cudaCapabilities = [ "9.0" ]; })
final: prev: {
  magpie-vllm-plugins = import ./scope.nix {
    inherit (final)
      lib
      newScope
      config
      stdenv
      ;
    python = final.python312;
  };
}
