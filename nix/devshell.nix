# `nix develop`: the patched environment on PATH as `python`/`vllm`, FlashInfer's JIT
# toolchain, and the project's lint and test tools.
{
  mkShell,
  python,
  ruff,
  shellcheck,
  nixfmt,
  nix,
  ninja,
  gcc14,
  magpieLib,
  env,
  cudaHome,
  cudaCapabilities,
}:
mkShell {
  packages = [
    env
    # The repository's tests run in their own CPU venv (tests/env/setup.sh); pytest here is
    # for running them, not a package of the patched environment.
    (python.withPackages (ps: [
      ps.pytest
      ps.pytest-timeout
    ]))
    ruff
    shellcheck
    nixfmt
    nix
    ninja
    gcc14
    cudaHome
  ];
  shellHook = magpieLib.gpuEnvText {
    cudaHome = "${cudaHome}";
    capabilities = cudaCapabilities;
    cc = "${gcc14}/bin/gcc";
    cxx = "${gcc14}/bin/g++";
  };
}
