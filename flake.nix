{
  description = "vLLM with magpie-vllm-plugins' patch series (PLE on SSD, MTP draft-head pruning), one build per release in magpie/releases.json, its apps and tools";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";

  outputs =
    { self, nixpkgs }:
    let
      magpieLib = import ./nix/lib.nix;
      inherit (nixpkgs) lib;
      forAllSystems = lib.genAttrs magpieLib.systems;
      scopeOf = system: self.legacyPackages.${system}.magpie-vllm-plugins;
    in
    {
      lib = magpieLib;

      overlays.default = import ./nix/overlay.nix;

      # nixpkgs with the overlay, imported once per system; every output below reads it.
      legacyPackages = forAllSystems (
        system:
        import nixpkgs {
          inherit system;
          overlays = [ self.overlays.default ];
          # The wheel closure carries NVIDIA's CUDA libraries under NVIDIA's license.
          config.allowUnfreePredicate = pkg: lib.getName pkg == "vllm-wheel-closure";
        }
      );

      packages = forAllSystems (
        system:
        import ./nix/packages.nix { scope = scopeOf system; }
        // {
          image = self.legacyPackages.${system}.callPackage ./nix/image.nix { scope = scopeOf system; };
        }
      );

      # The default release's apps, and for each other release the apps that run its vLLM.
      apps = forAllSystems (system: magpieLib.mkAllApps (scopeOf system));

      devShells = forAllSystems (system: {
        default = (scopeOf system).devShell;
      });

      checks = forAllSystems (
        system:
        import ./nix/checks.nix {
          pkgs = self.legacyPackages.${system};
          scope = scopeOf system;
        }
      );

      formatter = forAllSystems (system: self.legacyPackages.${system}.nixfmt-tree);
    };
}
