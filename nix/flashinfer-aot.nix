# FlashInfer kernels built ahead of time for the chosen CUDA capabilities, packaged the way
# FlashInfer looks for them: a `flashinfer_jit_cache` module holding <module>/<module>.so, in
# the interface of the pinned FlashInfer (magpieLib.flashinferJitCacheModule: 0.6's
# get_jit_cache_dir(), 0.7's get_jit_cache_providers(), which FlashInfer calls at import).
# Opt-in (packages.vllm-env-flashinfer-aot, or withFlashinferAot = true in the scope): it has
# not been built yet anywhere. A kernel not built here is JIT-built at run time into
# FLASHINFER_WORKSPACE_BASE (see app.nix).
{
  lib,
  gcc14Stdenv,
  python,
  ninja,
  autoPatchelfHook,
  autoAddDriverRunpath,
  magpieLib,
  pins,
  source,
  wheelClosure,
  cudaHome,
  cudaCapabilities,
  flashinferAotMaxJobs,
}:
let
  # CUDA 13.0's nvcc accepts GCC up to 14 as its host compiler.
  stdenv = gcc14Stdenv;
  flashinferVersion = pins.wheels.flashinfer-python.version;
  smTag = capability: "sm${magpieLib.capabilityDigits capability}";
  capabilityTag = lib.concatMapStringsSep "." smTag cudaCapabilities;
  buildPython = python.withPackages (_: [ wheelClosure ]);
  version = "${flashinferVersion}+${capabilityTag}";
in
python.pkgs.toPythonModule (
  stdenv.mkDerivation {
    pname = "flashinfer-jit-cache";
    # FlashInfer accepts a cache whose version is its own followed by `+`.
    inherit version;

    jitCacheModule = magpieLib.flashinferJitCacheModule {
      inherit flashinferVersion version;
      description = "FlashInfer ${flashinferVersion} kernels built ahead of time for ${capabilityTag} by magpie-vllm-plugins.";
    };
    passAsFile = [ "jitCacheModule" ];

    dontUnpack = true;
    dontConfigure = true;

    nativeBuildInputs = [
      buildPython
      # Kernel generators also call `nvcc` from PATH (or $CUDA_PATH/bin) directly.
      cudaHome
      ninja
      autoPatchelfHook
      autoAddDriverRunpath
    ];
    buildInputs = [ stdenv.cc.cc.lib ];

    # Minutes of nvcc per fused-MoE unit and several GB of memory each.
    requiredSystemFeatures = [ "big-parallel" ];

    # Set in the phase, after the setup hooks ran (cc-wrapper's hook resets CC and CXX), and
    # handed to nvcc itself: -ccbin through NVCC_PREPEND_FLAGS, which nvcc reads on every call.
    buildPhase = ''
      runHook preBuild
      export HOME="$(mktemp -d)"
      export CUDA_HOME=${cudaHome} CUDA_PATH=${cudaHome}
      export CC=${stdenv.cc}/bin/cc CXX=${stdenv.cc}/bin/c++
      export NVCC_PREPEND_FLAGS="-ccbin ${stdenv.cc}/bin/c++ ''${NVCC_PREPEND_FLAGS:-}"
      export FLASHINFER_CUDA_ARCH_LIST=${lib.escapeShellArg (magpieLib.flashinferArchList cudaCapabilities)}
      jobs=''${NIX_BUILD_CORES:-1}
      if [ "$jobs" -gt ${toString flashinferAotMaxJobs} ] || [ "$jobs" -lt 1 ]; then
        jobs=${toString flashinferAotMaxJobs}
      fi
      export MAX_JOBS=$jobs
      ${buildPython.interpreter} ${source.tools}/magpie/nix/flashinfer_aot.py \
        --build-dir "$PWD/build" --out-dir "$PWD/kernels" --preset moe
      runHook postBuild
    '';

    installPhase = ''
      runHook preInstall
      module="$out/${python.sitePackages}/flashinfer_jit_cache"
      mkdir -p "$module"
      cp -r kernels "$module/jit_cache"
      cp "$jitCacheModulePath" "$module/__init__.py"
      # The targets nvcc built for, named by FlashInfer's own CompilationContext from the same
      # FLASHINFER_CUDA_ARCH_LIST (its suffixes depend on the CUDA version: 12.0 -> sm120f).
      ${buildPython.interpreter} -c 'import json, sys; from flashinfer.compilation_context import CompilationContext; json.dump(sorted(f"sm{major}{minor}" for major, minor in CompilationContext().TARGET_CUDA_ARCHS), sys.stdout)' >"$module/cuda_architectures.json"
      runHook postInstall
    '';

    # FlashInfer itself finds the installed kernels (0.7 calls get_jit_cache_providers() while
    # `import flashinfer` runs; 0.6 reads get_jit_cache_dir()).
    doInstallCheck = true;
    installCheckPhase = ''
      runHook preInstallCheck
      PYTHONPATH="$out/${python.sitePackages}" ${buildPython.interpreter} -c '
      import pathlib, flashinfer.jit.env as env, flashinfer_jit_cache as cache
      wanted = pathlib.Path(cache.get_jit_cache_dir())
      providers = getattr(env, "FLASHINFER_AOT_PROVIDERS", None)
      found = [env.FLASHINFER_AOT_DIR] if providers is None else [p.jit_cache_dir for p in providers]
      assert wanted in found, f"FlashInfer does not see {wanted}: {found}"
      '
      runHook postInstallCheck
    '';

    preFixup = ''
      addAutoPatchelfSearchPath "${wheelClosure}/${python.sitePackages}"
    '';
    autoPatchelfIgnoreMissingDeps = [ "libcuda.so.1" ];

    meta = {
      description = "FlashInfer ${flashinferVersion} ahead-of-time kernels (${capabilityTag})";
      license = [ lib.licenses.asl20 ];
      platforms = magpieLib.systems;
    };
  }
)
