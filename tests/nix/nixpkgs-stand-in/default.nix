# A stand-in for `import nixpkgs { system; overlays; config; }` with only what the flake reads,
# as strict as nixpkgs where the flake depends on it (each rule read from nixpkgs' sources,
# docs/nix.md names them):
# - every package is a real `builtins.derivation`, so Nix itself coerces its attributes (a set or
#   a function where nixpkgs needs a string fails here as it does there); nothing is built;
# - `runCommand` builds on stdenvNoCC (no C compiler: `stdenv.cc` is null), `runCommandCC` on
#   stdenv; every derivation keeps its `stdenv`, whose `initialPath` lists the tools a build
#   finds on PATH besides its inputs (tests/nix/test_sandbox_emulation.py runs a check that way);
# - `fetchurl`, `writeTextFile` and `writeShellApplication` take nixpkgs' closed argument sets;
#   writeShellApplication writes nixpkgs' header (`#!${runtimeShell}`, `set -o` per option, its
#   PATH line) and keeps the checkPhase nixpkgs runs on the result (`bash -n`, ShellCheck);
# - licenses carry `free`, and a package with an unfree license is refused (its outPath and
#   drvPath throw, as check-meta makes them) unless config.allowUnfree or
#   config.allowUnfreePredicate lets it through.
{
  system,
  overlays ? [ ],
  config ? { },
}:
let
  lib = import ./lib.nix;
  inherit (builtins) concatStringsSep;

  unfreeLicenses =
    license:
    let
      licenses = if builtins.isList license then license else [ license ];
    in
    builtins.filter (l: !(l.free or true)) licenses;

  allowedUnfree =
    attrs: config.allowUnfree or false || (config.allowUnfreePredicate or (_: false)) attrs;

  # stdenv.mkDerivation: the attributes, minus meta and passthru, go to builtins.derivation; the
  # result also holds meta, passthru, stdenv and overrideAttrs, as nixpkgs' does.
  mkDerivationWith =
    stdenv: args:
    let
      name = args.name or "${args.pname}-${args.version}";
      meta = args.meta or { };
      passthru = args.passthru or { };
      drvAttrs = builtins.removeAttrs args [
        "meta"
        "passthru"
      ];
      drv = builtins.derivation (
        drvAttrs
        // {
          inherit name system;
          builder = stdenv.shell;
          args = [
            "-e"
            "stand-in-default-builder.sh"
          ];
          stdenvName = stdenv.name;
        }
      );
      unfree = unfreeLicenses (meta.license or [ ]);
      refusal = throw "Package ‘${name}’ in the nixpkgs stand-in has an unfree license (‘${
        concatStringsSep "’, ‘" (map (l: l.shortName) unfree)
      }’), refusing to evaluate (set config.allowUnfree or config.allowUnfreePredicate).";
      valid = unfree == [ ] || allowedUnfree args;
    in
    drv
    // passthru
    // {
      inherit meta passthru stdenv;
      outPath = if valid then drv.outPath else refusal;
      drvPath = if valid then drv.drvPath else refusal;
      overrideAttrs = f: mkDerivationWith stdenv (args // f args);
    };

  # A package of nixpkgs the flake only names (a tool on a PATH, a hook).
  tool =
    name:
    mkDerivationWith stdenvNoCC {
      pname = name;
      version = "stand-in";
      inherit name;
      meta.mainProgram = name;
    };

  # pkgs/stdenv/generic/common-path.nix, and patchelf, which stdenv/linux adds to every stdenv.
  initialPathNames = [
    "coreutils"
    "findutils"
    "diffutils"
    "gnused"
    "gnugrep"
    "gawk"
    "gnutar"
    "gzip"
    "bzip2"
    "gnumake"
    "bash"
    "patch"
    "xz"
    "file"
    "patchelf"
  ];

  stdenvNoCC = {
    name = "stdenv-linux";
    shell = "/nix/store/00000000000000000000000000000000-bash-stand-in/bin/bash";
    # stdenv.shellDryRun: how writeShellScript and writeShellApplication check a script.
    shellDryRun = "${stdenvNoCC.shell} -n -O extglob";
    initialPath = map tool initialPathNames;
    hostPlatform.system = system;
    buildPlatform.system = system;
    cc = null;
    hasCC = false;
    mkDerivation = mkDerivationWith stdenvNoCC;
  };
  stdenv = stdenvNoCC // {
    cc = tool "gcc-wrapper" // {
      cc = tool "gcc" // {
        lib = tool "gcc-lib";
      };
    };
    hasCC = true;
    mkDerivation = mkDerivationWith stdenv;
  };

  makePython =
    pythonVersion:
    let
      python = tool "python3" // {
        inherit pythonVersion;
        sitePackages = "lib/python${pythonVersion}/site-packages";
        interpreter = "${tool "python3"}/bin/python3";
        pythonOnBuildForHost = python;
        executable = "python${pythonVersion}";
        # As nixpkgs' python wrapper: `interpreter` is passthru naming the environment built
        # here, so an overrideAttrs that changes the derivation keeps the old path.
        withPackages =
          f:
          let
            env = stdenv.mkDerivation {
              name = "python3-${pythonVersion}-env";
              # buildEnv's inputs: the environment's path depends on its packages.
              paths = f python.pkgs;
              passthru = {
                packagesGiven = f python.pkgs;
                interpreter = "${env}/bin/python${pythonVersion}";
              };
            };
          in
          env;
        pkgs = {
          buildPythonPackage =
            args:
            stdenv.mkDerivation (
              builtins.removeAttrs args [
                "format"
                "dependencies"
              ]
              // {
                propagatedBuildInputs = args.dependencies or [ ];
              }
            );
          toPythonModule = drv: drv;
          # The hook's script (the setup hook a build sources), with nixpkgs' substitutions:
          # tests/nix/test_wheel_install.py runs an install phase with it.
          pypaInstallHook = tool "pypa-install-hook" // {
            setupHookText =
              builtins.replaceStrings
                [ "@pythonInterpreter@" "@pythonSitePackages@" ]
                [ python.pythonOnBuildForHost.interpreter python.sitePackages ]
                (builtins.readFile ./pkgs/development/interpreters/python/hooks/pypa-install-hook.sh);
          };
          wheel = tool "wheel";
          pytest = tool "pytest";
          pytest-timeout = tool "pytest-timeout";
        };
      };
    in
    python;

  tools = lib.genAttrs [
    "autoAddDriverRunpath"
    "autoPatchelfHook"
    "bash"
    "cacert"
    "coreutils"
    "findutils"
    "gcc14"
    "git"
    "gnused"
    "hostname-debian"
    "ninja"
    "nix"
    "nixfmt"
    "nixfmt-tree"
    "patchelf"
    "procps"
    "ruff"
    "shellcheck"
    "shellcheck-minimal"
    "unzip"
    "util-linux"
  ] tool;

  # pkgs/build-support/trivial-builders/default.nix
  runCommandWith =
    {
      stdenv,
      name,
      derivationArgs ? { },
    }:
    buildCommand:
    stdenv.mkDerivation (
      {
        enableParallelBuilding = true;
        inherit buildCommand name;
        passAsFile = [ "buildCommand" ] ++ (derivationArgs.passAsFile or [ ]);
      }
      // builtins.removeAttrs derivationArgs [ "passAsFile" ]
    );
  runCommand =
    name: env:
    runCommandWith {
      stdenv = stdenvNoCC;
      inherit name;
      derivationArgs = env;
    };
  runCommandCC =
    name: env:
    runCommandWith {
      inherit stdenv name;
      derivationArgs = env;
    };

  writeTextFile =
    {
      name,
      text,
      executable ? false,
      destination ? "",
      checkPhase ? "",
      meta ? { },
      passthru ? { },
      allowSubstitutes ? false,
      preferLocalBuild ? true,
      derivationArgs ? { },
    }:
    assert destination != "" -> (builtins.substring 0 1 destination == "/" && destination != "/");
    let
      matches = builtins.match "/bin/([^/]+)" destination;
    in
    runCommand name (
      {
        inherit
          text
          executable
          checkPhase
          allowSubstitutes
          preferLocalBuild
          destination
          ;
        passAsFile = [ "text" ] ++ derivationArgs.passAsFile or [ ];
        meta =
          (if executable && matches != null then { mainProgram = builtins.head matches; } else { })
          // meta
          // derivationArgs.meta or { };
        passthru = passthru // derivationArgs.passthru or { };
      }
      // builtins.removeAttrs derivationArgs [
        "passAsFile"
        "meta"
        "passthru"
      ]
    ) "target=$out${lib.escapeShellArg destination}";

  runtimeShell = "${tools.bash}/bin/bash";
  makeBinPath = packages: concatStringsSep ":" (map (p: "${p}/bin") packages);

  writeShellApplication =
    {
      name,
      text,
      runtimeInputs ? [ ],
      runtimeEnv ? null,
      meta ? { },
      passthru ? { },
      checkPhase ? null,
      excludeShellChecks ? [ ],
      extraShellCheckFlags ? [ ],
      bashOptions ? [
        "errexit"
        "nounset"
        "pipefail"
      ],
      derivationArgs ? { },
      inheritPath ? true,
    }:
    assert builtins.isString text;
    assert runtimeEnv == null; # the flake sets none; nixpkgs' quoting of it is not copied here
    writeTextFile {
      inherit
        name
        meta
        passthru
        derivationArgs
        ;
      executable = true;
      destination = "/bin/${name}";
      allowSubstitutes = true;
      preferLocalBuild = false;
      text = ''
        #!${runtimeShell}
        ${concatStringsSep "\n" (map (option: "set -o ${option}") bashOptions)}
      ''
      + (
        if runtimeInputs != [ ] then
          ''

            export PATH="${makeBinPath runtimeInputs}${if inheritPath then ":$PATH" else ""}"
          ''
        else
          ""
      )
      + ''

        ${text}
      '';
      checkPhase =
        let
          excludeFlags =
            if excludeShellChecks != [ ] then
              [
                "--exclude"
                (concatStringsSep "," excludeShellChecks)
              ]
            else
              [ ];
        in
        if checkPhase == null then
          ''
            runHook preCheck
            ${stdenvNoCC.shellDryRun} "$target"
            ${lib.getExe tools.shellcheck-minimal} ${
              concatStringsSep " " (map lib.escapeShellArg (excludeFlags ++ extraShellCheckFlags))
            } "$target"
            runHook postCheck
          ''
        else
          checkPhase;
    };

  # pkgs/build-support/fetchurl/default.nix: a fixed-output derivation of the given hash.
  fetchurl =
    {
      url ? "",
      urls ? [ ],
      curlOpts ? "",
      curlOptsList ? [ ],
      name ? null,
      pname ? null,
      version ? null,
      hash ? "",
      outputHash ? "",
      outputHashAlgo ? "",
      sha1 ? "",
      sha256 ? "",
      sha512 ? "",
      recursiveHash ? false,
      netrcPhase ? null,
      netrcImpureEnvVars ? [ ],
      postFetch ? "",
      downloadToTemp ? false,
      executable ? false,
      showURLs ? false,
      meta ? { },
      passthru ? { },
      preferLocalBuild ? true,
      nativeBuildInputs ? [ ],
      derivationArgs ? { },
    }:
    let
      allUrls =
        if urls != [ ] && url == "" then
          urls
        else if urls == [ ] && url != "" then
          [ url ]
        else
          throw "fetchurl requires either `url` or `urls` to be set";
      colon = builtins.match "([^:]+):(.*)" hash;
    in
    assert
      hash != "" || throw "fetchurl requires a hash for fixed-output derivation: ${toString allUrls}";
    stdenvNoCC.mkDerivation {
      name = if name != null then name else baseNameOf (builtins.head allUrls);
      urls = allUrls;
      outputHashMode = if recursiveHash || executable then "recursive" else "flat";
      outputHashAlgo = if colon == null then null else builtins.head colon;
      outputHash = if colon == null then hash else builtins.elemAt colon 1;
      inherit meta passthru preferLocalBuild;
    };

  mkShell =
    args:
    stdenv.mkDerivation (
      builtins.removeAttrs args [ "packages" ]
      // {
        name = args.name or "nix-shell";
        nativeBuildInputs = (args.nativeBuildInputs or [ ]) ++ (args.packages or [ ]);
      }
    );

  # pkgs/build-support/docker/default.nix: buildLayeredImage is streamLayeredImage's closed
  # argument set plus `compressor`; the image's config JSON is `{ config, architecture, os }`
  # (architecture: Go's GOARCH); the stand-in keeps it, and the contents' store paths, as
  # attributes of the derivation so that tests can read them.
  dockerTools.buildLayeredImage =
    {
      name,
      tag ? null,
      fromImage ? null,
      contents ? [ ],
      config ? { },
      architecture ? goArch,
      created ? "1970-01-01T00:00:01Z",
      mtime ? "1970-01-01T00:00:01Z",
      uid ? 0,
      gid ? 0,
      uname ? "root",
      gname ? "root",
      maxLayers ? 100,
      extraCommands ? "",
      fakeRootCommands ? "",
      enableFakechroot ? false,
      includeStorePaths ? true,
      includeNixDB ? false,
      passthru ? { },
      meta ? { },
      layeringPipeline ? null,
      debug ? false,
      compressor ? "gz",
    }:
    assert maxLayers > 1;
    let
      baseName = baseNameOf name;
      contentsList = if builtins.isList contents then contents else [ contents ];
    in
    runCommand "${baseName}.tar.${compressor}" {
      imageConfigJson = builtins.toJSON {
        inherit config architecture;
        os = "linux";
      };
      contentsPaths = map toString contentsList;
      inherit
        created
        maxLayers
        extraCommands
        fakeRootCommands
        includeStorePaths
        ;
      passthru = passthru // {
        # nixpkgs lowercases both; the stand-in has no toLower and takes them as given.
        imageName = name;
        imageTag = if tag == null then "" else tag;
      };
      inherit meta;
    } "stand-in: no image is built";
  # pkgs/build-support/fetchzip: fetchurl's arguments plus unpacking ones; a recursive
  # fixed-output derivation of the given hash (`sha256` in nixpkgs' base32, or `hash`).
  fetchzip =
    {
      url ? "",
      urls ? [ ],
      name ? "source",
      hash ? "",
      sha256 ? "",
      stripRoot ? true,
      extension ? null,
      postFetch ? "",
      passthru ? { },
      meta ? { },
    }:
    assert hash != "" || sha256 != "" || throw "fetchzip requires a hash: ${url}";
    stdenvNoCC.mkDerivation {
      inherit name;
      urls = if urls != [ ] then urls else [ url ];
      outputHashMode = "recursive";
      outputHashAlgo = if hash != "" then null else "sha256";
      outputHash = if hash != "" then hash else sha256;
      inherit passthru meta;
    };

  # The Haskell package set as far as nix/nixfmt.nix reads it: mkDerivation (haskell-modules'
  # generic builder, whose Cabal fields are not derivation attributes) and packages by name.
  haskellPackages =
    lib.genAttrs [
      "base"
      "bytestring"
      "cmdargs"
      "containers"
      "directory"
      "file-embed"
      "filepath"
      "megaparsec"
      "mtl"
      "parser-combinators"
      "pretty-simple"
      "process"
      "safe-exceptions"
      "scientific"
      "text"
      "transformers"
      "unix"
    ] tool
    // {
      mkDerivation =
        args:
        stdenv.mkDerivation (
          builtins.removeAttrs args [
            "isLibrary"
            "isExecutable"
            "libraryHaskellDepends"
            "executableHaskellDepends"
            "jailbreak"
            "homepage"
            "description"
            "license"
            "mainProgram"
          ]
          // {
            buildInputs = args.libraryHaskellDepends or [ ] ++ args.executableHaskellDepends or [ ];
            meta = {
              inherit (args) description license;
              mainProgram = args.mainProgram or args.pname;
            };
          }
        );
    };
  haskell.lib.compose.justStaticExecutables = drv: drv;

  goArch =
    {
      "aarch64-linux" = "arm64";
      "x86_64-linux" = "amd64";
    }
    .${system};

  base =
    final:
    tools
    // {
      inherit
        lib
        config
        stdenv
        stdenvNoCC
        runCommand
        runCommandCC
        writeTextFile
        writeShellApplication
        fetchurl
        fetchzip
        haskell
        haskellPackages
        mkShell
        runtimeShell
        dockerTools
        ;
      path = ./.;
      gcc14Stdenv = final.stdenv;
      newScope = scope: lib.callPackageWith (final // scope);
      callPackage = final.newScope { };
      python312 = makePython "3.12";
    };

  # The overlays in order over the base set, each seeing the final set (as nixpkgs does).
  pkgs = builtins.foldl' (prev: overlay: prev // overlay pkgs prev) (base pkgs) overlays;
in
pkgs
