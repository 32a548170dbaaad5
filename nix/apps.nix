# One wrapper per entry of magpieLib.appTable: it runs the repository script with a plain
# Python (standard-library tools, e.g. the patch tool for users whose vLLM is not this one) or
# the patched environment's, and for GPU apps with the host driver, nvcc, ninja and
# FlashInfer's cache. The wrapped scripts live in the filtered source (nix/source.nix).
# flake.nix turns these derivations into `apps` with magpieLib.mkApps.
{
  lib,
  writeShellApplication,
  ninja,
  gcc14,
  python,
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
      envPython = "${env}/bin/python";
      stdlibPython = python.interpreter;
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
