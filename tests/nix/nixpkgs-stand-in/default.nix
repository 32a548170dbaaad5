# A stand-in for `import nixpkgs { system; overlays; config; }` with only what the flake reads:
# the attributes (names checked against nixpkgs' sources, see docs/nix.md) are fake derivations
# whose builders record their arguments, so the flake's outputs can be evaluated, named and
# type-checked without nixpkgs. Nothing here builds.
{
  system,
  overlays ? [ ],
  config ? { },
}:
let
  lib = import ./lib.nix;

  derivationNamed =
    name: extra:
    let
      drv = {
        type = "derivation";
        inherit name system;
        outPath = "/nix/store/00000000000000000000000000000000-${name}";
        drvPath = "/nix/store/00000000000000000000000000000000-${name}.drv";
        meta = { };
        # As in nixpkgs, the result is another derivation: a new name gives a new store path.
        overrideAttrs =
          f:
          let
            attrs = extra // f drv;
          in
          derivationNamed (attrs.name or name) attrs;
      }
      // extra;
    in
    drv;

  mkDerivation =
    args:
    let
      name = args.name or "${args.pname}-${args.version}";
    in
    derivationNamed name (args // (args.passthru or { }));

  tool =
    name:
    derivationNamed name {
      pname = name;
      meta.mainProgram = name;
    };

  makePython =
    pythonVersion:
    let
      python = tool "python3" // {
        inherit pythonVersion;
        sitePackages = "lib/python${pythonVersion}/site-packages";
        interpreter = "/nix/store/00000000000000000000000000000000-python3/bin/python3";
        pythonOnBuildForHost = python;
        withPackages =
          f:
          derivationNamed "python3-env" {
            packagesGiven = f python.pkgs;
            interpreter = "/nix/store/00000000000000000000000000000000-python3-env/bin/python3";
          };
        pkgs = {
          buildPythonPackage = args: mkDerivation (builtins.removeAttrs args [ "format" ]);
          toPythonModule = drv: drv;
          pypaInstallHook = tool "pypa-install-hook";
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
    "unzip"
    "util-linux"
  ] tool;

  base =
    final:
    tools
    // {
      inherit lib config;
      path = ./.;
      stdenv = {
        inherit mkDerivation;
        hostPlatform.system = system;
        cc = tool "gcc-wrapper" // {
          cc = tool "gcc" // {
            lib = tool "gcc-lib";
          };
        };
      };
      gcc14Stdenv = final.stdenv;
      newScope = scope: lib.callPackageWith (final // scope);
      callPackage = final.newScope { };

      fetchurl =
        args:
        assert args ? hash && (args ? url || args ? urls);
        derivationNamed (args.name or "fetched") { inherit (args) hash; };
      runCommand =
        name: env: buildCommand:
        mkDerivation (env // { inherit name buildCommand; });
      writeShellApplication =
        args:
        assert builtins.isString args.text;
        mkDerivation {
          inherit (args) name;
          meta = (args.meta or { }) // {
            mainProgram = args.name;
          };
          inherit (args) text;
          inheritPath = args.inheritPath or true;
        };
      mkShell = args: mkDerivation (args // { name = "nix-shell"; });
      python312 = makePython "3.12";
    };

  # The overlays in order over the base set, each seeing the final set (as nixpkgs does).
  pkgs = builtins.foldl' (prev: overlay: prev // overlay pkgs prev) (base pkgs) overlays;
in
pkgs
