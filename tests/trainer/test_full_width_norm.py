"""MiniMax-M2's full-width q/k norm module for Megatron-Core against transformers' own MiniMaxM2RMSNorm: the same
values on the same input at one TP rank (the TP split and its all-reduce are proven by test_hf_logits.py's TP2 case)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from reshard.trainer.full_width_norm import FullWidthKNorm, FullWidthQNorm


def _config(**changes):
    return SimpleNamespace(**{"normalization": "RMSNorm", "tensor_model_parallel_size": 1, "params_dtype": torch.float32,
                              "num_attention_heads": 4, "num_query_groups": 2, **changes})


@pytest.mark.parametrize("factory,heads", [(FullWidthQNorm, 4), (FullWidthKNorm, 2)])
def test_it_normalises_every_head_at_once_as_transformers_does(factory, heads):
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm

    torch.manual_seed(0)
    norm, reference = factory(16, _config(), eps=1e-6), MiniMaxM2RMSNorm(heads * 16, eps=1e-6)
    weight = 1 + 0.1 * torch.randn(heads * 16)
    norm.weight.data.copy_(weight)
    reference.weight.data.copy_(weight)
    x = torch.randn(5, 2, heads, 16)  # megatron's [seq, batch, heads, head_dim]; transformers' [batch, seq, heads * head_dim]
    ours = norm(x)
    assert ours.shape == x.shape
    theirs = reference(x.reshape(5, 2, heads * 16)).reshape(x.shape)
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=0)
    per_head = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.reshape(heads, 16)
    assert (ours - per_head).abs().max() > 1e-2  # a per-head norm is another function


def test_it_refuses_what_it_cannot_be():
    with pytest.raises(ValueError, match="normalization is LayerNorm"):
        FullWidthQNorm(16, _config(normalization="LayerNorm"))
    with pytest.raises(ValueError, match="over 2 heads do not split over TP=4"):
        FullWidthKNorm(16, _config(tensor_model_parallel_size=4))
