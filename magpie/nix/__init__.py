"""Build-time helpers of the Nix flake: wheel pins, wheel libraries, FlashInfer AOT."""
