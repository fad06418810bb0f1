"""Zero-centred RMSNorm for Megatron-Core's local (CPU) spec: the weight stored less one, scale = 1 + weight
(megatron-core's layernorm_zero_centered_gamma, Megatron-LM's --apply-layernorm-1p, HF Qwen3-Next's RMSNorm), which
megatron-core has only as Transformer Engine's norms (its WrappedTorchNorm refuses it). Computed as transformers'
Qwen3NextRMSNorm computes it: in float32, (x * rsqrt(mean(x^2) + eps)) * (1 + weight), cast back."""

from __future__ import annotations

import torch


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    flat = x.float()
    normed = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).type_as(x)


class ZeroCentredRMSNorm(torch.nn.Module):
    """A norm module as megatron-core's layer specs build one (config, hidden_size, eps)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"zero-centred norms here are RMSNorms; the model's normalization is {config.normalization}")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centred_rms_norm(x, self.weight, self.eps)
