"""The GPU harness: runs the real vLLM on a lent GPU machine (see docs/gpu-harness.md)."""
