# The package scope behind the overlay; every file named here has one job. Only derivations go
# through callPackage (it adds `override` and `overrideDerivation` to whatever a file returns);
# plain attribute sets are imported with explicit arguments.
{
  lib,
  newScope,
  config,
  stdenv,
  python,
  fetchurlMirrors,
}:
let
  magpieLib = import ./lib.nix;
in
lib.makeScope newScope (self: {
  inherit python magpieLib;

  # nix/pins/<system>.json, written by magpie/nix/pin_wheels.py.
  pins = self.magpieLib.readPins ./pins stdenv.hostPlatform.system;
  registryFileBases = self.magpieLib.registryFileBases fetchurlMirrors;

  # Capabilities FlashInfer JIT-builds for (and, if asked, builds ahead of time); nixpkgs' own
  # `config.cudaCapabilities` wins when the user set it.
  cudaCapabilities =
    let
      fromConfig = config.cudaCapabilities or [ ];
    in
    if fromConfig != [ ] then
      fromConfig
    else
      self.magpieLib.defaultCudaCapabilities.${stdenv.hostPlatform.system};

  # FlashInfer's kernels built ahead of time in `env` (off: they are JIT-built on first use).
  # `envWithFlashinferAot` below is the same environment with them.
  withFlashinferAot = false;
  # Parallel nvcc jobs of that build: CUTLASS MoE units take 3-8 GB each.
  flashinferAotMaxJobs = 4;

  source = import ./source.nix { inherit lib; };

  wheelClosure = self.callPackage ./wheels.nix { };
  # The patch series is an argument of vllm.nix (default patches/vllm-0.29.0), e.g.
  #   self.vllm.override { patchSeries = ../patches/vllm-X.Y.Z; }
  vllm = self.callPackage ./vllm.nix { };
  cudaHome = self.callPackage ./cuda-home.nix { };
  flashinferJitCache = self.callPackage ./flashinfer-aot.nix { };
  env = self.callPackage ./vllm-env.nix { };
  envWithFlashinferAot = self.env.override { withFlashinferAot = true; };
  nvidiaDriverLibs = self.callPackage ./driver.nix { };
  devShell = self.callPackage ./devshell.nix { };

  # name -> wrapper derivation, one per entry of magpieLib.appTable.
  apps = lib.mapAttrs (name: _: self.callPackage ./app.nix { inherit name; }) magpieLib.appTable;
})
