# Every wheel of vLLM's pinned closure except vLLM itself, installed into one prefix and made
# to find its libraries in the store (the way nixpkgs packages torch-bin and jaxlib-bin:
# fixed-output fetches of the upstream wheels plus autoPatchelf).
#
# One derivation, not one per wheel: pip resolves the set as a whole (nix/pins), so no wheel
# can be swapped alone without re-resolving, and the NVIDIA wheels share one `nvidia/cu13`
# tree whose libraries find each other by relative layout. Each wheel is still its own
# fixed-output fetch, so downloads are cached per file; what one derivation costs is that any
# pin change re-runs the (I/O-bound) install and autoPatchelf of the whole prefix.
{
  lib,
  stdenv,
  python,
  fetchurl,
  autoPatchelfHook,
  autoAddDriverRunpath,
  patchelf,
  magpieLib,
  pins,
  registryFileBases,
}:
let
  inherit (pins.wheels.${pins.root}) version;
  closurePins = magpieLib.pinList pins [ pins.root ];
  fetchWheel = pin: fetchurl (magpieLib.pinToFetchurlArgs registryFileBases pin);
in
python.pkgs.toPythonModule (
  stdenv.mkDerivation {
    pname = "vllm-wheel-closure";
    inherit version;

    # installer wants each wheel under its own file name (the store path's has a hash prefix).
    unpackPhase = ''
      runHook preUnpack
      mkdir dist
      ${lib.concatMapStrings (pin: ''
        ln -s ${fetchWheel pin} dist/${pin.filename}
      '') closurePins}
      runHook postUnpack
    '';
    dontConfigure = true;
    dontBuild = true;

    # pypaInstallHook runs pypa/installer once per wheel into $out, and installer refuses to
    # write a file an earlier wheel wrote: the paths more than one pinned wheel ships
    # (nix/wheel-overlaps.json, each with its reason; magpie/nix/pin_wheels.py --overlaps refuses
    # any other) are dropped from the wheels named there first. The rewritten wheels replace
    # their links in dist/; every other wheel is installed as fetched.
    preInstall = ''
      ${python.pythonOnBuildForHost.interpreter} ${../magpie/nix/drop_wheel_paths.py} ${./wheel-overlaps.json} dist
    '';

    nativeBuildInputs = [
      # installer on the bare interpreter (the hook's own), as buildPythonPackage installs a
      # wheel: scripts get that interpreter in their shebang, nothing of a build-only env.
      python.pkgs.pypaInstallHook
      autoPatchelfHook
      # libcuda.so.1 is the host driver's: /run/opengl-driver/lib on NixOS, the apps' driver
      # discovery elsewhere.
      autoAddDriverRunpath
      patchelf
    ];

    # Measured with magpie/nix/wheel_libs.py on the pinned wheels: besides glibc, the
    # closure's native code needs only libstdc++, libgcc_s and libgomp from outside it.
    buildInputs = [ stdenv.cc.cc.lib ];

    # autoPatchelf rewrites each RUNPATH to the folders of the libraries it resolved and so
    # drops `$ORIGIN` entries; libraries that dlopen siblings by name (cuDNN's sub-libraries,
    # nvrtc-builtins, NVSHMEM's transport plugins) need them back. Record them before the fixup
    # and add them again after it (the order nixpkgs' torch-bin uses for its extra runpaths).
    preFixup = ''
      addAutoPatchelfSearchPath "$out/${python.sitePackages}"
      find "$out" -type f -name '*.so*' -print0 | while IFS= read -r -d "" elf; do
        runpath=$(patchelf --print-rpath "$elf" 2>/dev/null) || continue
        origin=$(tr ':' '\n' <<<"$runpath" | grep -F '$ORIGIN' | paste -sd: -) || true
        if [ -n "$origin" ]; then
          printf '%s\t%s\n' "$elf" "$origin" >>"$NIX_BUILD_TOP/origin-runpaths"
        fi
      done
    '';
    postPhases = [ "restoreOriginRunpathsPhase" ];
    restoreOriginRunpathsPhase = ''
      if [ -f "$NIX_BUILD_TOP/origin-runpaths" ]; then
        while IFS=$'\t' read -r elf origin; do
          patchelf --add-rpath "$origin" "$elf"
        done <"$NIX_BUILD_TOP/origin-runpaths"
      fi
    '';

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
      inherit pins;
      overlaps = ./wheel-overlaps.json;
      wheels = map fetchWheel closurePins;
      # The CUDA tree the NVIDIA wheels share (nvcc, headers, libcudart): torch 2.13 (vLLM
      # 0.29.0) and torch 2.14 (0.33.0) are both CUDA 13.0 builds.
      cudaTree = "${python.sitePackages}/nvidia/cu13";
    };

    meta = {
      description = "The pinned binary-wheel closure of vLLM ${version} (without vLLM)";
      # Mixed: open-source projects (mostly permissive) and NVIDIA's CUDA libraries.
      license = [
        lib.licenses.asl20
        lib.licenses.bsd3
        lib.licenses.mit
        lib.licenses.unfreeRedistributable
      ];
      sourceProvenance = [ lib.sourceTypes.binaryNativeCode ];
      platforms = magpieLib.systems;
    };
  }
)
