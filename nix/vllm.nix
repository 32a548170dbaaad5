# vLLM from its pinned upstream wheel with magpie-vllm-plugins' patch series applied, in the
# order of patches/series, to the installed package.
{
  lib,
  python,
  fetchPypi,
  autoPatchelfHook,
  addDriverRunpath,
  magpieLib,
  pins,
  source,
  wheelClosure,
}:
let
  pin = pins.wheels.${pins.root};
  # Read at evaluation time from patches/series; each patch becomes its own store path, so
  # editing one patch rebuilds this package and nothing under it.
  series = magpieLib.parseSeries (builtins.readFile ../patches/vllm-0.29.0/series);
  seriesFiles = magpieLib.seriesPatches ../patches/vllm-0.29.0;
in
python.pkgs.buildPythonPackage {
  pname = "vllm";
  inherit (pin) version;
  format = "wheel";

  src = fetchPypi (magpieLib.pinToFetchPypiArgs pin);

  nativeBuildInputs = [ autoPatchelfHook ];
  dependencies = [ wheelClosure ];

  # The wheel holds the same Python files as vLLM's source tree, rooted at the folder that
  # holds `vllm/`, which is how the patches are written (a/vllm/..., b/vllm/...). Hunks must
  # match exactly; an offset is accepted, fuzz is not (the same rule as scripts/patches.py).
  postInstall = lib.concatMapStrings (patch: ''
    echo "applying ${baseNameOf (toString patch)}"
    patch -p1 --fuzz=0 --forward --batch --no-backup-if-mismatch \
      -d "$out/${python.sitePackages}" -i ${patch}
  '') seriesFiles;

  preFixup = ''
    addAutoPatchelfSearchPath "${wheelClosure}/${python.sitePackages}"
  '';
  appendRunpaths = [ "${addDriverRunpath.driverLink}/lib" ];
  autoPatchelfIgnoreMissingDeps = [ "libcuda.so.1" ];
  dontStrip = true;

  # The project's own tool must see every patch of the series as applied.
  preInstallCheck = ''
    export HOME="$(mktemp -d)"
    ${python.pythonOnBuildForHost.interpreter} ${source.patches}/scripts/patches.py status \
      --require-applied --target "$out/${python.sitePackages}" --patches-dir ${source.patches}/patches
  '';
  pythonImportsCheck = [ "vllm" ];

  passthru = {
    inherit series pins;
  };

  meta = {
    description = "vLLM ${pin.version} (upstream wheel) with magpie-vllm-plugins' patch series";
    homepage = "https://github.com/vllm-project/vllm";
    license = lib.licenses.asl20;
    sourceProvenance = [ lib.sourceTypes.binaryNativeCode ];
    mainProgram = "vllm";
  };
}
