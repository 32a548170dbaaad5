# FlashInfer kernels built ahead of time for the chosen CUDA capabilities, packaged the way
# FlashInfer looks for them: a `flashinfer_jit_cache` module whose get_jit_cache_dir() holds
# <module>/<module>.so (flashinfer/jit/env.py prefers it over its own data/aot folder). A kernel
# not built here is still JIT-built at run time into FLASHINFER_WORKSPACE_BASE (see apps.nix).
{
  lib,
  stdenv,
  python,
  gcc14,
  ninja,
  autoPatchelfHook,
  addDriverRunpath,
  magpieLib,
  pins,
  source,
  wheelClosure,
  cudaHome,
  cudaCapabilities,
}:
let
  flashinferVersion = pins.wheels.flashinfer-python.version;
  capabilityTag = lib.concatMapStringsSep "." (c: "sm${magpieLib.capabilityDigits c}") cudaCapabilities;
  buildPython = python.withPackages (_: [ wheelClosure ]);
in
python.pkgs.toPythonModule (
  stdenv.mkDerivation {
    pname = "flashinfer-jit-cache";
    # FlashInfer accepts a cache whose version starts with its own.
    version = "${flashinferVersion}+${capabilityTag}";

    dontUnpack = true;
    dontConfigure = true;

    nativeBuildInputs = [
      buildPython
      # Kernel generators also call `nvcc` from PATH (or $CUDA_PATH/bin) directly.
      cudaHome
      gcc14
      ninja
      autoPatchelfHook
    ];

    env = {
      CUDA_HOME = "${cudaHome}";
      CUDA_PATH = "${cudaHome}";
      CC = "${gcc14}/bin/gcc";
      CXX = "${gcc14}/bin/g++";
      FLASHINFER_CUDA_ARCH_LIST = magpieLib.flashinferArchList cudaCapabilities;
    };

    # The fused-MoE and FP4 GEMM kernels of the SM12x family take minutes each: this is
    # the work the first Flash-Next launch would otherwise do (~5 min on the GB10).
    buildPhase = ''
      runHook preBuild
      export HOME="$(mktemp -d)" MAX_JOBS="$NIX_BUILD_CORES"
      ${buildPython.interpreter} ${source.scripts}/scripts/nix/flashinfer_aot.py \
        --build-dir "$PWD/build" --out-dir "$PWD/kernels" --preset moe
      runHook postBuild
    '';

    installPhase = ''
      runHook preInstall
      module="$out/${python.sitePackages}/flashinfer_jit_cache"
      mkdir -p "$module"
      cp -r kernels "$module/jit_cache"
      cat > "$module/__init__.py" <<PY
      """FlashInfer ${flashinferVersion} kernels built ahead of time for ${capabilityTag} by magpie-vllm-plugins."""
      import os

      __version__ = "$version"


      def get_jit_cache_dir():
          return os.path.join(os.path.dirname(__file__), "jit_cache")
      PY
      runHook postInstall
    '';

    preFixup = ''
      addAutoPatchelfSearchPath "${wheelClosure}/${python.sitePackages}"
    '';
    appendRunpaths = [ "${addDriverRunpath.driverLink}/lib" ];
    autoPatchelfIgnoreMissingDeps = [ "libcuda.so.1" ];

    meta = {
      description = "FlashInfer ${flashinferVersion} kernels built ahead of time for ${capabilityTag}";
      license = lib.licenses.asl20;
      platforms = [ stdenv.hostPlatform.system ];
    };
  }
)
