# nixfmt 1.4.0: the release tests/lint.sh formats with in CI, built from its source tag with the
# pinned nixpkgs' Haskell package set, so checks.formatting and the dev shell format exactly as
# CI does whichever nixfmt release that nixpkgs carries (layout changes between releases: a file
# 1.4.0 accepts may be refused by another). The source hash is the one nixpkgs' own package of
# 1.4.0 records (pkgs/by-name/ni/nixfmt/generated-package.nix); the dependencies are nixfmt.cabal's.
{
  lib,
  haskell,
  haskellPackages,
  fetchzip,
}:
let
  hp = haskellPackages;
in
haskell.lib.compose.justStaticExecutables (
  hp.mkDerivation {
    pname = "nixfmt";
    version = "1.4.0";
    src = fetchzip {
      url = "https://github.com/nixos/nixfmt/archive/v1.4.0.tar.gz";
      sha256 = "123mc70ly0glvm8nm4a52fz4xa1619gf1g5k2m45cazb1d6di6z7";
    };
    isLibrary = true;
    isExecutable = true;
    libraryHaskellDepends = [
      hp.base
      hp.containers
      hp.megaparsec
      hp.mtl
      hp.parser-combinators
      hp.pretty-simple
      hp.scientific
      hp.text
      hp.transformers
    ];
    executableHaskellDepends = [
      hp.base
      hp.bytestring
      hp.cmdargs
      hp.directory
      hp.file-embed
      hp.filepath
      hp.process
      hp.safe-exceptions
      hp.text
      hp.transformers
      hp.unix
    ];
    # Upper bounds of the cabal file are not the pinned package set's versions.
    jailbreak = true;
    homepage = "https://github.com/NixOS/nixfmt";
    description = "The official Nix formatter, release 1.4.0 (what CI's lint runs)";
    license = lib.licenses.mpl20;
    mainProgram = "nixfmt";
  }
)
