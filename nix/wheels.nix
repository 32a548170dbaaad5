# Every wheel of vLLM's pinned closure except vLLM itself, installed into one prefix and made
# to find its libraries in the store (the way nixpkgs packages torch-bin and jaxlib-bin:
# fixed-output fetches of the upstream wheels plus autoPatchelf). One derivation rather than
# ~200: the set is resolved as a whole by pip (nix/pins), and the NVIDIA wheels share one
# `nvidia/cu13` tree whose libraries find each other by relative layout.
{
  lib,
  stdenv,
  python,
  fetchPypi,
  linkFarm,
  autoPatchelfHook,
  addDriverRunpath,
  magpieLib,
  pins,
}:
let
  closurePins = magpieLib.pinList pins [ pins.root ];

  # pip wants each wheel under its own file name, not the store path's.
  wheelDir = linkFarm "vllm-${pins.wheels.${pins.root}.version}-closure-wheels" (
    map (pin: {
      name = pin.filename;
      path = fetchPypi (magpieLib.pinToFetchPypiArgs pin);
    }) closurePins
  );

  pythonWithPip = python.withPackages (ps: [ ps.pip ]);
in
python.pkgs.toPythonModule (
  stdenv.mkDerivation {
    pname = "vllm-wheel-closure";
    version = pins.wheels.${pins.root}.version;

    dontUnpack = true;
    dontConfigure = true;
    dontBuild = true;

    nativeBuildInputs = [
      autoPatchelfHook
      pythonWithPip
    ];

    # Measured with scripts/nix/wheel_libs.py on the pinned wheels: besides glibc, the
    # closure's native code needs only libstdc++, libgcc_s and libgomp from outside it.
    buildInputs = [ stdenv.cc.cc.lib ];

    installPhase = ''
      runHook preInstall
      ${pythonWithPip.interpreter} -m pip install --no-index --no-deps --no-cache-dir \
        --no-warn-script-location --prefix "$out" ${wheelDir}/*.whl
      runHook postInstall
    '';

    preFixup = ''
      addAutoPatchelfSearchPath "$out/${python.sitePackages}"
    '';

    # libcuda.so.1 is the host driver's: found at run time in /run/opengl-driver/lib (NixOS)
    # or through the apps' driver discovery (other distributions).
    appendRunpaths = [ "${addDriverRunpath.driverLink}/lib" ];
    autoPatchelfIgnoreMissingDeps = [
      "libcuda.so.1"
      # Optional backends, loaded only when asked for (measured, see buildInputs):
      # torchcodec ships one extension per FFmpeg major version and loads the one the host has.
      "libavcodec.so.*"
      "libavdevice.so.*"
      "libavfilter.so.*"
      "libavformat.so.*"
      "libavutil.so.*"
      "libswresample.so.*"
      "libswscale.so.*"
      "libheif.so.1"
      # numba's TBB threading layer (it falls back to OpenMP / its work queue).
      "libtbb.so.12"
      # cuFile's RDMA plugin and NVSHMEM's network transports / MPI bootstrap.
      "libibverbs.so.1"
      "librdmacm.so.1"
      "libfabric.so.1"
      "libmlx5.so.1"
      "libmpi.so.40"
      "liboshmem.so.40"
      "libpmix.so.2"
      "libucp.so.0"
      "libucs.so.0"
    ];

    # The vendors' binaries (nvcc, ptxas, fatbins in CUDA libraries) are used as shipped.
    dontStrip = true;

    passthru = {
      inherit pins wheelDir;
      # The CUDA tree the NVIDIA wheels share (nvcc, headers, libcudart): torch 2.13 is CUDA 13.
      cudaTree = "${python.sitePackages}/nvidia/cu13";
    };

    meta = {
      description = "The binary-wheel closure of vLLM ${pins.wheels.${pins.root}.version} (without vLLM), pinned by nix/pins";
      # Mixed: open-source projects and NVIDIA's CUDA libraries (NVIDIA's license).
      license = lib.licenses.unfreeRedistributable;
      sourceProvenance = [ lib.sourceTypes.binaryNativeCode ];
      platforms = [ stdenv.hostPlatform.system ];
    };
  }
)
