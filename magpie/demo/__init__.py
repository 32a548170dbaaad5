"""Tiny models, tokenizers and the vLLM overlay that the demo (and the tests) build locally."""
