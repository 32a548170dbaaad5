# One wrapper per entry of magpieLib.appTable: it runs the repository script with the patched
# environment's Python, and for GPU apps the host driver, nvcc, ninja and FlashInfer's cache.
# flake.nix turns these derivations into `apps` with magpieLib.mkApps.
{
  lib,
  writeShellApplication,
  ninja,
  gcc14,
  magpieLib,
  source,
  env,
  cudaHome,
  cudaCapabilities,
  nvidiaDriverLibs,
}:
lib.mapAttrs (
  name: app:
  writeShellApplication {
    inherit name;
    runtimeInputs = lib.optionals app.gpu [
      ninja
      gcc14
      cudaHome
    ];
    text = magpieLib.wrapperText {
      inherit name;
      src = "${source.scripts}";
      python = "${env}/bin/python";
      driverLibs = lib.getExe nvidiaDriverLibs;
      gpuEnv = magpieLib.gpuEnvText {
        cudaHome = "${cudaHome}";
        capabilities = cudaCapabilities;
        cc = "${gcc14}/bin/gcc";
        cxx = "${gcc14}/bin/g++";
      };
    };
    meta = {
      inherit (app) description;
      mainProgram = name;
    };
  }
) magpieLib.appTable
