{
  description = "vLLM 0.29.0 with magpie-vllm-plugins' patch series (PLE on SSD, MTP draft-head pruning), its apps and tools";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";

  outputs =
    { self, nixpkgs }:
    let
      magpieLib = import ./nix/lib.nix;
      inherit (nixpkgs) lib;

      pkgsFor =
        system:
        import nixpkgs {
          inherit system;
          overlays = [ self.overlays.default ];
          # The wheel closure carries NVIDIA's CUDA libraries under NVIDIA's license.
          config.allowUnfreePredicate = pkg: lib.getName pkg == "vllm-wheel-closure";
        };
      forAllSystems = f: lib.genAttrs magpieLib.systems (system: f (pkgsFor system));
    in
    {
      lib = magpieLib;

      overlays.default = import ./nix/overlay.nix;

      packages = forAllSystems (pkgs: import ./nix/packages.nix { inherit pkgs; });

      apps = forAllSystems (pkgs: magpieLib.mkApps pkgs.magpie-vllm-plugins.apps);

      devShells = forAllSystems (pkgs: {
        default = pkgs.magpie-vllm-plugins.callPackage ./nix/devshell.nix { };
      });

      checks = forAllSystems (pkgs: pkgs.magpie-vllm-plugins.callPackage ./nix/checks.nix { });

      formatter = forAllSystems (pkgs: pkgs.nixfmt);
    };
}
