"""A stand-in for FlashInfer, written into the GPU harness's site tree (docs/gpu-harness.md).

vLLM 0.34.0's CUDA Qwen3.5 and Qwen4Exp models call `flashinfer.norm` for every RMSNorm,
whatever backend is chosen. FlashInfer builds those kernels with nvcc at first use (or takes them
from flashinfer-cubin); the lent H200 machine has no registry to install either and a call carries
64 MiB, so the harness carries this package instead: `norm` in plain torch, and no other
submodule, so every other `import flashinfer.X` fails as if FlashInfer were absent. vLLM's
`has_flashinfer()` then still says no (no nvcc or ninja, no cubin package), so no other
FlashInfer path is taken. Slower than FlashInfer's fused kernels (a few small kernels per norm
instead of one): figures taken with it say so.
"""

__version__ = "0.0.0+magpie-gpu-harness-stand-in"
