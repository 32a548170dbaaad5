# vLLM from its pinned upstream wheel with one of magpie-vllm-plugins' patch series applied.
# The wheel is unpacked, patched in series order and packed again before it is installed, so
# the installed files, their bytecode and the wheel's RECORD all describe the patched sources.
{
  lib,
  stdenv,
  python,
  fetchurl,
  autoPatchelfHook,
  autoAddDriverRunpath,
  magpieLib,
  pins,
  registryFileBases,
  source,
  wheelClosure,
  # patches/vllm-<release>: the folder holding that release's `series` and patches (the
  # scope's `patchSeries`, from its `vllmRelease`).
  patchSeries,
}:
let
  pin = pins.wheels.${pins.root};
  seriesName = baseNameOf (toString patchSeries);
  wantedSeries = "vllm-${pin.version}";
  # Refused at evaluation: a series written for another release would fail late, in the build.
  checkedSeries =
    if seriesName == wantedSeries then
      patchSeries
    else
      throw "vllm.nix: patchSeries ${seriesName} is not the pinned vLLM's (${wantedSeries})";
  # Read at evaluation time; each patch becomes its own store path, so editing one patch
  # rebuilds this package and nothing under it.
  seriesFiles = magpieLib.seriesPatches checkedSeries;
  # The project's tool reads the series folder of the release it finds (patches/vllm-<release>).
  checkSeries = target: ''
    ${python.pythonOnBuildForHost.interpreter} ${source.patches}/magpie/patches.py status \
      --require-applied --target "${target}" --patches-dir ${source.patches}/patches
  '';
in
python.pkgs.buildPythonPackage {
  pname = "vllm";
  inherit (pin) version;
  format = "wheel";

  src = fetchurl (magpieLib.pinToFetchurlArgs registryFileBases pin);

  nativeBuildInputs = [
    autoPatchelfHook
    autoAddDriverRunpath
    python.pkgs.wheel
  ];
  # vLLM's extensions link libstdc++ and libgcc_s; the rest comes from the closure.
  buildInputs = [ stdenv.cc.cc.lib ];
  dependencies = [ wheelClosure ];
  # A dependency pin-wheels resolved to another version than vLLM's metadata names
  # (magpie/releases.json `pins.overrides`: 0.34.0's flashinfer-python==0.7.3 is not on the
  # package index): the runtime-deps check would refuse the closure, so that pin is relaxed.
  pythonRelaxDeps = builtins.attrNames (pins.overrides or { });

  # The wheel holds the same Python files as vLLM's source tree, rooted at the folder that
  # holds `vllm/`, which is how the patches are written (a/vllm/..., b/vllm/...). Hunks must
  # match exactly; an offset is accepted, fuzz is not (the same rule as magpie/patches.py).
  # preInstall always runs (install checks may be off): the series check cannot be skipped.
  preInstall = ''
    wheel=$(echo dist/*.whl)
    ${python.pythonOnBuildForHost.interpreter} -m wheel unpack --dest unpacked "$wheel"
    tree=$(echo unpacked/vllm-*)
    ${lib.concatMapStrings (patch: ''
      echo "applying ${lib.removePrefix "${toString checkedSeries}/" (toString patch)}"
      patch -p1 --fuzz=0 --forward --batch --no-backup-if-mismatch -d "$tree" -i ${patch}
    '') seriesFiles}
    export HOME="$(mktemp -d)"
    ${checkSeries "$tree"}
    rm "$wheel"
    # `wheel pack` writes a new RECORD with the patched files' hashes and sizes.
    ${python.pythonOnBuildForHost.interpreter} -m wheel pack --dest-dir dist "$tree"
  '';

  postInstall = checkSeries "$out/${python.sitePackages}";

  preFixup = ''
    addAutoPatchelfSearchPath "${wheelClosure}/${python.sitePackages}"
  '';
  autoPatchelfIgnoreMissingDeps = [ "libcuda.so.1" ];
  dontStrip = true;
  pythonImportsCheck = [ "vllm" ];

  passthru = {
    inherit pins;
    patchSeries = checkedSeries;
    series = magpieLib.parseSeries (builtins.readFile (checkedSeries + "/series"));
  };

  meta = {
    description = "vLLM ${pin.version} (upstream wheel) with magpie-vllm-plugins' patches";
    homepage = "https://github.com/vllm-project/vllm";
    license = [ lib.licenses.asl20 ];
    sourceProvenance = [ lib.sourceTypes.binaryNativeCode ];
    platforms = magpieLib.systems;
    mainProgram = "vllm";
  };
}
