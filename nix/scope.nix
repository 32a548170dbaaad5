# The package scope behind the overlay; every file named here has one job.
{
  lib,
  newScope,
  config,
  stdenv,
  # CPython 3.12: what DGX OS 7 ships, so the requirements files (same pins) install there too.
  python,
}:
lib.makeScope newScope (self: {
  inherit python;
  magpieLib = import ./lib.nix;

  # nix/pins/<system>.json, written by scripts/nix/pin_wheels.py.
  pins = self.magpieLib.readPins ./pins stdenv.hostPlatform.system;

  # Capabilities FlashInfer builds ahead of time and JIT-builds for; nixpkgs' own
  # `config.cudaCapabilities` wins when the user set it.
  cudaCapabilities =
    let
      fromConfig = config.cudaCapabilities or [ ];
    in
    if fromConfig != [ ] then
      fromConfig
    else
      self.magpieLib.defaultCudaCapabilities.${stdenv.hostPlatform.system};

  # Build FlashInfer's kernels for the capabilities above in a derivation (false: JIT only).
  withFlashinferAot = true;

  source = self.callPackage ./source.nix { };
  wheelClosure = self.callPackage ./wheels.nix { };
  vllm = self.callPackage ./vllm.nix { };
  cudaHome = self.callPackage ./cuda-home.nix { };
  flashinferJitCache = self.callPackage ./flashinfer-aot.nix { };
  env = self.callPackage ./vllm-env.nix { };
  nvidiaDriverLibs = self.callPackage ./driver.nix { };
  apps = self.callPackage ./apps.nix { };
})
