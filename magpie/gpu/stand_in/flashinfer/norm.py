"""FlashInfer's Gemma RMSNorm entry points in plain torch (the harness's stand-in).

gemma_rmsnorm: y = x / sqrt(mean(x^2) + eps) * (1 + weight), computed in float32, returned in
x's dtype. gemma_fused_add_rmsnorm: residual += x (in place, the float32 sum rounded to
residual's dtype), then x = gemma_rmsnorm of the float32 sum (in place), as FlashInfer's fused
kernel does.
"""

from __future__ import annotations

import torch


def _normed(x32: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    scale = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x32 * scale * (1.0 + weight.float())


def gemma_rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    y = _normed(input.float(), weight, eps).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def gemma_fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    summed = input.float() + residual.float()
    residual.copy_(summed.to(residual.dtype))
    input.copy_(_normed(summed, weight, eps).to(input.dtype))
