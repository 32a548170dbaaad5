"""Stand-ins the GPU harness puts into a site tree for packages it cannot carry (see
docs/gpu-harness.md, "Workarounds"). Never imported from here: `prepare` copies them."""
