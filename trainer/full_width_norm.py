"""MiniMax-M2's q/k norms for Megatron-Core, which has only per-head ones: an RMSNorm over every head of the
projection at once (`ModelConfig.qk_layernorm_full_width`), as Megatron-Bridge's minimax_m2_provider builds it.

SelfAttention applies its q/k norm to [seq, batch, local heads, head_dim]; under TP each rank holds its heads' part of
the weight (split by head, `reshard.logical`) and the sum of squares is all-reduced over the TP group, so every rank
divides by the whole projection's mean square. The all-reduce is autograd's (its backward sums the gradients too).
"""

from __future__ import annotations

import torch

_EPS = 1e-5  # Megatron-Core's layernorm_epsilon default; SelfAttention passes the model's


class FullWidthRMSNorm(torch.nn.Module):
    def __init__(self, heads: int, head_dim: int, config, eps: float):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"full-width q/k norms are RMSNorms; the model's normalization is {config.normalization}")
        self.tp = config.tensor_model_parallel_size
        if heads % self.tp:
            raise ValueError(f"full-width q/k norms over {heads} heads do not split over TP={self.tp}")
        self.width, self.eps = heads * head_dim, eps
        self.weight = torch.nn.Parameter(torch.ones(heads // self.tp * head_dim, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(*x.shape[:2], -1).float()
        squares = flat.pow(2).sum(-1, keepdim=True)
        if self.tp > 1:
            from megatron.core import parallel_state

            squares = torch.distributed.nn.functional.all_reduce(squares, group=parallel_state.get_tensor_model_parallel_group())
        normed = flat * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight * normed.to(x.dtype)).reshape(x.shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The weight split over TP on its only axis (torch_dist's `q_layernorm.weight [heads * head_dim]`)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets)


# Classes, as the layer spec needs: megatron's build_module calls a class but returns a plain function uncalled.
class FullWidthQNorm:
    def __new__(cls, hidden_size: int, config, eps: float = _EPS) -> FullWidthRMSNorm:
        return FullWidthRMSNorm(config.num_attention_heads, hidden_size, config, eps)


class FullWidthKNorm:
    def __new__(cls, hidden_size: int, config, eps: float = _EPS) -> FullWidthRMSNorm:
        return FullWidthRMSNorm(config.num_query_groups or config.num_attention_heads, hidden_size, config, eps)
