# The few nixpkgs `lib` functions the flake uses, written for tests/nix/test_flake_outputs.py
# (nixpkgs cannot be fetched here). `callPackageWith`, `makeOverridable` and `makeScope` behave
# as nixpkgs' lib/customisation.nix: callPackage adds `override` and `overrideDerivation` to
# any attribute set a file returns (and refuses missing arguments), which is what made
# `checks.<system>.override` appear before.
let
  inherit (builtins)
    attrNames
    concatStringsSep
    filter
    functionArgs
    intersectAttrs
    isAttrs
    isFunction
    listToAttrs
    map
    ;

  makeOverridable =
    f: origArgs:
    let
      result = f origArgs;
      newArgsOf = newArgs: if isFunction newArgs then newArgs origArgs else newArgs;
      overrideWith = newArgs: origArgs // newArgsOf newArgs;
    in
    if isAttrs result then
      result
      // {
        override = newArgs: makeOverridable f (overrideWith newArgs);
        overrideDerivation = fdrv: makeOverridable (args: (f args) // fdrv (f args)) origArgs;
      }
      // (
        if result ? overrideAttrs then
          { overrideAttrs = fdrv: makeOverridable (args: (f args).overrideAttrs fdrv) origArgs; }
        else
          { }
      )
    else if isFunction result then
      {
        override = newArgs: makeOverridable f (overrideWith newArgs);
        __functor = self: result;
      }
    else
      result;

  callPackageWith =
    autoArgs: fn: args:
    let
      f = if isFunction fn then fn else import fn;
      fargs = functionArgs f;
      allArgs = intersectAttrs fargs autoArgs // args;
      missing = filter (name: !fargs.${name} && !(allArgs ? ${name})) (attrNames fargs);
    in
    if missing == [ ] then
      makeOverridable f allArgs
    else
      throw "callPackage ${toString fn}: the nixpkgs stand-in has no ${concatStringsSep ", " missing}";

  makeScope =
    newScope: f:
    let
      self = f self // {
        newScope = scope: newScope (self // scope);
        callPackage = self.newScope { };
        overrideScope = g: makeScope newScope (final: f final // g final (f final));
        packages = f;
      };
    in
    self;

  optionals = cond: list: if cond then list else [ ];
in
{
  inherit
    makeOverridable
    callPackageWith
    makeScope
    optionals
    ;
  inherit (builtins) mapAttrs concatStringsSep;
  genAttrs =
    names: f:
    listToAttrs (
      map (name: {
        inherit name;
        value = f name;
      }) names
    );
  getName = drv: drv.pname or drv.name;
  getExe = drv: "${drv}/bin/${drv.meta.mainProgram}";
  optional = cond: item: optionals cond [ item ];
  concatMapStrings = f: list: concatStringsSep "" (map f list);
  concatMapStringsSep =
    sep: f: list:
    concatStringsSep sep (map f list);
  escapeShellArg = text: "'${text}'";
  removePrefix =
    prefix: text:
    let
      n = builtins.stringLength prefix;
    in
    if builtins.substring 0 n text == prefix then
      builtins.substring n (builtins.stringLength text - n) text
    else
      text;
  # lib/licenses.nix: `free` is what check-meta reads to refuse an unfree package.
  licenses = {
    asl20 = {
      shortName = "asl20";
      free = true;
    };
    bsd3 = {
      shortName = "bsd3";
      free = true;
    };
    mit = {
      shortName = "mit";
      free = true;
    };
    mpl20 = {
      shortName = "mpl20";
      free = true;
    };
    unfreeRedistributable = {
      shortName = "unfreeRedistributable";
      free = false;
    };
  };
  sourceTypes.binaryNativeCode.shortName = "binaryNativeCode";
  fileset = {
    unions = paths: paths;
    # A store path stand-in that keeps what it holds (tests/nix/test_sandbox_emulation.py copies it).
    toSource =
      { root, fileset }:
      {
        outPath = "${toString root}-filtered";
        inherit root fileset;
      };
  };
}
