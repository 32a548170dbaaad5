# One app's wrapper (magpieLib.appTable.${name}): it runs the repository script with a plain
# Python (standard-library tools, e.g. the patch tool for users whose vLLM is not this one) or
# the patched environment's, and for GPU apps with the host driver, nvcc, ninja and
# FlashInfer's cache. The wrapped scripts live in the filtered source (nix/source.nix).
# flake.nix turns these derivations into `apps` with magpieLib.mkApps.
{
  lib,
  writeShellApplication,
  bash,
  coreutils,
  gnused,
  procps,
  ninja,
  gcc14,
  python,
  magpieLib,
  source,
  env,
  cudaHome,
  cudaCapabilities,
  nvidiaDriverLibs,
  # "" for the default vLLM release, "_0_33" for the 0.33.0 scope's wrappers (scope.releases).
  releaseSuffix,
  name,
}:
let
  app = magpieLib.appTable.${name};
in
writeShellApplication {
  name = name + releaseSuffix;
  # What the scripts call comes from these inputs, first on PATH: bash and coreutils
  # everywhere; sed (usage text), procps (ps/kill); nvcc, the host compiler and ninja for
  # FlashInfer's JIT (serve.sh's server runs in its own session through memguard run, a
  # Python, not setsid). The host's PATH follows only for apps that
  # call the host driver's nvidia-smi (appTable hostTools).
  inheritPath = app.hostTools;
  runtimeInputs = [
    bash
    coreutils
    gnused
    procps
  ]
  ++ lib.optionals app.gpu [
    ninja
    gcc14
    cudaHome
  ];
  text = magpieLib.wrapperText {
    inherit name;
    src = "${source.tools}";
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
    mainProgram = name + releaseSuffix;
    platforms = magpieLib.systems;
  };
}
