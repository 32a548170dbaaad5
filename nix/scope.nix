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

  # The vLLM release this scope builds; `releases` below holds the scopes of the others.
  vllmRelease = self.magpieLib.defaultVllmRelease;
  # nix/pins/<system>.json (vllm-<release>/<system>.json for the others), written by
  # magpie/nix/pin_wheels.py.
  pins = self.magpieLib.readReleasePins ./pins self.vllmRelease stdenv.hostPlatform.system;
  # The release's patch series (patches/vllm-<release>: its `series` and patches); vllm.nix
  # refuses a series written for another release.
  patchSeries = ../patches + "/vllm-${self.vllmRelease}";
  # The suffix of the release's attribute names and app binaries ("" here, "_0_33" for 0.33.0).
  releaseSuffix = self.magpieLib.releaseSuffix self.vllmRelease;
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
  # The patch series is an argument of vllm.nix (the scope's `patchSeries`), e.g.
  #   self.vllm.override { patchSeries = ./my-series/vllm-0.29.0; }
  vllm = self.callPackage ./vllm.nix { };
  cudaHome = self.callPackage ./cuda-home.nix { };
  flashinferJitCache = self.callPackage ./flashinfer-aot.nix { };
  env = self.callPackage ./vllm-env.nix { };
  envWithFlashinferAot = self.env.override { withFlashinferAot = true; };
  nvidiaDriverLibs = self.callPackage ./driver.nix { };
  devShell = self.callPackage ./devshell.nix { };
  # The lint tools at CI's versions (checks.formatting, the dev shell).
  nixfmt = self.callPackage ./nixfmt.nix { };
  ruff = self.callPackage ./ruff.nix { };

  # name -> wrapper derivation, one per entry of magpieLib.appTable.
  apps = lib.mapAttrs (name: _: self.callPackage ./app.nix { inherit name; }) magpieLib.appTable;

  # release -> the same scope for each other vLLM release (its own pins, series, closure,
  # environment and apps); every knob above can be overridden in it too, e.g.
  #   scope.releases."0.33.0".overrideScope (final: prev: { withFlashinferAot = true; })
  releases = lib.genAttrs magpieLib.otherVllmReleases (
    release: self.overrideScope (final: prev: { vllmRelease = release; })
  );
})
