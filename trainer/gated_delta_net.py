"""Megatron-Core's Gated DeltaNet (Qwen3-Next's linear attention) on the CPU, for the trainer and the test oracle only.

megatron-core 0.16.1 builds GatedDeltaNet only in Transformer Engine's spec and computes it with flash-linear-attention's
Triton kernels (`chunk_gated_delta_rule`, `l2norm`) and causal_conv1d, none of which run here. Stand-ins, set by
`use_torch_kernels()` inside this trainer (never by reshard's conversions):
- the recurrence: megatron-core's own `torch_chunk_gated_delta_rule` (transformers' torch version of the same rule,
  which megatron-core takes under `deterministic_mode`), and the convolution as the plain depthwise Conv1d plus SiLU
  (also what it does without causal_conv1d);
- `l2norm`: transformers' (x * rsqrt(sum(x^2) + 1e-6)), the form fla's kernel computes;
- `_apply_gated_norm` without torch.compile's wrapper (inductor wants a C compiler at first call).
The module's weights, names and torch_dist keys are megatron-core's own; only `in_proj`'s fused input norm is built
here (`NormColumnParallelLinear`: `layer_norm_weight` and `weight`, as Transformer Engine's LayerNormColumnParallelLinear
names them and registers them: the norm first, which the DistributedOptimizer's buffers follow).
"""

from __future__ import annotations

import torch

from reshard.trainer.zero_centred_norm import ZeroCentredRMSNorm, zero_centred_rms_norm


def use_torch_kernels() -> None:
    """Point megatron-core's gated_delta_net module at the torch stand-ins above (idempotent)."""
    from megatron.core.ssm import gated_delta_net
    from transformers.models.qwen3_next.modeling_qwen3_next import l2norm

    gated_delta_net.HAVE_FLA = True
    gated_delta_net.l2norm = l2norm
    gated_delta_net.causal_conv1d_fn = None
    gated_delta_net.chunk_gated_delta_rule = gated_delta_net.torch_chunk_gated_delta_rule
    method = gated_delta_net.GatedDeltaNet._apply_gated_norm
    gated_delta_net.GatedDeltaNet._apply_gated_norm = getattr(method, "_torchdynamo_orig_callable", method)


def norm_column_parallel_linear(norm=zero_centred_rms_norm, init: float = 0.0):
    """ColumnParallelLinear with its input's RMSNorm fused in (`norm(x, weight, eps)`, zero-centred unless said, its
    weight first `init`), as a class built like megatron-core's linears."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class NormColumnParallelLinear(ColumnParallelLinear):
        def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.eps = config.layernorm_epsilon
            self.layer_norm_weight = torch.nn.Parameter(torch.full((input_size,), init, dtype=config.params_dtype))
            # registered before weight, as TE's LayerNormLinear does (layernorm_linear.py:1262,1358; reshard.optim.order)
            self._parameters = {"layer_norm_weight": self._parameters.pop("layer_norm_weight"), **self._parameters}

        def forward(self, x: torch.Tensor, *args, **kwargs):
            return super().forward(norm(x, self.layer_norm_weight, self.eps), *args, **kwargs)

    return NormColumnParallelLinear


def gated_delta_net_spec():
    """The self-attention spec of a Gated DeltaNet layer (its input norm inside in_proj)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    use_torch_kernels()
    return ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=norm_column_parallel_linear(), out_norm=ZeroCentredRMSNorm, out_proj=RowParallelLinear))
