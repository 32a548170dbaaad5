# `nix develop`: the patched environment on PATH as `python`/`vllm`, FlashInfer's JIT
# toolchain, the host driver (outside NixOS) and the project's lint and test tools.
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
  nvidiaDriverLibs,
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
    nvidiaDriverLibs
  ];
  shellHook = ''
    # nixpkgs' ninja and compiler ahead of the ones the wheels put in the environment's bin/.
    export PATH="${ninja}/bin:${gcc14}/bin:${cudaHome}/bin:$PATH"
    # Outside NixOS the driver is not where Nix-built programs look: link it (and only it).
    if driver_dir=$(${nvidiaDriverLibs}/bin/nvidia-driver-libs 2>/dev/null); then
      export LD_LIBRARY_PATH="$driver_dir''${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      export TRITON_LIBCUDA_PATH="''${TRITON_LIBCUDA_PATH:-$driver_dir}"
    else
      echo "magpie dev shell: no NVIDIA driver found (nvidia-driver-libs); GPU code will not run" >&2
    fi
  ''
  + magpieLib.gpuEnvText {
    cudaHome = "${cudaHome}";
    capabilities = cudaCapabilities;
    cc = "${gcc14}/bin/gcc";
    cxx = "${gcc14}/bin/g++";
  };
}
